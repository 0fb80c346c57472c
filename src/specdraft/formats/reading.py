"""Reading a drafter folder in any layout specdraft reads: its drafter (`load_drafter`), the
decoding settings it is served with (`load_decoding`) and the target it decodes with
(`folder_target`, `fine_tuned_target`).

A folder is one of: a specdraft checkpoint or a plain Hugging Face causal-LM folder
(formats/checkpoint.py), or a folder another tool's layout describes, recognised by its
config.json (formats/export_registry.py `FORMATS`: published Medusa heads, EAGLE exports). This module
tells them apart and hands each to its reader, so the checkpoint reader and the export layouts
do not import each other.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from specdraft.core import DecodeConfig
from specdraft.drafters.base import Drafter
from specdraft.formats.checkpoint import (
    CONFIG_NAME,
    CheckpointError,
    checkpoint_decoding,
    decode_from_dict,
    drafter_class,
    load_checkpoint,
    read_metadata,
)
from specdraft.formats.export_registry import (
    EXPORTED_DECODING,
    FORMATS,
    imported_format,
    load_imported,
)
from specdraft.targets.target import Target, load_target


def load_drafter(
    path: str | Path,
    target: Target,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Drafter:
    """Load the drafter in `path` for `target`, on the target's device and dtype unless given.

    A specdraft checkpoint must have been trained against this target: strict (the default)
    compares the whole fingerprint, strict=False only the vocabulary size. A plain HF causal-LM
    folder (no `specdraft` block) loads as a two-model drafter (the kind that
    `wraps_hf_models`); its vocabulary must be the target's. A folder in another tool's layout
    (published Medusa heads, our exports) loads through its format's reader, its sizes checked
    against the target's.
    """
    folder = Path(path).expanduser()
    fmt = imported_format(folder)
    if fmt is not None:
        return load_imported(folder, fmt, target, device=device, dtype=dtype, strict=strict)
    meta, hf_config = read_metadata(folder)
    if meta is None and hf_config is None:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} is in none of the layouts specdraft reads: a specdraft "
            "checkpoint (a `specdraft` block), a Hugging Face causal-LM folder (`model_type`), "
            f"or a published drafter in one of the formats {', '.join(FORMATS)} "
            "(formats/export_registry.py says how each is recognised)"
        )
    return load_checkpoint(folder, target, strict=strict, device=device, dtype=dtype)


def load_decoding(path: str | Path) -> DecodeConfig:
    """The decoding settings the drafter in `path` is served with: the `decode` block its
    checkpoint saved (set_decode rewrites it after tuning), what an imported format records
    (our exports' `specdraft_decoding` block, and speculators' proposal length, which the
    engine serves), else the kind's defaults (`Drafter.decode_class`). Handed to generate,
    evaluation and tuning as an argument; nothing keeps it on the drafter."""
    folder = Path(path).expanduser()
    fmt = imported_format(folder)
    if fmt is None:
        return checkpoint_decoding(folder)
    config = json.loads((folder / CONFIG_NAME).read_text())
    # what our exports record beside the format's own fields (scripts/export.py)
    kind = drafter_class(FORMATS[fmt].kinds[0])
    decode = decode_from_dict(kind, config.get(EXPORTED_DECODING) or {}, folder)
    reader = FORMATS[fmt].decoding
    return reader(config, decode) if reader is not None else decode


def fine_tuned_target(path: str, base, loaded: dict | None = None):
    """The fine-tuned target a drafter folder decodes with, when its heads were trained with the
    target fine-tuned (its fingerprint names an adapter, saved in FOLDER/adapter): the base
    with that adapter merged; for a LayerSkip folder, the folder itself. None for every other
    drafter, and where `base` already is that target. `loaded`: the fine-tuned targets a caller's
    run has loaded so far, by (folder or base, adapter hash, dtype, device), filled in here: the
    settings of one LayerSkip or Medusa-2 folder, and compare's passes over them, share one copy
    instead of loading the model per spec (None: load it)."""
    meta, _ = read_metadata(path)
    if meta is not None and drafter_class(meta["kind"]).uses_target_weights:
        # its own target: with --target FOLDER nothing to load; beside another target (the base
        # it was fine-tuned from, say) it decodes with its own model, measured against that
        # model's plain decoding, so every kind runs in one evaluation
        own = meta.get("target_fingerprint", {}).get("adapter")
        if base.fingerprint.get("adapter") == own:
            return None
        key = (str(Path(path).resolve()), own, str(base.dtype), str(base.device))
        return _load_once(
            loaded, key, lambda: load_target(path, dtype=base.dtype, device=base.device)
        )
    if not (meta or {}).get("target_fingerprint", {}).get("adapter"):
        return None
    adapter = Path(path) / "adapter"
    if not adapter.is_dir():
        raise ValueError(
            f"--drafter {path}: its heads decode with a fine-tuned target, and the folder has no "
            "adapter/ to build it from; pass --target the run's merged target instead"
        )
    if base.fingerprint.get("adapter"):  # --target is already a fine-tuned target
        return None
    own = meta["target_fingerprint"]["adapter"]
    key = (base.name, own, str(base.dtype), str(base.device))
    return _load_once(
        loaded,
        key,
        lambda: load_target(base.name, dtype=base.dtype, device=base.device, adapter=adapter),
    )


def folder_target(
    folder: str | Path, name: str | None = None, *, dtype=None, device=None
) -> Target:
    """The target a drafter folder decodes with: `name`; else the folder itself for a kind that
    is its own target (LayerSkip); else the target its run trained against (its
    train_config.yaml). A Medusa-2 folder gets that target with its adapter merged. Raises
    ValueError where the folder does not say."""
    target = load_target(name or folder_target_name(folder), dtype=dtype, device=device)
    return fine_tuned_target(str(folder), target) or target


def folder_target_name(folder: str | Path) -> str:
    """The name of the target a drafter folder decodes with: the folder itself for a kind that
    is its own target (LayerSkip), else the target its run trained against (its
    train_config.yaml). Raises ValueError where the folder does not say."""
    meta, _ = read_metadata(folder)
    if meta is not None and drafter_class(meta["kind"]).uses_target_weights:
        return str(folder)
    config = Path(folder) / "train_config.yaml"
    if not config.is_file():
        raise ValueError(
            f"{folder} does not say which target it drafts for (no train_config.yaml): "
            "pass --target"
        )
    return str(yaml.safe_load(config.read_text())["target"])


def _load_once(loaded: dict | None, key: tuple, load):
    if loaded is None:
        return load()
    if key not in loaded:
        loaded[key] = load()
    return loaded[key]
