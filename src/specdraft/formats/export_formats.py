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


@dataclass(frozen=True)
class Held:
    """A kind speculators' layout holds beside EAGLE-3 heads (`also_holding`): its folders say
    speculators_model_type `kind`, architectures [`architecture`]."""

    kind: str
    architecture: str
    write: Callable[[Drafter, str, DecodeConfig], tuple[dict, dict[str, torch.Tensor]]]
    read: Callable[..., Drafter]
    validate: Callable[[Path, int], list[str]]


def also_holding(inner: Format, *held: Held) -> Format:
    """speculators' entry `inner` holding the kinds `held` too: a drafter of one is written by its
    `write`, a folder whose speculators_model_type names one is read and checked by its `read` and
    `validate`, and everything else goes to `inner`, as before. One speculators layout holds every
    kind it serves, each kind's code in its own module."""
    by_kind = {h.kind: h for h in held}

    def of(config: dict) -> Held | Format:
        return by_kind.get(config.get("speculators_model_type"), inner)

    def write(drafter: Drafter, base_model: str, decode: DecodeConfig):
        return by_kind.get(drafter.kind, inner).write(drafter, base_model, decode)

    def read(folder, config: dict, target: Target, *, strict: bool = True) -> Drafter:
        return of(config).read(folder, config, target, strict=strict)

    def validate(folder: Path, vocab_size: int) -> list[str]:
        config = json.loads((Path(folder) / CONFIG_NAME).read_text())
        return of(config).validate(folder, vocab_size)

    names = " or ".join(["Eagle3Speculator", *(h.architecture for h in held)])
    return dataclasses.replace(
        inner,
        help=inner.help.replace("Eagle3Speculator", names, 1),
        kinds=(*inner.kinds, *by_kind),
        write=write,
        read=read,
        validate=validate,
    )


def integer(value, low: int = 1) -> bool:
    """An integer (not a bool) >= `low`, as a config.json field must be to count something."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def count(config: dict, key: str, folder: Path, also: str | None = None) -> int:
    value = config.get(key, config.get(also)) if also else config.get(key)
    if not integer(value):
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


def folder_weights(
    folder: Path, what: str, weights_file: str
) -> tuple[dict[str, torch.Tensor], Path]:
    """Every .safetensors file in `folder` as one state, as the engines read them, and where, for
    messages. A folder with a pickle instead (converted to `weights_file`, says the error) or no
    weights at all (`what`: whose config.json it holds) is a CheckpointError."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickles = sorted(folder.glob("*.bin")) + sorted(folder.glob("*.pt"))
        if pickles:
            raise CheckpointError(pickle_message(pickles[0], weights_file))
        raise CheckpointError(f"{folder} has a {what} config.json but no .safetensors weights")
    return read_weights(files), folder / ", ".join(f.name for f in files)


def folder_problems(
    folder: str | Path,
    weights_file: str,
    problems_of: Callable[..., list[str]],
    shapes_of: Callable[[dict], dict[str, tuple[int, ...]]],
    more: Callable[[dict, dict[str, torch.Tensor]], list[str]] | None = None,
) -> list[str]:
    """What an engine would refuse in a written folder, each a sentence; [] when it loads: its
    config.json's `problems_of(config)`, then, where there are none, the weights' names and
    shapes against `shapes_of(config)` and `problems_of(config, names)`, then, where there are
    still none, `more(config, weights)`. Reads only the files, never a target."""
    folder = Path(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    problems = problems_of(config)
    if problems:
        return problems
    state = load_file(folder / weights_file)
    expected = shapes_of(config)
    missing, extra = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or extra:
        problems.append(f"weights missing {few(missing)}, unexpected {few(extra)}")
    problems += [
        f"{name} has shape {tuple(state[name].shape)}, expected {shape}"
        for name, shape in expected.items()
        if name in state and tuple(state[name].shape) != shape
    ]
    problems += problems_of(config, set(state))
    return problems or (more(config, state) if more is not None else [])


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
