"""Setup the tests share, written once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch


@torch.no_grad()
def perturb(params: Iterable[torch.Tensor], scale: float = 1.0, floor: float | None = None):
    """Add N(0, scale^2) noise to each parameter, in order (so a seed gives the same weights);
    with `floor`, scaled by each parameter's own std, at least `floor`. An untrained drafter
    then drafts varied tokens, accepted often but not always."""
    for p in params:
        p.add_(torch.randn_like(p) * scale * (p.std().clamp(min=floor) if floor else 1.0))


ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = str(Path(sys.executable).parent / "accelerate")


def run_script(args: list[str], cwd: Path = ROOT, env: dict | None = None) -> str:
    """Run a training command (`accelerate launch ...` or a plain `python train/...`) in its own
    processes, one thread each; assert it succeeded (its stderr's end otherwise) and return its
    stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"} if env is None else env
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr
