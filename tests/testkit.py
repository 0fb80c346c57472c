"""Setup the tests share, written once."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

from specdraft.targets.sharded_target import free_port


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
    if Path(args[0]).name == "accelerate" and args[1] == "launch":
        # a rendezvous port of its own: the suite's two workers may launch at the same time,
        # and torchrun's default port (29500) would be taken by the other's
        args = [*args[:2], "--main_process_port", str(free_port()), *args[2:]]
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stderr


def assert_chunking_exact(
    drafter: torch.nn.Module,
    loss_fn,
    inputs: Iterable[torch.Tensor] = (),
    chunks: Iterable[int] = (1, 5, 100_000),
) -> None:
    """The drafter's loss (`loss_fn()`, a scalar, called once per setting) and its gradients
    w.r.t. its trainable parameters and `inputs` (leaves with requires_grad: the target's hidden
    states) with the loss's vocabulary-wide logits computed `chunk` positions at a time
    (loss_chunk_tokens, specdraft/losses.py) equal those of the naive, unchunked loss within
    1e-5 relative (float32). Chunks of 1, of 5 (a remainder) and larger than the batch."""
    inputs = list(inputs)
    params = [p for p in drafter.parameters() if p.requires_grad]

    def run(chunk: int):
        drafter.loss_chunk_tokens = chunk
        loss = loss_fn()
        grads = torch.autograd.grad(loss, [*params, *inputs], allow_unused=True)
        return loss.detach(), grads

    want_loss, want = run(0)
    assert want_loss.dtype == torch.float32 and any(g is not None for g in want)
    for chunk in chunks:
        loss, got = run(chunk)
        torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
        for g, w in zip(got, want, strict=True):
            assert (g is None) == (w is None)
            if w is not None:
                scale = float(w.abs().max())
                torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5 * scale + 1e-12)
