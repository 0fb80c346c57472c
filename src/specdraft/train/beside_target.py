"""Set up, train, report: the recipe of every kind whose drafter trains beside the target (all
but LayerSkip, whose target is its drafter), given by each kind's trainer only what is its own."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

from specdraft.core import eos_ids
from specdraft.data.dataset import build_datasets
from specdraft.drafters.base import Drafter
from specdraft.drafting import build_draft_vocab
from specdraft.targets.frozen import frozen_targets
from specdraft.targets.hidden_cache import CachedTarget, HiddenStateCache
from specdraft.targets.target import Target
from specdraft.train.after_training import loop_prompts, report_after_training
from specdraft.train.launch import whole_model_loading
from specdraft.train.train_config import TrainConfig, setting_up
from specdraft.train.trainer import TrainResult, train


def train_beside_target(
    cfg: TrainConfig,
    build: Callable[[Any, Target, list], Drafter],
    describe: Callable[[Drafter, Target], str],
    *,
    reads_weights: bool = True,
    hidden_cache: str | None = None,
    release_lm_head: Callable[[Drafter], bool] | None = None,
    finish: Callable[[Drafter, Target, list, list], Target] | None = None,
) -> TrainResult:
    """Set up, train and report one run of `cfg`: a kind's `run`, as `main` and scripts/compare.py
    call it. Raises SetupError before training for missing data, a bad target or a drafter that
    `build(drafter config, target, train examples)` refuses. describe(drafter, target): the line
    printed before training. reads_weights: the drafter reads the target's embedding or LM head
    (targets/frozen.py). hidden_cache: train offline from this scripts/dump_hidden_states.py
    folder. release_lm_head(drafter): a sharded run may let the drafter's copy of the LM head go.
    finish(drafter, target, eval examples, prompts): the target measured after a finished run
    (a fine-tuned one), on the main process."""
    with setting_up():
        # offline, the target's hidden states come from the cache, and sharded, from its
        # partitioned forward: a drafter that reads weights gets a copy of only the target's
        # embedding and LM head on every process (the decoder layers stay on the meta device)
        target, frozen = frozen_targets(
            cfg.target, dtype=cfg.target_dtype(), sharding=cfg.target_sharding,
            reads_weights=reads_weights, offline=bool(hidden_cache),
        )  # fmt: skip
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # the drafter's random init; identical on every process
        drafter = build(cfg.drafter, target, train_examples)
        if cfg.target_sharding != "none" and release_lm_head and release_lm_head(drafter):
            # the sharded target computes the logits, and the drafter reads no more of the copy's
            target.release_lm_head()
        if hidden_cache:  # offline: hidden states and p come from the cache
            examples = [*train_examples, *eval_examples]
            cache = HiddenStateCache(hidden_cache, target, examples, drafter.capture_layers)
            frozen = CachedTarget(target, cache)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        if cfg.target_sharding != "none" and prompts:  # the measurement needs it whole
            print(
                "[specdraft] eval_loop is on: after training the main process loads the whole "
                "target on its device to decode with the drafter; for a target that does not fit "
                "one device set eval_loop.enabled=false (training and its checkpoints are "
                "unaffected)",
                file=sys.stderr,
            )
    cfg.drafter = drafter.config  # as resolved by `build`, into train_config.yaml
    print(summary.format(), file=sys.stderr)
    print(f"[specdraft] {describe(drafter, target)}", file=sys.stderr)
    result = train(
        cfg, drafter, frozen, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    if finish is not None and result.main_process and not result.stopped_by_signal:
        target = finish(drafter, target, eval_examples, prompts)
    with whole_model_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        frozen = None  # a sharded target's or the cache's memory goes before the whole one
        report_after_training(target, result, prompts, cfg)
    return result


def draft_vocab(train_examples: list, size: int, target: Target) -> torch.Tensor | None:
    """A reduced draft vocabulary d2t of `size` tokens, counted from the training data (the
    target's EOS ids always in); None where `size` is 0 or the whole vocabulary."""
    if not 0 < size < target.vocab_size:
        return None
    eos = eos_ids(target.model, target.tokenizer)
    return build_draft_vocab(train_examples, size, target.vocab_size, always=eos)
