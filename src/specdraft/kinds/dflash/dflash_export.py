"""DFlash drafters in vllm-project/speculators' layout (which vLLM serves), and read back.

`scripts/export.py --format speculators` writes an EAGLE-3 head or a DFlash drafter: the one
"speculators" entry of FORMATS (`speculators_format`) sends each drafter to its writer and each
folder, by its `speculators_model_type`, to its reader. A DFlash folder (speculators 0.9.0's
DFlashSpeculatorConfig and DFlashDraftModel, read for this layout):

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

import torch
from safetensors.torch import load_file

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.formats.export_formats import (
    ExportError,
    Format,
    also_holding,
    check_names_and_shapes,
    few,
    read_weights,
)
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter, layer_config
from specdraft.kinds.eagle.eagle_export import GENERIC_KEYS, LAYER_FIELDS, SPECULATORS_VERSION
from specdraft.kinds.eagle.eagle_formats import check_verifier
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
    if target.num_layers in ids:
        raise ExportError(
            f"this drafter reads target hidden state {target.num_layers}, the final normed state, "
            "which the engines never capture (they take the pre-norm outputs of decoder layers): "
            f"retrain with drafter.aux_layers below {target.num_layers} to serve it"
        )
    if len(set(ids)) < len(ids):
        raise ExportError(
            f"this drafter reads target layers {ids}, a layer twice; the engines capture each "
            "layer once, so fc would get fewer features than it reads: retrain with distinct "
            "drafter.aux_layers"
        )
    H = target.hidden_size
    state = {k: v.detach().to("cpu").contiguous().clone() for k, v in drafter.state_dict().items()}
    order = sorted(range(len(ids)), key=lambda j: ids[j])
    fc = state["fc.weight"]
    state["fc.weight"] = torch.cat([fc[:, j * H : (j + 1) * H] for j in order], dim=1)
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
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": min(decode.gamma, drafter.drafts_per_block),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": base_model,
                "architectures": list(target.config.architectures or [type(target.model).__name__]),
            },
        },
    }
    return config, state


def layer_config_dict(target: Target, num_layers: int) -> dict:
    """The layers' Qwen3Config as speculators writes it (a diff dict, model_type qwen3)."""
    config = layer_config(target.config, num_layers).to_diff_dict()
    for key in GENERIC_KEYS:
        config.pop(key, None)
    config["model_type"] = "qwen3"
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:  # also where older readers of the layer config look for it
        config["rope_theta"] = rope["rope_theta"]
    return config


# --- the layout's rules --------------------------------------------------------------------------


def expected_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The exact weight names and shapes of a DFlash folder with this config.json."""
    layer = config["transformer_layer_config"]
    H, inter = layer["hidden_size"], layer["intermediate_size"]
    heads = layer["num_attention_heads"]
    kv = layer.get("num_key_value_heads") or heads
    D = layer.get("head_dim") or H // heads
    per_layer = {
        "self_attn.q_proj.weight": (heads * D, H),
        "self_attn.k_proj.weight": (kv * D, H),
        "self_attn.v_proj.weight": (kv * D, H),
        "self_attn.o_proj.weight": (H, heads * D),
        "self_attn.q_norm.weight": (D,),
        "self_attn.k_norm.weight": (D,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "input_layernorm.weight": (H,),
        "post_attention_layernorm.weight": (H,),
    }
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

    def integer(value, low: int = 1) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= low

    need("model_type" not in config, "a top-level model_type hides it from vLLM's detection")
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
    spec = config.get("speculators_config") or {}
    methods = spec.get("proposal_methods") or [{}]
    tokens = methods[0].get("speculative_tokens")
    need(
        integer(tokens) and tokens <= drafts,
        f"speculators_config.proposal_methods[0].speculative_tokens must be in 1..{drafts} "
        "(the tokens a block drafts)",
    )
    verifier = spec.get("verifier") or {}
    need(
        isinstance(verifier.get("name_or_path"), str) and verifier["name_or_path"] != "",
        "speculators_config.verifier.name_or_path must name the target",
    )
    if names is not None:
        need(
            not any(n.startswith("model.") for n in names),
            "weight names must not start with model. (vLLM adds it)",
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
    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    problems = problems_of(config)
    if problems:
        return problems
    state = load_file(folder / WEIGHTS)
    expected = shapes_of(config)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        problems.append(f"weights missing {few(missing)}, unexpected {few(extra)}")
    problems += [
        f"{name} has shape {tuple(state[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    if config["draft_vocab_size"] != vocab_size:
        problems.append(f"draft_vocab_size {config['draft_vocab_size']} is not the target's {vocab_size}")  # fmt: skip
    return problems + problems_of(config, set(state))


# --- reading -------------------------------------------------------------------------------------


def read_drafter(
    folder: Path, config: dict, target: Target, *, strict: bool = True
) -> DFlashDrafter:
    """A DFlash folder in speculators' layout, checked against `target` (layer shape, sizes,
    verifier, exact names and shapes) before a module is built."""
    state = checked_weights(folder, config, target, strict, layout_problems, expected_shapes)
    layer = config["transformer_layer_config"]
    try:
        drafter_config = DFlashConfig(
            num_layers=layer["num_hidden_layers"],
            block_size=config["block_size"],
            aux_layers=list(config["aux_hidden_state_layer_ids"]),
            mask_token_id=config["mask_token_id"],
        )
        drafter = DFlashDrafter(drafter_config, target, init=False)
    except ValueError as e:
        raise CheckpointError(f"{folder / CONFIG_NAME}: {e}") from e
    drafter.load_state_dict(state, strict=True)
    return drafter


def checked_weights(
    folder: Path, config: dict, target: Target, strict: bool, problems_of, shapes_of
) -> dict[str, torch.Tensor]:
    """The weights of a DFlash-backbone folder (a kind's own `problems_of`, `shapes_of`), once
    its config and weights are checked against `target`: a CheckpointError naming the first
    problem."""
    where = folder / CONFIG_NAME
    problems = problems_of(config)
    if problems:
        kind = {"dspark": "DSpark"}.get(config.get("speculators_model_type"), "DFlash")
        raise CheckpointError(f"{where} is not a loadable {kind} drafter: {'; '.join(problems)}")
    layer = config["transformer_layer_config"]
    ours = layer_config(target.config, layer["num_hidden_layers"]).to_dict()
    theirs = dict(layer)
    theirs.setdefault("num_key_value_heads", layer["num_attention_heads"])
    theirs["head_dim"] = theirs.get("head_dim") or layer["hidden_size"] // layer["num_attention_heads"]  # fmt: skip
    differ = [
        f"{key} {theirs.get(key)!r} (the target's {ours.get(key)!r})"
        for key in LAYER_FIELDS
        if theirs.get(key) is not None and theirs.get(key) != ours.get(key)
    ]
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
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder} has a DFlash config.json but no .safetensors weights")
    state = {k.removeprefix("model."): v for k, v in read_weights(files).items()}
    # what speculators also accepts in the folder: the verifier's own embedding and LM head
    for shared in ("embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight"):
        state.pop(shared, None)
    where_w = folder / ", ".join(f.name for f in files)
    check_names_and_shapes(state, shapes_of(config), where_w, target, config)
    return state


def speculators_format(inner: Format) -> Format:
    """speculators' FORMATS entry `inner`, holding DFlash drafters too."""
    return also_holding(
        inner,
        DFlashDrafter.kind,
        "dflash",
        ARCHITECTURE,
        write_speculators,
        read_drafter,
        validate_folder,
    )
