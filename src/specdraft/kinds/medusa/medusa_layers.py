"""Medusa's head modules: residual blocks that start as the identity, then an output layer of the
head's own or the target's LM head (kinds/medusa/medusa.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero at the start: the identity until trained."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHead(nn.Module):
    """One head: its blocks, then (output=own) its output layer."""

    def __init__(self, hidden: int, num_layers: int, vocab: int | None) -> None:
        super().__init__()
        # a comprehension, not [ResBlock(h)] * n, which would make every block one module
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(num_layers))
        self.out = nn.Linear(hidden, vocab, bias=False) if vocab else None

    def features(self, h: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            h = block(h)
        return h
