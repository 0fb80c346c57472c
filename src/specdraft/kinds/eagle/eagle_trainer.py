"""Train an EAGLE head on the target's hidden states: `accelerate launch train/eagle.py [key=value ...]`.

Defaults to configs/eagle/demo.yaml (the main job: an EAGLE-3 head for SmolLM2-135M-Instruct, on a
CPU in about 15 minutes; SPECDRAFT_CONFIGS names another folder of defaults);
`--config configs/eagle/llama3.1-8b-eagle3.yaml` picks a recipe, `--help` lists every key.
Setup, train, report: the loop is train/trainer.py, the head and its loss kinds/eagle/eagle.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdraft.config import ConfigError, default_config
from specdraft.core import eos_ids
from specdraft.data.dataset import build_datasets
from specdraft.drafting import build_draft_vocab
from specdraft.kinds.eagle import eagle
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.targets.frozen import frozen_targets
from specdraft.targets.hidden_cache import CachedTarget, HiddenStateCache
from specdraft.train.after_training import (
    loop_prompts,
    report_after_training,
    warn_the_loop_loads_the_whole_target,
)
from specdraft.train.launch import whole_model_loading
from specdraft.train.train_config import TrainConfig, setting_up
from specdraft.train.trainer import TrainResult, train

DEFAULT_CONFIG = default_config("eagle")


@dataclass
class EagleTrainConfig(TrainConfig):
    kind: ClassVar[str] = "eagle"
    drafter: EagleConfig = field(default_factory=EagleConfig)
    # Offline training: a folder written by scripts/dump_hidden_states.py for this config's target
    # and data; the target's forward then leaves the loop. None: run the target online.
    hidden_cache: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_sharding != "none" and self.hidden_cache:
            raise ConfigError(
                "target_sharding shards the target for online training, and hidden_cache trains "
                "offline, where no target forward runs: drop one of them",
                key="target_sharding",
            )


def layers_read(cfg: EagleConfig, target) -> list[int]:
    """The target hidden states the head reads (what scripts/dump_hidden_states.py caches)."""
    return EagleDrafter.capture_layers_for(eagle.resolve_config(cfg, target), target)


def build_head(cfg: EagleConfig, target, train_examples, cls=EagleDrafter) -> EagleDrafter:
    """The head (of `cls`: EagleDrafter, or a kind built on it), with its draft vocabulary
    counted from the training data (eagle3)."""
    cfg = cls.resolve(cfg, target)
    d2t = None
    if cfg.version == "eagle3" and 0 < cfg.draft_vocab_size < target.vocab_size:
        eos = eos_ids(target.model, target.tokenizer)
        d2t = build_draft_vocab(train_examples, cfg.draft_vocab_size, target.vocab_size, always=eos)
    return cls.build(cfg, target, d2t)


def head_summary(head: EagleDrafter) -> str:
    hc = head.config
    return (
        f"{hc.version} head, training-time test {hc.ttt_steps} steps, "
        f"draft vocab {head.draft_vocab_size}"
    )


def copied_its_lm_head(head: EagleDrafter) -> bool:
    """An EAGLE-3 head copied its draft vocabulary's rows of the target's LM head when it was
    built and never reads the target's again."""
    return head.config.version == "eagle3"


def run(
    cfg: EagleTrainConfig,
    build=build_head,
    describe=head_summary,
    release_lm_head=copied_its_lm_head,
) -> TrainResult:
    """Set up, train and report one run of `cfg`: what `main` does once the command line is
    read, and what scripts/compare.py calls. Raises SetupError before training for missing
    data, a bad target, bad layer ids or vocabulary size. A kind trained the same way, on the
    target's hidden states (kinds/peagle/peagle_trainer.py, kinds/dflash/dflash_trainer.py), gives its own `build(drafter
    config, target, train examples)`, `describe(head)` (the line printed before training) and
    `release_lm_head(head)` (whether a sharded run may let the head's copy of the LM head go)."""
    with setting_up():
        # offline, the target's hidden states come from the cache, and sharded, from its
        # partitioned forward: the head's own copy of the target reads only its embedding and
        # LM head, on every process (the decoder layers stay on the meta device)
        target, features = frozen_targets(
            cfg.target,
            dtype=cfg.target_dtype(),
            sharding=cfg.target_sharding,
            reads_weights=True,
            offline=bool(cfg.hidden_cache),
        )
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # the head's random init; identical on every process
        head = build(cfg.drafter, target, train_examples)
        if cfg.target_sharding != "none" and release_lm_head(head):
            # the sharded target computes the logits, and the head reads no more of the copy's
            target.release_lm_head()
        if cfg.hidden_cache:  # offline: hidden states and p come from the cache
            cache = HiddenStateCache(
                cfg.hidden_cache, target, [*train_examples, *eval_examples], head.capture_layers
            )
            features = CachedTarget(target, cache)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        warn_the_loop_loads_the_whole_target(cfg, prompts)
    cfg.drafter = head.config  # the resolved layers and steps go into train_config.yaml
    print(summary.format(), file=sys.stderr)
    print(
        f"[specdraft] {describe(head)}: {head.num_extra_parameters(target) / 1e6:.2f}M "
        f"parameters (target {target.num_parameters() / 1e6:.2f}M), features from "
        f"layers {head.capture_layers}",
        file=sys.stderr,
    )
    result = train(
        cfg, head, features, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    with whole_model_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        features = None  # a sharded target's or the cache's memory goes before the whole one
        report_after_training(target, result, prompts, cfg)
    return result
