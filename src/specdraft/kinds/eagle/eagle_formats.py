"""EAGLE's three layouts as export formats (`EAGLE_FORMATS`): each one's writer (eagle_export.py),
its reader of a published head back into our loop (`read_head`), and the check of a folder
against the engine's own loader (`validate_folder`). The layouts are described in eagle_export.py.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import torch

from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.formats.export_formats import (
    Format,
    check_names_and_shapes,
    check_sizes,
    few,
    folder_problems,
    folder_weights,
)
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_export import (
    EAGLE1_ARCHITECTURES,
    LAYER_FIELDS,
    SGLANG_ARCHITECTURE,
    WEIGHTS,
    expected_shapes,
    layer_config_dict,
    layout_problems,
    our_d2t,
    target_architectures,
    write_eagle,
    write_sglang,
    write_speculators,
)
from specdraft.targets.target import Target


def read_head(
    folder: Path, config: dict, target: Target, *, fmt: str, strict: bool = True, build=EagleDrafter
) -> EagleDrafter:
    """A published or exported head in layout `fmt`, checked against `target` (sizes, layer shape,
    verifier, exact names and shapes, maps) before a module is built, by `build(EagleConfig,
    target, d2t)` (a kind built on the head gives its own: kinds/peagle/peagle_export.py)."""
    where = folder / CONFIG_NAME
    problems = layout_problems(fmt, config)
    if problems:
        raise CheckpointError(f"{where} is not a loadable {fmt} EAGLE head: {'; '.join(problems)}")
    layer = config["transformer_layer_config"] if fmt == "speculators" else config
    _check_layer(layer, target, where)
    if fmt != "eagle":
        # speculators writes null for "the layer's"; SGLang's key, where present, is checked
        hidden = config.get("target_hidden_size", layer["hidden_size"])
        if fmt == "speculators":
            hidden = hidden or layer["hidden_size"]
        check_sizes({"hidden_size": hidden}, target, folder)
    if fmt == "speculators" and strict:
        check_verifier(config["speculators_config"]["verifier"], target, where)
    state, where_w = folder_weights(folder, f"{fmt} EAGLE", WEIGHTS)
    # what the engines accept beside the names we write: SGLang and vLLM strip a model. prefix
    # and take midlayer. and layers.0. alike; an embedding equal to the target's is shared
    state = {_our_name(k.removeprefix("model.")): v for k, v in state.items()}
    embed = state.pop("embed_tokens.weight", None)
    mine = target.model.get_input_embeddings().weight.detach().cpu().float()
    # equal up to the rounding of another 16-bit dtype (a copy saved in fp16 of a bf16 target)
    if embed is not None and not torch.allclose(embed.float(), mine, rtol=1e-2, atol=1e-4):
        raise CheckpointError(
            f"{folder} holds its own embed_tokens.weight, which differs from the target "
            f"{target.name!r}'s: specdraft's heads read the target's embedding; load the target "
            "the head was trained for"
        )
    shapes = expected_shapes(fmt, config, target.vocab_size, embedding=False)  # popped above
    expected = {_our_name(k): v for k, v in shapes.items()}
    if fmt == "sglang" and "d2t" not in state and config["draft_vocab_size"] == target.vocab_size:
        del expected["d2t"], expected["t2d"]  # SGLang itself takes a full vocabulary without maps
    check_names_and_shapes(state, expected, where_w, target, config)
    V = target.vocab_size
    d2t = None
    if fmt != "eagle":
        if "d2t" in state:
            d2t = our_d2t(state.pop("d2t"), state.pop("t2d", None), V, where_w)
        elif config["draft_vocab_size"] < V:
            raise CheckpointError(f"{where_w}: a reduced draft vocabulary needs d2t and t2d")
    head_config = _head_config(fmt, config, target, where)
    drafter = build(head_config, target, d2t)
    ours = {_module_name(k, head_config.version): v for k, v in state.items()}
    missing, unexpected = drafter.load_state_dict(ours, strict=False)
    missing = [k for k in missing if k not in ("d2t", "t2d")]
    if missing or unexpected:  # the checks above make this an internal error
        raise CheckpointError(f"{where_w}: missing {few(missing)}, unexpected {few(unexpected)}")
    return drafter


def speculators_decoding(config: dict, recorded: DecodeConfig) -> DecodeConfig:
    """The decoding settings of a speculators folder: what our export recorded, with the chain
    length the engine serves, its default proposal's speculative_tokens (edited or not)."""
    methods = config["speculators_config"]["proposal_methods"]
    return dataclasses.replace(recorded, gamma=int(methods[0]["speculative_tokens"]))


def _head_config(fmt: str, config: dict, target: Target, where: Path) -> EagleConfig:
    if fmt == "eagle":
        return EagleConfig(version="eagle1", fc_bias=bool(config.get("bias", True)))
    L = target.num_layers
    variant = {}
    if fmt == "speculators":
        ids = config.get("eagle_aux_hidden_state_layer_ids")
        before = config["norm_before_residual"]
        if config.get("speculators_model_type") == "eagle3":  # EAGLE-3.1's settings
            variant = {k: bool(config.get(k, False)) for k in ("norm_before_fc", "norm_output")}
    else:
        ids = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        ids = None if ids is None else [i + 1 for i in ids]  # SGLang's k: output of layer k
        before = False
    # the engines' default without ids (vLLM interfaces.py, SGLang llama.py): HF ids
    ids = sorted(set([2, L // 2, L - 3] if ids is None else ids))
    if len(ids) != 3 or ids[0] < 0 or ids[-1] >= L:
        raise CheckpointError(
            f"{where}: the head fuses target layers {ids} (as the engine numbers them: the output "
            f"of decoder layer i as i, the embeddings as 0); an engine captures three distinct "
            f"layers below the target {target.name!r}'s {L}: the head belongs to another target"
        )
    draft_vocab = config["draft_vocab_size"]
    try:
        return EagleConfig(
            version="eagle3",
            feature_layers=ids,
            draft_vocab_size=0 if draft_vocab == target.vocab_size else draft_vocab,
            norm_before_residual=before,
            **variant,
        )
    except ValueError as e:
        raise CheckpointError(f"{fmt} EAGLE config: {e}") from e


def layer_differences(layer: dict, ours: dict) -> list[str]:
    """Where a folder's layer config differs from `ours` (the target's shape) in LAYER_FIELDS,
    each said with both values, taking what a Llama config takes where a key is missing (kv
    heads = heads, head_dim = hidden / heads)."""
    theirs = dict(layer)
    heads = theirs["num_attention_heads"]
    theirs["num_key_value_heads"] = theirs.get("num_key_value_heads") or heads
    theirs["head_dim"] = theirs.get("head_dim") or theirs["hidden_size"] // heads
    return [
        f"{key} {theirs.get(key)!r} (the target's {ours.get(key)!r})"
        for key in LAYER_FIELDS
        if theirs.get(key) is not None and theirs.get(key) != ours.get(key)
    ]


def _check_layer(layer: dict, target: Target, where: Path) -> None:
    """The head's layer config against the target's shape (layer_differences, and the rotary)."""
    ours = layer_config_dict(target)
    differ = layer_differences(layer, ours)
    rope = layer.get("rope_parameters") or layer.get("rope_scaling") or {}
    theta = rope.get("rope_theta", layer.get("rope_theta"))
    if theta is not None and theta != ours.get("rope_theta"):
        differ.append(f"rope_theta {theta!r} (the target's {ours.get('rope_theta')!r})")
    kind = rope.get("rope_type", rope.get("type", "default"))
    mine = (ours.get("rope_parameters") or {}).get("rope_type", "default")
    if kind != mine:
        differ.append(f"rope_type {kind!r} (the target's {mine!r})")
    if differ:
        raise CheckpointError(
            f"{where}: the head's layer differs from the target {target.name!r}'s shape in "
            f"{'; '.join(differ)}: specdraft builds the head's layer in the target's shape; load "
            "the target the head was trained for"
        )


def check_verifier(verifier: dict, target: Target, where: Path) -> None:
    """The verifier a speculators config names against the target given: its architectures
    must agree, and its name's last part (a hub id or a folder) must be the target's."""
    archs = verifier.get("architectures") or []
    ours = target_architectures(target)
    if archs and ours and archs != ours:
        raise CheckpointError(
            f"{where} names the verifier {verifier.get('name_or_path')!r} ({archs}), but the "
            f"target {target.name!r} is {ours}: load the verifier it was trained for"
        )
    name = str(verifier.get("name_or_path", "")).rstrip("/").rsplit("/", 1)[-1].lower()
    mine = {
        str(n).rstrip("/").rsplit("/", 1)[-1].lower()
        for n in (target.name, getattr(target.config, "_name_or_path", ""))
        if n
    }
    if name and name not in mine:
        raise CheckpointError(
            f"{where} names the verifier {verifier['name_or_path']!r}, but the target is "
            f"{target.name!r}: load that verifier, or, if the target is the same model under "
            "another name, load the head with load_drafter(..., strict=False)"
        )


def _our_name(name: str) -> str:
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def _module_name(name: str, version: str) -> str:
    """A reference name as our module's state dict names it."""
    if name.startswith("layers.0."):
        return "layer." + name.removeprefix("layers.0.")
    if version == "eagle3":
        return {"fc.weight": "fc_fuse.weight", "norm.weight": "final_norm.weight"}.get(name, name)
    return name


def _detect_eagle1(config: dict) -> bool:
    archs = config.get("architectures") or []
    if any(a in EAGLE1_ARCHITECTURES for a in archs):
        return True
    # SafeAILab/EAGLE's own configs: a one-layer Llama config with the `bias` key of its fc
    return (
        config.get("model_type") == "llama"
        and config.get("num_hidden_layers") == 1
        and ("bias" in config)
    )


def _format(fmt: str, help: str, write, detect, decoding=None, pickle_copy=None) -> Format:
    """An EAGLE layout's FORMATS entry: its writer, and the shared reader and engine-rule check
    run with its name."""
    return Format(
        help=help,
        kinds=("eagle",),
        weights_file=WEIGHTS,
        write=write,
        read=partial(read_head, fmt=fmt),
        validate=lambda folder, vocab: validate_folder(folder, fmt, vocab),
        detect=detect,
        decoding=decoding,
        pickle_copy=pickle_copy,
    )


EAGLE_FORMATS: dict[str, Format] = {
    "speculators": _format(
        "speculators",
        "vllm-project/speculators' Eagle3Speculator config.json + model.safetensors (vLLM)",
        write_speculators,
        lambda c: "speculators_model_type" in c,
        speculators_decoding,
    ),
    "sglang": _format(
        "sglang",
        "SGLang's / SpecForge's LlamaForCausalLMEagle3 config.json + model.safetensors",
        write_sglang,
        lambda c: SGLANG_ARCHITECTURE in (c.get("architectures") or []),
    ),
    "eagle": _format(
        "eagle",
        "SafeAILab/EAGLE's EAGLE-1/2 layout (SGLang's LlamaForCausalLMEagle, vLLM's EAGLE)",
        write_eagle,
        _detect_eagle1,
        pickle_copy="pytorch_model.bin",  # SafeAILab/EAGLE's loader reads only this file
    ),
}


def validate_folder(folder: str | Path, fmt: str, vocab_size: int) -> list[str]:
    """Every problem the engine of `fmt` would find in `folder` (config fields, exact weight names
    and shapes, the maps' invariant), each a sentence; [] when it would load. Reads only the
    files, never a target: what an engine sees."""

    def maps(config: dict, state: dict[str, torch.Tensor]) -> list[str]:
        if "d2t" not in state:
            return []
        problems = []
        if state["d2t"].dtype != torch.int64:
            problems.append(f"d2t is {state['d2t'].dtype}; the engines read int64 offsets")
        try:
            our_d2t(state["d2t"], state.get("t2d"), vocab_size, Path(folder))
        except CheckpointError as e:
            problems.append(str(e))
        return problems

    shapes = partial(expected_shapes, fmt, vocab_size=vocab_size)
    return folder_problems(folder, WEIGHTS, partial(layout_problems, fmt), shapes, maps)
