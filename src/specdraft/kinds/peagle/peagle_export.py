"""P-EAGLE heads in vllm-project/speculators' layout (which vLLM serves), and read back.

`scripts/export.py --format speculators` writes a P-EAGLE head as speculators 0.9.0's
PEagleSpeculatorConfig (a subclass of Eagle3SpeculatorConfig) and PEagleDraftModel hold it: the
EAGLE-3 folder of kinds/eagle/eagle_export.py with

    config.json        speculators_model_type peagle, architectures [PEagleSpeculator],
                       speculators_config.algorithm peagle, mask_token_id, embed_requires_grad
                       false (the head reads the target's embedding, frozen), num_depths (K, the
                       tokens one forward drafts; speculators keeps it only as the
                       speculative_tokens its trainer writes, K), and every EAGLE-3 field
    model.safetensors  the EAGLE-3 weights and mask_hidden (1, 1, 3 hidden), its three blocks
                       in the order fc's columns are written (the fused layers ascending)

speculative_tokens is the chain served, min(decode.gamma, K); a folder without num_depths (one
speculators trained) drafts K = speculative_tokens. The one speculators entry of FORMATS
(`SPECULATORS` here) sends each drafter to its writer and each folder, by its
speculators_model_type, to its reader.
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.formats.export_formats import Held, integer
from specdraft.kinds.eagle import eagle_export, eagle_formats
from specdraft.kinds.eagle.eagle_export import in_layer_order, speculative_tokens
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter
from specdraft.targets.target import Target

ARCHITECTURE = "PEagleSpeculator"


def write_speculators(
    drafter: PEagleDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict]:
    """(config.json, the weights) of a P-EAGLE head in speculators' layout."""
    config, state = eagle_export.write_speculators(drafter, base_model, decode)
    cfg = drafter.config
    config.update({
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "peagle",
        "mask_token_id": cfg.mask_token_id,
        "embed_requires_grad": False,
        "num_depths": cfg.num_depths,
    })  # fmt: skip
    spec = config["speculators_config"]
    spec["algorithm"] = "peagle"
    spec["proposal_methods"][0]["speculative_tokens"] = min(decode.gamma, cfg.num_depths)
    # fc's column blocks are written in ascending layer order (eagle_export.reference_state);
    # mask_hidden is fc's input, so its blocks follow the same order
    mask = drafter.mask_hidden.detach().to("cpu", state["fc.weight"].dtype)
    state["mask_hidden"] = in_layer_order(mask, cfg.feature_layers, drafter.target.hidden_size)
    return config, state


def problems(config: dict, vocab_size: int | None = None) -> list[str]:
    """What a P-EAGLE config.json holds beyond EAGLE-3's that speculators and vLLM need (and
    specdraft's head computes), each said in a sentence; [] when it loads."""
    out = []
    if config.get("architectures") != [ARCHITECTURE]:
        out.append(f"architectures must be [{ARCHITECTURE}]")
    if (config.get("speculators_config") or {}).get("algorithm") != "peagle":
        out.append("speculators_config.algorithm must be peagle")
    mask = config.get("mask_token_id")
    if not integer(mask, 0):
        out.append(f"mask_token_id must be a token id (the parallel slots' input); got {mask!r}")
    elif vocab_size is not None and mask >= vocab_size:
        out.append(f"mask_token_id {mask} is outside the target's {vocab_size} tokens")
    depths = config.get("num_depths", speculative_tokens(config))
    if not integer(depths, 2):
        out.append(f"num_depths (K) must be an integer >= 2; got {depths!r}")
    return out


def read_speculators(
    folder: Path, config: dict, target: Target, *, strict: bool = True
) -> PEagleDrafter:
    """A P-EAGLE folder in speculators' layout, checked against `target` as an EAGLE-3 head is
    (kinds/eagle/eagle_formats.py read_head) and for its own fields, then built as our head."""
    where = folder / CONFIG_NAME
    found = problems(config, target.vocab_size)
    if found:
        raise CheckpointError(f"{where} is not a loadable P-EAGLE head: {'; '.join(found)}")
    depths = config.get("num_depths", speculative_tokens(config))

    def build(head, target, d2t) -> PEagleDrafter:
        try:
            cfg = PEagleConfig(
                num_depths=depths,
                feature_layers=head.feature_layers,
                draft_vocab_size=head.draft_vocab_size,
                norm_before_residual=head.norm_before_residual,
                mask_token_id=config["mask_token_id"],
            )
            return PEagleDrafter(cfg, target, d2t)
        except ValueError as e:
            raise CheckpointError(f"{where}: {e}") from e

    try:
        return eagle_formats.read_head(
            folder, config, target, fmt="speculators", strict=strict, build=build
        )
    except CheckpointError as e:
        if config.get("embed_requires_grad") and "embed_tokens" in str(e):
            raise CheckpointError(
                f"{e} (this P-EAGLE head trained its own embedding, embed_requires_grad=true; "
                "specdraft's P-EAGLE reads the target's, frozen)"
            ) from e
        raise


def validate_folder(folder: str | Path, vocab_size: int) -> list[str]:
    """Every problem speculators or vLLM would find in a written P-EAGLE folder; [] when it
    loads."""
    config = json.loads((Path(folder) / CONFIG_NAME).read_text())
    found = problems(config, vocab_size)
    return found + eagle_formats.validate_folder(folder, "speculators", vocab_size)


SPECULATORS = Held(
    PEagleDrafter.kind, ARCHITECTURE, write_speculators, read_speculators, validate_folder
)
