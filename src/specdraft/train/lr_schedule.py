"""What each step trains on and at what rate, as pure functions of the step: the learning rate,
the data order (a stream of seeded epochs), each process's slice of a step and of the held-out
data, the seed of torch's generators, and the padded batch. A run split over N processes sees the same global batch as one process,
and a resumed run the same examples as an uninterrupted one.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch

from specdraft.attention import document_layout
from specdraft.train.train_config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - floor) * progress


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of torch's generators for `step` on process `rank` (fits in 63 bits)."""
    return (seed * 1_000_003 + step * 9_176 + rank * 7_919_111) % (2**63 - 1)


def eval_chunks(n: int, rank: int, world: int, size: int) -> list[tuple[list[int], float]]:
    """The held-out micro-batches of process `rank`: (example indices, weight) pairs.

    Every process runs the same number of forwards (ZeRO-3 gathers parameters in each one, so
    a process that stopped early would leave the others waiting forever), and each example of
    range(n) counts once over all processes: a process with fewer examples of its own pads with
    example 0 at weight 0.
    """
    mine = list(range(rank, n, world))
    chunks = max(1, math.ceil(math.ceil(n / world) / size))
    return [
        (mine[i * size : (i + 1) * size], 1.0) if mine[i * size : (i + 1) * size] else ([0], 0.0)
        for i in range(chunks)
    ]


def examples_for(
    step: int, micro: int, rank: int, n_examples: int, cfg: TrainConfig, world: int
) -> list[int]:
    """Indices of the examples micro-batch `micro` of `step` uses on process `rank`.

    The data is a stream of epochs, each a permutation seeded by (seed, epoch). A step takes the
    next micro_batch_size * grad_accum * world examples; micro-batch m of rank r takes slice
    (m * world + r), so one process with world x the micro-batch sees the same examples per step.
    """
    mb = cfg.micro_batch_size
    start = (step * cfg.grad_accum * world + micro * world + rank) * mb
    at = (divmod(pos, n_examples) for pos in range(start, start + mb))  # (epoch, offset)
    return [int(_epoch_order(cfg.seed, epoch, n_examples)[offset]) for epoch, offset in at]


@functools.lru_cache(maxsize=2)  # a memo of a pure function: the current and the next epoch
def _epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def collate(examples: Sequence[Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad examples (input_ids, loss_mask lists) into a batch of (batch, seq) tensors.

    Packed rows (examples with `document_lengths`, data.pack) also get document_ids and
    position_ids (specdraft/attention.py, "Packed rows"), and no document's first token carries
    loss, as no row's does; where every row records its documents' indices (pack_documents),
    document_index (batch, most documents in a row) holds them, -1 after a row's last."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask)
    loss_mask[:, 0] = 0  # the first token has nothing before it to predict it from
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    if any(getattr(e, "document_lengths", None) for e in examples):
        lengths = [getattr(e, "document_lengths", None) or [len(e.input_ids)] for e in examples]
        batch["document_ids"], batch["position_ids"] = document_layout(lengths, length)
        loss_mask[batch["position_ids"] == 0] = 0  # each document's first token, likewise
        indices = [getattr(e, "document_indices", None) for e in examples]
        if all(i is not None for i in indices):  # for kinds that seed their draws per document
            width = max(len(i) for i in indices)
            batch["document_index"] = torch.tensor([i + [-1] * (width - len(i)) for i in indices])
    return {k: v.to(device) for k, v in batch.items()}


def param_groups(drafter, cfg: TrainConfig) -> list[dict]:
    """AdamW's groups: the drafter's own (`param_groups`: an lr_scale and a start_step each),
    else one group of everything trainable; each split so that only matrices decay."""
    out = []
    for group in drafter.param_groups():
        trainable = [p for p in group["params"] if p.requires_grad]
        extra = {k: v for k, v in group.items() if k != "params"}
        for params, decay in (
            ([p for p in trainable if p.ndim >= 2], cfg.weight_decay),
            ([p for p in trainable if p.ndim < 2], 0.0),
        ):
            if params:
                out.append({"params": params, "weight_decay": decay, **extra})
    return out
