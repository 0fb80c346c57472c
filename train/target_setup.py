"""The frozen target a run trains against, whole or sharded over the processes by ZeRO-3
(`target_sharding`), and the whole one the end of a run decodes with.

A sharded target (targets/target.py `ShardedTarget`) runs forwards but holds no whole weight
outside them, so a drafter that reads the target's embedding or LM head while training (EAGLE,
Medusa) gets an embeddings-only copy of them on its device, while the trainer runs the sharded
forwards. A drafter that reads weights only when it is built (a distilled student seeded from
the target's layers) is built from the sharded target itself, which gathers them for it.
"""

from __future__ import annotations

import sys

import torch

from specdraft.targets.target import Target, load_sharded_target, load_target
from specdraft.train.config import TrainConfig


def frozen_targets(
    cfg: TrainConfig, *, reads_weights: bool, offline: bool = False
) -> tuple[Target, Target]:
    """(the target the drafter is built from and reads, the target the trainer runs).

    reads_weights: the drafter reads the target's embedding or LM head while training (EAGLE,
    Medusa); sharded, it then gets an embeddings-only copy of them. offline: no target forward
    runs (EAGLE's hidden-state cache): both are the embeddings-only copy, which the caller wraps.
    """
    sharded = None
    if cfg.target_sharding == "zero3":
        sharded = load_sharded_target(cfg.target, dtype=cfg.target_dtype())
        held, total = sharded.parameters_held()
        print(
            f"[specdraft] target sharded by ZeRO-3 over {torch.distributed.get_world_size()} "
            f"process(es): this one holds {held / 1e6:.2f}M of its {total / 1e6:.2f}M parameters",
            file=sys.stderr,
        )
        if not reads_weights:
            return sharded, sharded
    target = load_target(
        cfg.target,
        dtype=cfg.target_dtype(),
        embeddings_only=offline or sharded is not None,
        device=sharded.device if sharded is not None else None,
    )
    return target, sharded if sharded is not None else target


def warn_the_loop_loads_the_whole_target(cfg: TrainConfig, prompts) -> None:
    """Before a sharded run: the measurement at its end needs the target whole on one device."""
    if cfg.target_sharding != "none" and prompts:
        print(
            "[specdraft] eval_loop is on: after training the main process loads the whole target "
            "on its device to decode with the drafter; for a target that does not fit one device "
            "set eval_loop.enabled=false (training and its checkpoints are unaffected)",
            file=sys.stderr,
        )


def decoding_target(cfg: TrainConfig, target: Target, result, prompts) -> Target:
    """What the end of the run decodes with: `target` itself when it is whole, else (a sharded
    target, or an embeddings-only copy) the whole target loaded on its device, on the main
    process only and only when there is something to decode."""
    stand_in = cfg.target_sharding != "none" or bool(getattr(cfg, "hidden_cache", None))
    if not stand_in or not prompts or not result.main_process or result.stopped_by_signal:
        return target
    return load_target(cfg.target, dtype=cfg.target_dtype(), device=target.device)
