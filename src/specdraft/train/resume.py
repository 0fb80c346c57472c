"""Resume state: which checkpoint a run continues from, reading it back exactly, and writing the
optimizer's part of a checkpoint (docs/architecture.md, "Trainer").

A checkpoint-<step>/ folder is a drafter folder (formats/checkpoint.py) plus `trainer_state.json`
(the step, the losses and evaluations so far, the global batch and seed the data order depends
on) and the optimizer state: `optimizer.pt`, or under DeepSpeed ZeRO one `optimizer-rank<r>.pt`
per process, each written by its own process (none gathers another's part). Weights come back
through the checkpoint module's one reader; the optimizer files through torch's loader with
weights_only set, so no pickle runs.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specdraft.core import check_fingerprint
from specdraft.formats import checkpoint

STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class ResumeError(ValueError):
    """resume_from points at nothing usable, or a fresh run would overwrite a previous one."""


def find_resume(resume_from: str | None, out: Path, main: bool) -> Path | None:
    """The checkpoint a run writing to `out` continues from: None for a fresh run (an error if
    `out` already holds a checkpoint), the folder `resume_from` names, or for "latest" the newest
    complete one (skipping, with a warning, any that is not)."""
    existing = checkpoints(out)
    if resume_from is None:
        if existing:
            raise ResumeError(
                f"{out} already holds {existing[-1].name}; pass resume_from=latest to "
                "continue that run, or set output_dir to a new folder (nothing was overwritten)"
            )
        return None
    if resume_from != "latest":
        path = Path(resume_from).expanduser()
        problem = _resume_problem(path)
        if problem:
            raise ResumeError(
                f"resume_from={resume_from}: {problem}. Pass resume_from=latest to use the "
                f"newest complete checkpoint in {out}, or another checkpoint-<step> folder."
            )
        return path
    for path in reversed(existing):
        problem = _resume_problem(path)
        if problem is None:
            return path
        if main:
            warnings.warn(f"skipping {path}: {problem}", stacklevel=2)
            print(f"[specdraft] warning: skipping {path}: {problem}", file=sys.stderr)
    if existing:
        raise ResumeError(
            f"resume_from=latest: none of the {len(existing)} checkpoints in {out} is "
            "complete (see the warnings above); move them away to start afresh"
        )
    if main:
        print(
            f"[specdraft] resume_from=latest: no checkpoint in {out} yet, starting fresh",
            file=sys.stderr,
        )
    return None


def load_weights(drafter, path: Path, target_fingerprint: dict, device: torch.device) -> dict:
    """The checkpoint's weights, read straight into the drafter being trained (through
    checkpoint.read_weights, the reader load_drafter uses): not through load_drafter itself,
    whose from_pretrained would build the student partitioned under ZeRO-3 (a vocabulary of 0
    rows), and which drops training-only weights (Medusa-2's adapters). Returns the held-out
    statistics it carries, which the run saves until its next evaluation. The fine-tuned
    target's adapter hash changes as it trains; the base must match."""
    meta, _ = checkpoint.read_metadata(path)
    if meta is None:
        raise ResumeError(
            f"{path} is not a specdraft checkpoint (no specdraft block in its config.json); "
            "resume from a checkpoint-<step> folder a run wrote"
        )
    expected = dict(meta.get("target_fingerprint") or {})
    if expected.pop("adapter", None):  # a fine-tuned target: its weights are the run's, not the
        expected.pop("weights", None)  # base's it resumes from
    check_fingerprint(
        expected, target_fingerprint, f"the checkpoint {path}", error=ResumeError,
        fix="resume with the target it was trained against",
    )  # fmt: skip
    # a HF model folder (distill, LayerSkip) in its own names, else the drafter's own tensors
    module = drafter.as_hf_model() or drafter
    try:
        missing, unexpected, heldout = checkpoint.read_weights(module, path, meta, device=device)
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        raise ResumeError(_misfit(path, meta, drafter, err)) from err
    if missing or unexpected:
        why = f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        raise ResumeError(_misfit(path, meta, drafter, why))
    return heldout


def load_state(
    optimizer, path: Path, *, global_batch: int, seed: int, sharded: bool, world: int, device
) -> dict:
    """The trainer state of `path` (step, losses, evals, best_tau, skipped_steps), with the
    optimizer's state loaded into `optimizer`; a ResumeError when the run's global batch or seed
    differ from the checkpoint's, on which the data order depends."""
    state = json.loads((path / STATE_NAME).read_text())
    if state["global_batch"] != global_batch or state["seed"] != seed:
        raise ResumeError(
            f"{path} was trained with global batch {state['global_batch']} and seed "
            f"{state['seed']}; this run has {global_batch} and {seed}. The data order "
            "depends on both: resume with the same micro_batch_size x grad_accum x processes "
            "and seed."
        )
    # weights_only: tensors, numbers and (DeepSpeed) three allowlisted classes; no pickle runs.
    files = [_optimizer_file(sharded, r) for r in range(world if sharded else 1)]
    with torch.serialization.safe_globals(_deepspeed_state_classes() if sharded else []):
        states = [torch.load(path / f, map_location=device, weights_only=True) for f in files]
    # ZeRO's load_state_dict takes every process's part and picks its own.
    optimizer.load_state_dict(states if sharded else states[0])
    return state


def optimizer_files(
    optimizer, staging: Path, *, sharded: bool, rank: int, world: int, barrier: Callable[[], None]
) -> dict[str, bytes | Path]:
    """The optimizer's files for a checkpoint (name -> bytes, or a file to move in). DeepSpeed
    ZeRO partitions the optimizer state: every process writes its own part into `staging`
    beside the checkpoint (output_dir is shared by every process that saves) and the main
    process moves the files in, so no process holds another's part in memory."""
    if not sharded:
        buffer = io.BytesIO()
        torch.save(optimizer.state_dict(), buffer)
        return {OPTIMIZER_NAME: buffer.getvalue()}
    staging.mkdir(parents=True, exist_ok=True)
    mine = staging / _optimizer_file(True, rank)
    torch.save(optimizer.state_dict(), mine.with_suffix(".part"))
    os.replace(mine.with_suffix(".part"), mine)
    barrier()
    return {_optimizer_file(True, r): staging / _optimizer_file(True, r) for r in range(world)}


def _misfit(path: Path, meta: dict, drafter, why) -> str:
    """Why a checkpoint's weights do not fit the drafter this run builds: the drafter settings
    that differ between the two, each as the command-line override that resumes it, and what to do. Nothing is changed on
    disk."""
    saved = dict(meta.get("config") or {})
    now = dataclasses.asdict(drafter.config) if dataclasses.is_dataclass(drafter.config) else {}
    differ = _differences(saved, now, "drafter")
    said = "; ".join(str(why).splitlines()[:2])
    misfit = f"{path} does not fit the drafter this config builds ({said})"
    afresh = "start afresh in a new output_dir; the checkpoint is untouched."
    if not differ:
        return f"{misfit}; resume with the config it was trained with, or {afresh}"
    listed = ", ".join(f"{key}: {old!r} there, {new!r} here" for key, old, new in differ)
    override = " ".join(
        shlex.quote(
            f"{key}={old if isinstance(old, str) else json.dumps(old, separators=(',', ':'))}"
        )
        for key, old, _ in differ
    )  # YAML on the command line: null, true, [1,2], strings bare
    return (
        f"{misfit}. Its drafter settings differ: {listed}. Resume with the settings it was "
        f"trained with ({override}), or {afresh}"
    )


def _differences(saved: dict, now: dict, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every leaf setting that differs; keys only
    one side has are skipped (a newer section's field, an older one's)."""
    out = []
    for key, value in now.items():
        if key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            out += _differences(saved[key], value, f"{prefix}.{key}")
        elif saved[key] != value:
            out.append((f"{prefix}.{key}", saved[key], value))
    return out


def _resume_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, or None when it can."""
    if not path.is_dir():
        return "no such folder"
    try:
        checkpoint.check_complete(path)
    except checkpoint.CheckpointError as e:
        return str(e)
    weights_only = "(a best/ or final/ folder holds weights only, not the resume state)"
    if not any(path.glob("optimizer*.pt")):
        return f"it has no optimizer state {weights_only}"
    if not (path / STATE_NAME).is_file():
        return f"it has no {STATE_NAME} {weights_only}"
    try:
        json.loads((path / STATE_NAME).read_text())
    except json.JSONDecodeError as e:
        return f"{STATE_NAME} is damaged ({e})"
    return None


def checkpoints(out: Path) -> list[Path]:
    """checkpoint-<step> folders in `out`, oldest step first."""
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


def _optimizer_file(sharded: bool, rank: int) -> str:
    return f"optimizer-rank{rank}.pt" if sharded else OPTIMIZER_NAME


def _deepspeed_state_classes() -> list:
    """The classes a DeepSpeed ZeRO optimizer state holds besides tensors and numbers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]
