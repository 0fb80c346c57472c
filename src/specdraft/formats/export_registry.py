"""Every export format, and writing and reading them: the table (`FORMATS`: each kind's export
module contributes its own), `export_drafter`, `check_destination`, and reading a folder another
tool wrote (`imported_format`, `load_imported`; formats/reading.py's load_drafter goes through
them).

Writing is atomic (a temporary sibling renamed into place, as checkpoint.save_drafter does) and
refuses a non-empty folder that is not a previous export unless `overwrite`. Every folder is
checked by the engine's own rules (`Format.validate`) before it is renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

from specdraft.core import DecodeConfig
from specdraft.drafters.base import Drafter
from specdraft.formats.checkpoint import CONFIG_NAME, clear_leftovers, replace_dir
from specdraft.formats.export_formats import ExportError, Format, also_holding
from specdraft.kinds.dflash import dflash_export
from specdraft.kinds.dspark import dspark_export
from specdraft.kinds.eagle.eagle_formats import EAGLE_FORMATS
from specdraft.kinds.medusa.medusa_export import MEDUSA_FORMATS
from specdraft.kinds.peagle import peagle_export
from specdraft.targets.target import Target

# The config.json key under which an export records the decoding settings its drafter was saved
# or tuned with, in formats whose loaders keep unknown top-level keys (every one we write);
# formats/reading.py `load_decoding` reads it back.
EXPORTED_DECODING = "specdraft_decoding"

# speculators' layout holds DFlash drafters, P-EAGLE heads and DSpark drafters too: one entry,
# each kind written, read and checked by its own module
FORMATS: dict[str, Format] = {
    **MEDUSA_FORMATS,
    **EAGLE_FORMATS,
    "speculators": also_holding(
        EAGLE_FORMATS["speculators"],
        dflash_export.SPECULATORS,
        peagle_export.SPECULATORS,
        dspark_export.SPECULATORS,
    ),
}


# --- writing -----------------------------------------------------------------------------------


def export_drafter(
    drafter: Drafter,
    out_dir: str | Path,
    fmt: str,
    *,
    base_model_name_or_path: str,
    decode: DecodeConfig | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `drafter` as a folder in format `fmt` (a FORMATS key) at `out_dir`, atomically, and
    return it. `base_model_name_or_path` names the target the heads run with, recorded for the
    engine (for Medusa-2 heads: the fine-tuned target, adapter merged); `decode` the settings it
    is served with, where the format records them (reading.load_decoding reads a folder's;
    None: the kind's defaults). An existing `out_dir` is
    replaced only if it is empty or a previous export, or with `overwrite`."""
    if fmt not in FORMATS:
        raise ExportError(f"unknown export format {fmt!r}; formats: {', '.join(FORMATS)}")
    spec = FORMATS[fmt]
    if drafter.kind not in spec.kinds:
        able = [name for name, f in FORMATS.items() if drafter.kind in f.kinds]
        raise ExportError(
            f"format {fmt!r} holds {'/'.join(spec.kinds)} drafters, not a {drafter.kind} one; "
            f"formats for {drafter.kind}: {', '.join(able) or 'none yet'}"
        )
    out = Path(out_dir).expanduser()
    check_destination(out, overwrite)
    try:
        decode = drafter.decode_settings(decode)
    except ValueError as e:
        raise ExportError(str(e)) from e
    config, tensors = spec.write(drafter, base_model_name_or_path, decode)
    # every engine we write for keeps an unknown top-level key; load_decoding reads it back
    config[EXPORTED_DECODING] = dataclasses.asdict(decode)
    out.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(out)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(tensors, str(tmp / spec.weights_file), metadata={"format": "pt"})
        if spec.pickle_copy is not None:
            torch.save(tensors, tmp / spec.pickle_copy)
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        problems = [] if spec.validate is None else spec.validate(tmp, drafter.target.vocab_size)
        if problems:  # a bug of ours: the engine would refuse or misread the folder
            raise ExportError(f"the {fmt} folder written would not load: {'; '.join(problems)}")
        replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def check_destination(out: Path, overwrite: bool) -> None:
    """Raise ExportError unless `out` may be written: absent, empty, a previous export, or any
    folder with `overwrite`."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"{out} is a file; pass a folder to export into")
    if overwrite or not out.exists() or not any(out.iterdir()):
        return
    # a previous export: config.json of a known format and nothing but its files
    known = {CONFIG_NAME} | {f.weights_file for f in FORMATS.values()}
    known |= {f.pickle_copy for f in FORMATS.values() if f.pickle_copy}
    names = {p.name for p in out.iterdir()}
    if names <= known and imported_format(out) is not None:
        return
    if (
        names <= {"draft.gguf", "target.gguf", "specdraft_gguf.json"}
        and "specdraft_gguf.json" in names
    ):
        return  # a previous --format gguf export (formats/gguf_export.py)
    raise ExportError(
        f"{out} is not empty and holds no previous export ({', '.join(sorted(names)[:5])}"
        f"{', ...' if len(names) > 5 else ''}): export to a new or empty folder, or replace the "
        "whole folder with --force (overwrite=True)"
    )


# --- reading ----------------------------------------------------------------------------------


def imported_format(folder: str | Path) -> str | None:
    """The FORMATS name of a folder another tool wrote (published Medusa heads); None for a
    specdraft checkpoint, a plain HF folder, or a folder with no readable config.json."""
    file = Path(folder) / CONFIG_NAME
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError):
        return None  # checkpoint.read_metadata reports a missing or broken config.json
    if not isinstance(config, dict) or "specdraft" in config:
        return None
    return next((name for name, f in FORMATS.items() if f.detect(config)), None)


def load_imported(
    folder: str | Path,
    fmt: str,
    target: Target,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    strict: bool = True,
) -> Drafter:
    """The drafter in `folder`, written in format `fmt`, for `target`, on the target's device
    and dtype unless given. Everything is checked before a module is built: an error leaves
    nothing half-loaded. strict=False accepts a verifier named otherwise than the target (the
    same model under another name); sizes and shapes are always checked."""
    folder = Path(folder).expanduser()
    spec = FORMATS[fmt]
    config = json.loads((folder / CONFIG_NAME).read_text())
    drafter = spec.read(folder, config, target, strict=strict)
    device = device if device is not None else target.device
    dtype = dtype if dtype is not None else target.dtype
    return drafter.to(device=device, dtype=dtype).eval()
