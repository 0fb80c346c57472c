"""What every drafter format (formats/export_registry.py's FORMATS) shares: the Format record, the error
for a drafter a format cannot hold, and the strict checks every reader runs before it builds a
module (sizes, exact weight names and shapes, damaged or pickled files)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from specdraft.core import DecodeConfig
from specdraft.drafters.base import Drafter
from specdraft.formats.checkpoint import CONFIG_NAME, CheckpointError
from specdraft.targets.target import Target


class ExportError(ValueError):
    """A drafter that cannot be written in the asked format, or a destination not to overwrite."""


@dataclass(frozen=True)
class Format:
    """One layout another tool reads: its writer, its reader, and how its folders are known."""

    help: str
    kinds: tuple[str, ...]  # the drafter kinds it holds
    weights_file: str  # the one weights file the writer writes
    # (drafter, base_model_name_or_path, the decoding settings it is served with) ->
    # (config.json, the weights file's tensors)
    write: Callable[[Drafter, str, DecodeConfig], tuple[dict, dict[str, torch.Tensor]]]
    # (folder, its config.json, target, strict=) -> the drafter, all checked before it is built;
    # strict=False accepts a verifier named otherwise than the target
    read: Callable[..., Drafter]
    detect: Callable[[dict], bool]  # a config.json of this format (without a specdraft block)
    # The same tensors also written with torch.save under this name, for readers that only
    # unpickle (the reference repository's own MedusaModel.from_pretrained reads
    # medusa_lm_head.pt); we write it, and never read it.
    pickle_copy: str | None = None
    # (the written folder, the target's vocabulary size) -> what the engine's loader would refuse
    # there, each a sentence; run before the folder is renamed into place
    validate: Callable[[Path, int], list[str]] | None = None
    # (config.json, the settings our export recorded there or DecodeConfig()) -> the decoding
    # settings the folder is served with, where the format's own fields say some (speculators'
    # speculative_tokens); None: the format's fields say none
    decoding: Callable[[dict, DecodeConfig], DecodeConfig] | None = None


def also_holding(
    inner: Format,
    kind: str,
    model_type: str,
    architecture: str,
    write: Callable[[Drafter, str, DecodeConfig], tuple[dict, dict[str, torch.Tensor]]],
    read: Callable[..., Drafter],
    validate: Callable[[Path, int], list[str]],
) -> Format:
    """speculators' entry `inner` holding drafters of `kind` too: a folder whose config.json says
    speculators_model_type `model_type` is read and checked by `read` and `validate`, a drafter of
    `kind` is written by `write`, and everything else goes to `inner`, as before. One speculators
    layout holds every kind it serves, each kind's code in its own module."""

    def ours(config: dict) -> bool:
        return config.get("speculators_model_type") == model_type

    def write_any(drafter: Drafter, base_model: str, decode: DecodeConfig):
        return (write if drafter.kind == kind else inner.write)(drafter, base_model, decode)

    def read_any(folder, config: dict, target: Target, *, strict: bool = True) -> Drafter:
        return (read if ours(config) else inner.read)(folder, config, target, strict=strict)

    def validate_any(folder: Path, vocab_size: int) -> list[str]:
        config = json.loads((Path(folder) / CONFIG_NAME).read_text())
        return (validate if ours(config) else inner.validate)(folder, vocab_size)

    return dataclasses.replace(
        inner,
        help=inner.help.replace("Eagle3Speculator", f"Eagle3Speculator or {architecture}", 1),
        kinds=(*inner.kinds, kind),
        write=write_any,
        read=read_any,
        validate=validate_any,
    )


def count(config: dict, key: str, folder: Path, also: str | None = None) -> int:
    value = config.get(key, config.get(also)) if also else config.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: {key} must be an integer >= 1; got {value!r}"
        )
    return value


def check_sizes(config: dict, target: Target, folder: Path) -> None:
    """The config's hidden and vocabulary sizes, where it gives them, against the target's."""
    for key, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size)):
        if key in config and config[key] != ours:
            raise CheckpointError(
                f"{folder} holds heads for a target with {key}={config[key]}, but the target "
                f"{target.name!r} has {key}={ours}: load the target they were trained for "
                f"(base_model_name_or_path: {config.get('base_model_name_or_path', 'not given')})"
            )


def read_weights(files: list[Path]) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            part = load_file(file)
        except Exception as e:  # safetensors raises several types for a damaged file
            raise CheckpointError(f"{file} cannot be read ({e}): the file is damaged") from e
        repeated = sorted(set(state) & set(part))
        if repeated:
            raise CheckpointError(f"{file} repeats weights of another file there: {repeated[:5]}")
        state.update(part)
    return state


def check_names_and_shapes(
    state: dict[str, torch.Tensor],
    expected: dict[str, tuple[int, ...]],
    file: Path,
    target: Target,
    config: dict,
) -> None:
    """Exactly the expected names, each with its shape; else an error naming what differs."""
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    if missing or extra:
        raise CheckpointError(
            f"{file} does not fit the heads its config.json describes: missing {few(missing)}, "
            f"unexpected {few(extra)}; the folder is incomplete, or its config.json (head and "
            "layer counts) belongs to other weights"
        )
    for name, shape in expected.items():
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"{file}: {name} has shape {tuple(state[name].shape)}, expected {shape} for the "
                f"target {target.name!r} (hidden size {target.hidden_size}, vocabulary "
                f"{target.vocab_size}): the heads belong to another target (base_model_name_or_"
                f"path: {config.get('base_model_name_or_path', 'not given')}); load that one"
            )


def few(names: list[str]) -> str:
    return f"{names[:5]}{f' and {len(names) - 5} more' if len(names) > 5 else ''}"


def pickle_message(file: Path, safetensors_name: str) -> str:
    return (
        f"{file} is a pickle, which specdraft never loads (unpickling runs code). Convert it "
        'once, where you trust the file: python -c "import torch; from safetensors.torch import '
        f"save_file; sd = torch.load('{file}', weights_only=True); "
        f"save_file({{k: v.contiguous() for k, v in sd.items()}}, "
        f"'{file.with_name(safetensors_name)}')\""
    )
