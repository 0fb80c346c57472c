"""The frozen target a training run holds: whole, sharded over the processes by ZeRO-3, or an
embeddings-only copy (`frozen_targets`).

A sharded target (`ShardedTarget`, targets/sharded_target.py) runs forwards but holds no whole weight
outside them, so a drafter that reads the target's embedding or LM head while training (EAGLE,
Medusa) gets an embeddings-only copy of them on its device, while the trainer runs the sharded
forwards. A drafter that reads weights only when it is built (a distilled student seeded from
the target's layers) is built from the sharded target itself, which gathers them for it. A
target that is not `complete` cannot decode: the end of a run loads the whole one
(train/after_training.py).
"""

from __future__ import annotations

import sys

import torch

from specdraft.targets.sharded_target import load_sharded_target
from specdraft.targets.target import Target, load_target

SHARDINGS = ("none", "zero3")


def frozen_targets(
    name: str,
    *,
    dtype: torch.dtype | str | None,
    sharding: str = "none",
    reads_weights: bool,
    offline: bool = False,
) -> tuple[Target, Target]:
    """(the target the drafter is built from and reads, the target the trainer runs), for the
    target `name` in `dtype`.

    sharding: "zero3" partitions the target over the processes (`load_sharded_target`).
    reads_weights: the drafter reads the target's embedding or LM head while training (EAGLE,
    Medusa); sharded, it then gets an embeddings-only copy of them. offline: no target forward
    runs (EAGLE's hidden-state cache, targets/hidden_cache.py): both are the embeddings-only
    copy, which the caller wraps in a `CachedTarget`.
    """
    if sharding not in SHARDINGS:
        raise ValueError(f"target sharding {sharding!r}: use one of {', '.join(SHARDINGS)}")
    sharded = None
    if sharding == "zero3":
        sharded = load_sharded_target(name, dtype=dtype)
        held, total = sharded.parameters_held()
        print(
            f"[specdraft] target sharded by ZeRO-3 over {torch.distributed.get_world_size()} "
            f"process(es): this one holds {held / 1e6:.2f}M of its {total / 1e6:.2f}M parameters",
            file=sys.stderr,
        )
        if not reads_weights:
            return sharded, sharded
    target = load_target(
        name,
        dtype=dtype,
        embeddings_only=offline or sharded is not None,
        device=sharded.device if sharded is not None else None,
    )
    return target, sharded if sharded is not None else target
