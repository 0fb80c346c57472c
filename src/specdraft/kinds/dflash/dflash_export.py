"""DFlash drafters in vllm-project/speculators' layout (which vLLM serves), and read back.

`scripts/export.py --format speculators` writes an EAGLE-3 head or a DFlash drafter: the one
"speculators" entry of FORMATS (export_formats.also_holding, given this module's `SPECULATORS`)
sends each drafter to its writer and each folder, by its `speculators_model_type`, to its
reader. A DFlash folder (speculators 0.9.0's DFlashSpeculatorConfig and DFlashDraftModel, read
for this layout):

    config.json        speculators_model_type dflash, architectures [DFlashSpeculator],
                       transformer_layer_config (the layers' Qwen3Config as a diff dict,
                       num_hidden_layers = the drafter's layers), draft_vocab_size (the target's
                       whole vocabulary), block_size, target_hidden_size,
                       aux_hidden_state_layer_ids (ascending), mask_token_id,
                       sample_from_anchor false, sliding_window_non_causal false,
                       speculators_config {algorithm dflash, proposal_methods [{proposal_type
                       greedy, speculative_tokens}], default_proposal_method greedy, verifier
                       {name_or_path, architectures}}, and our specdraft_decoding
    model.safetensors  layers.{i}.self_attn.{q,k,v,o}_proj.weight, .q_norm/.k_norm.weight,
                       layers.{i}.mlp.{gate,up,down}_proj.weight,
                       layers.{i}.input_layernorm/post_attention_layernorm.weight, fc.weight,
                       hidden_norm.weight, norm.weight. Not embed_tokens nor the full-vocabulary
                       lm_head: speculators takes both from the verifier (load_verifier_weights).

The layer ids are numbered as for EAGLE-3 (kinds/eagle/eagle_export.py): id i is the output of
decoder layer i. The engines capture the layers in ascending order, so fc's column blocks are
written in that order. Our id L (the final normed state) is never captured by an engine: a
drafter reading it is refused. speculative_tokens is the chain served: min(gamma, block_size - 1).
"""

from __future__ import annotations

import json
from pathlib import Path

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.formats.export_formats import (
    Held,
    check_names_and_shapes,
    folder_problems,
    folder_weights,
    integer,
)
from specdraft.kinds.dflash.dflash import DFlashDrafter, layer_config
from specdraft.kinds.eagle.eagle_export import (
    SPECULATORS_VERSION,
    check_captured,
    engine_layer_dict,
    in_layer_order,
    layer_shapes,
    speculative_tokens,
    speculators_config,
    speculators_problems,
)
from specdraft.kinds.eagle.eagle_formats import check_verifier, layer_differences
from specdraft.targets.target import Target

WEIGHTS = "model.safetensors"
ARCHITECTURE = "DFlashSpeculator"


# --- writing -------------------------------------------------------------------------------------


def write_speculators(
    drafter: DFlashDrafter, base_model: str, decode: DecodeConfig
) -> tuple[dict, dict]:
    """(config.json, the weights) of a DFlash drafter in speculators' layout, serving chains of
    min(decode.gamma, block_size - 1)."""
    cfg, target = drafter.config, drafter.target
    ids = list(cfg.aux_layers)
    check_captured(ids, target.num_layers, "drafter reads", "aux_layers")
    H = target.hidden_size
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in drafter.state_dict().items()}
    state["fc.weight"] = in_layer_order(state["fc.weight"], ids, H)
    config = {
        "architectures": [ARCHITECTURE],
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "transformer_layer_config": layer_config_dict(target, cfg.num_layers),
        "draft_vocab_size": target.vocab_size,
        "block_size": cfg.block_size,
        "target_hidden_size": H,
        "aux_hidden_state_layer_ids": sorted(ids),
        "mask_token_id": cfg.mask_token_id,
        "sample_from_anchor": False,
        "sliding_window_non_causal": False,
        "speculators_config": speculators_config(
            "dflash", min(decode.gamma, drafter.drafts_per_block), base_model, target
        ),
    }
    return config, state


def layer_config_dict(target: Target, num_layers: int) -> dict:
    """The layers' Qwen3Config as speculators writes it (a diff dict, model_type qwen3)."""
    config = layer_config(target.config, num_layers).to_diff_dict()
    return engine_layer_dict({**config, "model_type": "qwen3"})


# --- the layout's rules --------------------------------------------------------------------------


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The exact weight names and shapes of a DFlash folder with this config.json."""
    layer = config["transformer_layer_config"]
    H = layer["hidden_size"]
    per_layer = layer_shapes(layer, width=H, qk_norm=True)
    shapes = {
        f"layers.{i}.{k}": v
        for i in range(layer["num_hidden_layers"])
        for k, v in per_layer.items()
    }
    n_aux = len(config["aux_hidden_state_layer_ids"])
    target_h = config.get("target_hidden_size") or H
    shapes.update({"fc.weight": (H, n_aux * target_h), "hidden_norm.weight": (H,), "norm.weight": (H,)})  # fmt: skip
    return shapes


def layout_problems(
    config: dict, names: set[str] | None = None, model_type: str = "dflash"
) -> list[str]:
    """What speculators' and vLLM's loaders would refuse or misread in a DFlash config.json (and,
    when given, its weight names), each a sentence, or what specdraft's drafter does not
    compute; [] when it loads. model_type dspark: the same backbone fields, of a DSpark folder
    (kinds/dspark/dspark_export.py checks its heads), whose anchor slot may draft."""
    problems: list[str] = []

    def need(cond: bool, message: str) -> None:
        if not cond:
            problems.append(message)

    problems += speculators_problems(config, names)
    need(
        config.get("speculators_model_type") == model_type,
        f"speculators_model_type != {model_type}",
    )
    layer = config.get("transformer_layer_config")
    need(isinstance(layer, dict), "transformer_layer_config must be a dict (a Qwen3Config)")
    if isinstance(layer, dict):
        for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
            need(integer(layer.get(key)), f"transformer_layer_config.{key} must be an integer >= 1")
        need(
            not any(t != "full_attention" for t in layer.get("layer_types") or ()),
            "sliding-window draft layers are a variant specdraft's drafter does not compute",
        )
    need(integer(config.get("block_size"), 2), "block_size must be an integer >= 2")
    need(integer(config.get("mask_token_id"), 0), "mask_token_id must be a token id")
    need(integer(config.get("draft_vocab_size")), "draft_vocab_size must be an integer >= 1")
    ids = config.get("aux_hidden_state_layer_ids")
    need(
        isinstance(ids, list) and bool(ids) and all(integer(i, 0) for i in ids),
        "aux_hidden_state_layer_ids must list the target layers the drafter reads",
    )
    from_anchor = config.get("sample_from_anchor")
    if model_type == "dflash":
        need(
            from_anchor is False,
            "sample_from_anchor must be false (the anchor is the bonus token; true is DSpark's "
            "variant: a dspark folder)",
        )
    else:
        need(isinstance(from_anchor, bool), "sample_from_anchor must be true or false")
    drafts = (config.get("block_size") or 2) - (0 if from_anchor is True else 1)
    tokens = speculative_tokens(config)
    need(
        integer(tokens) and tokens <= drafts,
        f"speculators_config.proposal_methods[0].speculative_tokens must be in 1..{drafts} "
        "(the tokens a block drafts)",
    )
    return problems


def validate_folder(
    folder: str | Path,
    vocab_size: int,
    problems_of=layout_problems,
    shapes_of=expected_shapes,
) -> list[str]:
    """Every problem speculators or vLLM would find in a written DFlash folder (or, with a
    kind's own `problems_of(config, names)` and `shapes_of(config)`, a folder of that kind);
    [] when it loads."""
    problems = folder_problems(folder, WEIGHTS, problems_of, shapes_of)
    config = json.loads((Path(folder) / CONFIG_NAME).read_text())
    if not problems_of(config) and config["draft_vocab_size"] != vocab_size:
        problems.append(f"draft_vocab_size {config['draft_vocab_size']} is not the target's {vocab_size}")  # fmt: skip
    return problems


# --- reading -------------------------------------------------------------------------------------


def read_drafter(
    folder: Path,
    config: dict,
    target: Target,
    *,
    strict: bool = True,
    drafter_class: type[DFlashDrafter] = DFlashDrafter,
    problems_of=layout_problems,
    shapes_of=expected_shapes,
    fields: tuple[str, ...] = (),
) -> DFlashDrafter:
    """A DFlash folder in speculators' layout, checked against `target` (layer shape, sizes,
    verifier, exact names and shapes) before a module is built. A kind built on DFlash's backbone
    (kinds/dspark/dspark_export.py) gives its `drafter_class`, its own `problems_of(config)` and
    `shapes_of(config)`, and the config.json `fields` its config takes as written."""
    where = folder / CONFIG_NAME
    name = drafter_class.__name__.removesuffix("Drafter")
    problems = problems_of(config)
    if problems:
        raise CheckpointError(f"{where} is not a loadable {name} drafter: {'; '.join(problems)}")
    layer = config["transformer_layer_config"]
    ours = layer_config(target.config, layer["num_hidden_layers"]).to_dict()
    differ = layer_differences(layer, ours)
    hidden = config.get("target_hidden_size") or layer["hidden_size"]
    if hidden != target.hidden_size:
        differ.append(f"target_hidden_size {hidden} (the target's {target.hidden_size})")
    if config["draft_vocab_size"] != target.vocab_size:
        differ.append(
            f"draft_vocab_size {config['draft_vocab_size']} (specdraft's DFlash drafts over the "
            f"target's whole vocabulary, {target.vocab_size}; a reduced one is not read yet)"
        )
    if differ:
        raise CheckpointError(
            f"{where}: the drafter differs from the target {target.name!r} in {'; '.join(differ)}: "
            "load the target it was trained for"
        )
    if strict:
        check_verifier(config["speculators_config"]["verifier"], target, where)
    state, where_w = folder_weights(folder, name, WEIGHTS)
    state = {k.removeprefix("model."): v for k, v in state.items()}
    # what speculators also accepts in the folder: the verifier's own embedding and LM head
    for shared in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
        state.pop(shared, None)
    check_names_and_shapes(state, shapes_of(config), where_w, target, config)
    try:
        drafter_config = drafter_class.config_class(
            num_layers=layer["num_hidden_layers"],
            block_size=config["block_size"],
            aux_layers=list(config["aux_hidden_state_layer_ids"]),
            mask_token_id=config["mask_token_id"],
            **{key: config[key] for key in fields if key in config},
        )
        drafter = drafter_class(drafter_config, target, init=False)
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from e
    drafter.load_state_dict(state, strict=True)
    return drafter


SPECULATORS = Held(
    DFlashDrafter.kind, ARCHITECTURE, write_speculators, read_drafter, validate_folder
)
