"""The one writer and the one reader of drafter weights (docs/architecture.md, "Checkpoint").

A drafter folder holds:

    config.json         a `specdraft` block: kind, format_version, the kind's config, its decoding
                        defaults (`decode`, a core.DecodeConfig), the target fingerprint it was
                        trained against (`target_fingerprint`) and provenance (git commit, data,
                        steps). For a drafter that is a plain Hugging Face
                        causal LM (a distilled draft) it is the model's own HF config with the
                        block added, so `AutoModelForCausalLM.from_pretrained` loads the folder.
    model.safetensors   the drafter's own tensors (tensors shared with the target are recorded in
                        the block, not stored)
    train_config.yaml   the resolved training config, when a trainer wrote the folder
    COMPLETE            written last; a specdraft folder without it is never loaded

Folders are written to a temporary sibling and renamed into place, so a crash leaves the old
folder or the new one, never half of one. Loading is strict: a drafter loaded for a target whose
fingerprint differs is an error naming every difference. Only safetensors are read: no pickle.

A drafter kind takes part through the hooks `Drafter` declares (drafters/base.py): `kind` (its
class registers itself), `config` (its dataclass), `config_class`, and `from_checkpoint(config,
target, hf_model)`, which rebuilds the module (hf_model: the loaded HF model for a kind saved as
one, `model_to_save`, else None).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from specdraft.core import DecodeConfig, check_fingerprint
from specdraft.drafters.base import Drafter, hf_model_kind, vocab_mismatch_error
from specdraft.drafters.base import drafter_class as registered_class
from specdraft.targets.target import ADAPTER_ATTRIBUTE, Target

# The one version this specdraft reads and writes; a folder of another is refused in one place
# (read_metadata), with the fix. 3: the first layout of the installable package (src/specdraft):
# every key a config has is saved, decoding settings in their own `decode` block, held-out
# statistics in `heldout`.
FORMAT_VERSION = 3
COMPLETE_MARKER = "COMPLETE"
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


class CheckpointError(ValueError):
    """A folder that cannot be loaded: missing, incomplete, corrupt, or for another target."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No drafter folder (or no config.json in it) where one was asked for."""


# --- writing -----------------------------------------------------------------------------------


def save_drafter(
    drafter: Drafter,
    folder: str | Path,
    *,
    target_fingerprint: dict,
    decode: DecodeConfig | None = None,
    heldout: dict | None = None,
    train_config_yaml: str | None = None,
    provenance: dict | None = None,
    tokenizer: Any = None,
    extra_files: dict[str, bytes | Path] | None = None,
) -> Path:
    """Write `drafter` as a complete checkpoint folder at `folder`, atomically, and return it.
    `decode`: the decoding defaults saved with it, read back by load_decoding (None: its
    kind's); `heldout`: its held-out statistics (None: those it was loaded with).

        `extra_files` (name -> bytes, or a file on the same file system, moved in) go inside the
        folder before it is marked complete: the trainer puts its resume state there, so a checkpoint
        is complete as a whole or not at all. An existing
        `folder` is replaced only once the new one is fully written.
    """
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        meta = {
            "kind": drafter.kind,
            "format_version": FORMAT_VERSION,
            "config": dataclasses.asdict(drafter.config),
            "decode": dataclasses.asdict(drafter.decode_settings(decode)),
            # what its evaluation measured for decoding (Drafter.heldout_summary)
            "heldout": dict(heldout if heldout is not None else drafter.checkpoint.heldout),
            "target_fingerprint": target_fingerprint,
            "provenance": {"git_commit": git_commit(), **(provenance or {})},
        }
        # a kind may save another model than the one it trains (LayerSkip's LoRA: merged)
        hf_model = drafter.model_to_save()
        if hf_model is not None:
            # A plain HF folder: transformers writes the config and (tie-aware) safetensors.
            hf_model.save_pretrained(tmp, safe_serialization=True)
            config = json.loads((tmp / CONFIG_NAME).read_text())
            if drafter.uses_target_weights and target_fingerprint.get("adapter"):
                # the fine-tuned target's own config names its adapter hash, so
                # load_target(folder) fingerprints it as the drafter records it
                config[ADAPTER_ATTRIBUTE] = target_fingerprint["adapter"]
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp)
        else:
            shared = set(drafter.checkpoint.shared_with_target)
            state = {
                k: v.detach().contiguous().cpu()
                for k, v in drafter.state_dict().items()
                if k not in shared
            }
            save_file(state, str(tmp / WEIGHTS_NAME), metadata={"format": "pt"})
            config = {}
            meta["shared_with_target"] = sorted(shared)
        config["specdraft"] = meta
        (tmp / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
        if train_config_yaml is not None:
            (tmp / "train_config.yaml").write_text(train_config_yaml)
        drafter.write_extra(tmp)  # a kind's own files (Medusa-2's peft adapter)
        for name, data in (extra_files or {}).items():
            if isinstance(data, Path):
                os.replace(data, tmp / name)  # written by another process: never held here
            else:
                (tmp / name).write_bytes(data)
        (tmp / COMPLETE_MARKER).write_text("complete\n")
        replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def save_target_folder(model, tokenizer, folder: str | Path) -> Path:
    """Write a (fine-tuned, merged) target as a plain Hugging Face model folder at `folder`,
    atomically as drafter folders are: `load_target(folder)` reads it, its fingerprint naming
    the adapter merged into it."""
    folder = Path(folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    clear_leftovers(folder)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.tmp-", dir=folder.parent))
    try:
        model.save_pretrained(tmp, safe_serialization=True)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        replace_dir(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def set_decode(folder: str | Path, decode: DecodeConfig, measured: dict | None = None) -> None:
    """Replace the decoding defaults saved in a drafter folder (after tuning them on the machine
    that serves it), atomically: a reader sees the old config.json or the new one. `measured`
    (where and how fast they were measured) is kept beside them as `decode_measured`."""
    config_file = Path(folder) / CONFIG_NAME
    read_metadata(folder)  # a complete specdraft folder, or a clear error
    config = json.loads(config_file.read_text())
    config["specdraft"]["decode"] = dataclasses.asdict(decode)
    if measured is not None:
        config["specdraft"]["decode_measured"] = measured
    tmp = config_file.with_name(f".{CONFIG_NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    _fsync(tmp)
    os.replace(tmp, config_file)
    _fsync(config_file.parent)


def replace_dir(new: Path, dest: Path) -> None:
    """Put the complete folder `new` at `dest`, durably, so that a reader or a crash finds the
    old folder or the new one, never neither: `new` is synced to disk first, and an existing
    `dest` is swapped with it in one atomic exchange (Linux renameat2). Where no exchange exists,
    the old folder is renamed aside for the instant between two renames, and a later save
    clears what a crash there left (`clear_leftovers`)."""
    _fsync_tree(new)
    if not dest.exists():
        os.rename(new, dest)
    elif _exchange(new, dest):  # new now holds the old folder
        shutil.rmtree(new, ignore_errors=True)
    else:
        old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
        os.rename(dest, old)
        os.rename(new, dest)
        shutil.rmtree(old, ignore_errors=True)
    _fsync(dest.parent)


def clear_leftovers(folder: Path) -> None:
    """Remove what a crashed save of `folder` left beside it: a temporary or swapped-out copy
    (never the folder itself). If the crash came between the two renames of the fallback, the
    swapped-out copy is the last complete folder: it is put back rather than removed."""
    for old in sorted(folder.parent.glob(f".{folder.name}.old-*")):
        if not folder.exists() and (old / COMPLETE_MARKER).exists():
            os.rename(old, folder)
        else:
            shutil.rmtree(old, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (renameat2 with RENAME_EXCHANGE); False where the OS, libc or
    file system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    return renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0


def _fsync_tree(folder: Path) -> None:
    for path in folder.rglob("*"):
        if path.is_file():
            _fsync(path)
    _fsync(folder)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def git_commit() -> str | None:
    """The specdraft source's git commit (+dirty with local changes), for provenance; None for
    an installed package (its folder is not a checkout's src/specdraft, and a git repository
    around a virtual environment is somebody else's)."""
    package = Path(__file__).resolve().parents[1]  # src/specdraft in a checkout
    root = package.parents[1]
    if package.parent.name != "src" or not (root / "pyproject.toml").is_file():
        return None
    try:
        run = dict(cwd=root, capture_output=True, text=True, timeout=10)
        commit = subprocess.run(["git", "rev-parse", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], **run).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (commit + ("+dirty" if dirty else "")) or None


# --- reading -----------------------------------------------------------------------------------


def load_checkpoint(
    path: str | Path,
    target: Target,
    *,
    strict: bool = True,
    device: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
) -> Drafter:
    """The drafter in the specdraft checkpoint or plain Hugging Face causal-LM folder `path`,
    for `target`, on the target's device and dtype unless given (formats/reading.py
    `load_drafter` reads every layout and calls this for these two).

    A plain HF causal-LM folder (no `specdraft` block) loads as a two-model drafter (the kind
    that `wraps_hf_models`); its vocabulary must be the target's. A folder written by specdraft
    must have been trained against this target: strict (the default) compares the whole
    fingerprint, strict=False only the vocabulary size.
    """
    folder = Path(path).expanduser()
    meta, hf_config = read_metadata(folder)
    if meta is None and hf_config is None:
        raise CheckpointError(
            f"{folder / CONFIG_NAME} is neither a specdraft checkpoint (a `specdraft` block) "
            "nor a Hugging Face causal-LM folder (`model_type`)"
        )
    device = device if device is not None else target.device
    dtype = dtype if dtype is not None else target.dtype
    cls = drafter_class(meta["kind"]) if meta is not None else hf_model_kind()
    if meta is not None:
        expected = meta.get("target_fingerprint") or {}
        fix = "load the target it was made for, or train one for this target"
        if cls.uses_target_weights:
            fix = f"a {cls.title or cls.kind} drafter is its own target: load_target('{folder}')"
        elif expected.get("adapter"):  # trained with the target fine-tuned (Medusa-2)
            fix = (
                f"it decodes with the target fine-tuned beside it: load_target(BASE, "
                f"adapter='{folder / 'adapter'}'), or the merged target its run saved"
            )
        check_fingerprint(
            expected,
            target.fingerprint,
            f"the {meta.get('kind')} drafter in {folder}",
            keys=None if strict else ("vocab_size",),
            error=CheckpointError,
            fix=fix,
        )
    kind = cls.kind
    config = None
    if meta is not None:
        config_values, decode_values = _split_decode(meta, folder)
        config = _config_from_dict(cls.config_class, config_values, folder)
        # a damaged decode block is refused here too, before a module is built (load_decoding
        # reads it for whoever decodes)
        decode_from_dict(cls, decode_values, folder)
    if cls.uses_target_weights:
        # the drafter is the target itself (LayerSkip): the fingerprint check above made sure the
        # target is this folder's model, so no second copy is loaded
        drafter = cls.from_checkpoint(config, target, None)
    elif hf_config is not None:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        vocab = model.get_output_embeddings().weight.shape[0]
        if vocab != target.vocab_size:
            raise vocab_mismatch_error(f"the draft model in {folder}", vocab, target)
        drafter = cls.from_checkpoint(config, target, model)
    else:
        drafter = cls.from_checkpoint(config, target, None)
        missing, unexpected, heldout = read_weights(drafter, folder, meta)
        drafter.checkpoint = drafter.checkpoint.with_heldout(heldout)
        # weights only training uses (Medusa-2's adapters, which decoding has merged in)
        only_training = cls.checkpoint.training_only_prefixes
        unexpected = [k for k in unexpected if not k.startswith(only_training)]
        if missing or unexpected:
            raise CheckpointError(
                f"{folder / WEIGHTS_NAME} does not fit the {kind} drafter its config describes: "
                f"missing {missing[:5]}, unexpected {unexpected[:5]}; the folder is corrupt or "
                "was written by another version"
            )
    drafter.to(device=device, dtype=dtype).eval()  # drafting, not training: no dropout
    if meta is not None:
        fingerprint = meta.get("target_fingerprint")
        drafter.checkpoint = dataclasses.replace(drafter.checkpoint, target_fingerprint=fingerprint)
    return drafter


def checkpoint_decoding(path: str | Path) -> DecodeConfig:
    """The decoding settings saved in the specdraft checkpoint or plain HF folder `path`: its
    `decode` block (set_decode rewrites it after tuning), else the kind's defaults
    (`Drafter.decode_class`). formats/reading.py `load_decoding` reads every layout."""
    folder = Path(path).expanduser()
    meta, _ = read_metadata(folder)
    if meta is None:  # a plain HF folder records no decoding settings
        return hf_model_kind().decode_settings()
    _, values = _split_decode(meta, folder)
    return decode_from_dict(registered_class(meta["kind"]), values, folder)


def read_weights(
    module: torch.nn.Module,
    folder: str | Path,
    meta: dict,
    *,
    device=None,
) -> tuple[list[str], list[str], dict]:
    """Every safetensors file of `folder` loaded into `module` in place, not strictly: the
    (missing, unexpected) state-dict names, less the tensors the folder shares with the target
    (recorded, not stored) and the tied weights saved once under another name, and the held-out
    statistics the folder carries (its config's `heldout`). The one reader of weights:
    load_drafter and a resumed run both use it. A tensor of another shape raises torch's
    RuntimeError ("size mismatch")."""
    state: dict[str, torch.Tensor] = {}
    for weights in sorted(Path(folder).glob("*.safetensors")):
        state.update(load_file(weights, device=str(device) if device is not None else "cpu"))
    heldout = dict(meta.get("heldout") or {})
    missing, unexpected = module.load_state_dict(state, strict=False)
    shared = set(meta.get("shared_with_target", ()))
    # a tied weight (the LM head of tied embeddings) is saved once, under one name
    ptrs = {k: v.data_ptr() for k, v in module.state_dict(keep_vars=True).items()}
    loaded = {ptrs[k] for k in state if k in ptrs}
    missing = [k for k in missing if k not in shared and ptrs.get(k) not in loaded]
    return missing, list(unexpected), heldout


def read_metadata(folder: str | Path) -> tuple[dict | None, dict | None]:
    """(the `specdraft` block or None, the HF model config or None) of a drafter folder.

    Raises CheckpointError when the folder is missing, incomplete or unreadable.
    """
    folder = Path(folder)
    config_file = folder / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointNotFoundError(
            f"{folder} has no {CONFIG_NAME}: pass a drafter folder (a trained run's best/ or "
            "final/, or a Hugging Face causal-LM folder sharing the target's vocabulary)"
        )
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(
            f"{config_file} is not valid JSON ({e}): the folder is corrupt"
        ) from e
    meta = config.pop("specdraft", None)
    if meta is not None:
        if not (folder / COMPLETE_MARKER).exists():
            raise CheckpointError(
                f"{folder} has no {COMPLETE_MARKER} marker: it was cut off while being written. "
                "Use an earlier checkpoint (resume_from=latest skips incomplete ones)."
            )
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            newer = isinstance(version, int) and version > FORMAT_VERSION
            has = f"checkpoint format {version}" if version is not None else "no format_version"
            raise CheckpointError(
                f"{folder} has {has}; this specdraft reads format {FORMAT_VERSION} only. "
                + (
                    "Upgrade specdraft to read it."
                    if newer
                    else "It was written by an earlier specdraft: retrain the drafter; a kind "
                    "an export layout holds (EAGLE, P-EAGLE, DFlash, Medusa) can instead be "
                    "exported by the specdraft that wrote it (scripts/export.py) and the export "
                    "loaded here, as load_drafter reads every export layout."
                )
            )
    if not any(folder.glob("*.safetensors")):
        raise CheckpointError(f"{folder} has no weights ({WEIGHTS_NAME}): the folder is incomplete")
    return meta, (config if "model_type" in config else None)


def check_complete(folder: str | Path) -> None:
    """Raise CheckpointError unless `folder` is complete and every weight file reads in full."""
    read_metadata(folder)
    for weights in Path(folder).glob("*.safetensors"):
        try:
            load_file(weights)  # reads the header and every tensor: detects truncation
        except Exception as e:  # safetensors raises several types for a damaged file
            raise CheckpointError(f"{weights} cannot be read ({e}): the file is damaged") from e


def drafter_class(kind: str) -> type[Drafter]:
    """The registered class of `kind`; a CheckpointError naming the known kinds otherwise (a
    kind defined outside specdraft registers once its module is imported)."""
    try:
        return registered_class(kind)
    except KeyError as e:
        raise CheckpointError(
            f"{e.args[0]}: import the module that defines it before loading"
        ) from None


def _split_decode(meta: dict, folder: Path) -> tuple[dict, dict]:
    """(the kind's config values, the decoding defaults) of a `specdraft` block."""
    if not isinstance(meta.get("decode"), dict):
        raise CheckpointError(
            f"{folder / CONFIG_NAME} has no `decode` block: the folder is corrupt"
        )
    return dict(meta.get("config") or {}), dict(meta["decode"])


def decode_from_dict(kind: type[Drafter], values: dict, folder: Path) -> DecodeConfig:
    """The kind's decoding settings saved in `folder`; another kind's setting, or an unknown
    one, is a CheckpointError."""
    try:
        return kind.decode_settings(values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: its decoding settings are not valid for a "
            f"{kind.title or kind.kind} drafter: {e}"
        ) from e


def _config_from_dict(cls: type, values: dict, folder: Path) -> Any:
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = set(values) - set(fields)
    if unknown:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: its {cls.__name__} has keys this specdraft does not know: "
            f"{sorted(unknown)}; it was written by a newer version"
        )
    values = dict(values)
    for name, value in values.items():  # a nested config (Medusa's lora) as its own dataclass
        factory = fields[name].default_factory
        if isinstance(value, dict) and factory is not dataclasses.MISSING:
            inner = factory()
            if dataclasses.is_dataclass(inner):
                values[name] = _config_from_dict(type(inner), value, folder)
    try:
        return cls(**values)
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{folder / CONFIG_NAME}: its {cls.__name__} is not valid: {e}"
        ) from e
