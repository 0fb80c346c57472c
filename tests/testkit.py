"""Setup the tests share, written once."""

from __future__ import annotations

from collections.abc import Iterable

import torch


@torch.no_grad()
def perturb(params: Iterable[torch.Tensor], scale: float = 1.0, floor: float | None = None):
    """Add N(0, scale^2) noise to each parameter, in order (so a seed gives the same weights);
    with `floor`, scaled by each parameter's own std, at least `floor`. An untrained drafter
    then drafts varied tokens, accepted often but not always."""
    for p in params:
        p.add_(torch.randn_like(p) * scale * (p.std().clamp(min=floor) if floor else 1.0))
