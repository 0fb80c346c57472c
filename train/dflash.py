"""Train a DFlash drafter on the target's hidden states: `accelerate launch train/dflash.py [key=value ...]`.

Defaults to configs/dflash/demo.yaml (a one-layer DFlash drafter on the demo target, on a CPU in
minutes); `--config configs/dflash/qwen3-8b.yaml` picks a recipe, `--help` lists every key.
Setup, train, report: the loop is train/trainer.py, the drafter and its loss drafters/dflash.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdraft.config import ConfigError, parse_cli
from specdraft.data.dataset import build_datasets
from specdraft.drafters.dflash import DFlashConfig, DFlashDrafter
from specdraft.targets.frozen import frozen_targets
from specdraft.targets.hidden_cache import CachedTarget, HiddenStateCache
from specdraft.train.config import SetupError, TrainConfig, setting_up
from specdraft.train.launch import whole_model_loading
from specdraft.train.report import (
    loop_prompts,
    report_after_training,
    warn_the_loop_loads_the_whole_target,
)
from specdraft.train.trainer import TrainResult, train

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "dflash" / "demo.yaml"


@dataclass
class DFlashTrainConfig(TrainConfig):
    kind: ClassVar[str] = "dflash"
    drafter: DFlashConfig = field(default_factory=DFlashConfig)
    # Offline training: a folder written by scripts/dump_hidden_states.py for this config's target
    # and data (its layers: the drafter's aux_layers); the target's forward then leaves the loop.
    # None: run the target online.
    hidden_cache: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_sharding != "none" and self.hidden_cache:
            raise ConfigError(
                "target_sharding shards the target for online training, and hidden_cache trains "
                "offline, where no target forward runs: drop one of them",
                key="target_sharding",
            )


def run(cfg: DFlashTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg`: what `main` does once the command line is
    read, and what scripts/compare.py calls. Raises SetupError before training for missing
    data, a bad target, bad layer ids or mask token."""
    with setting_up():
        # offline or sharded, the drafter's copy of the target holds only its embedding and LM
        # head, which it shares (the decoder layers stay on the meta device)
        target, features = frozen_targets(
            cfg.target,
            dtype=cfg.target_dtype(),
            sharding=cfg.target_sharding,
            reads_weights=True,
            offline=bool(cfg.hidden_cache),
        )
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # the drafter's random init; identical on every process
        drafter = DFlashDrafter.build(cfg.drafter, target)
        if cfg.hidden_cache:  # offline: hidden states and p come from the cache
            cache = HiddenStateCache(
                cfg.hidden_cache, target, [*train_examples, *eval_examples], drafter.capture_layers
            )
            features = CachedTarget(target, cache)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        warn_the_loop_loads_the_whole_target(cfg, prompts)
    cfg.drafter = drafter.config  # the resolved layers and mask token go into train_config.yaml
    print(summary.format(), file=sys.stderr)
    dc = drafter.config
    print(
        f"[specdraft] DFlash drafter: {dc.num_layers} layer(s), "
        f"{drafter.num_extra_parameters(target) / 1e6:.2f}M parameters (target "
        f"{target.num_parameters() / 1e6:.2f}M), features from layers {drafter.capture_layers}, "
        f"blocks of {dc.block_size} (mask token {dc.mask_token_id}), {dc.anchors} anchors a "
        "sequence",
        file=sys.stderr,
    )
    result = train(
        cfg, drafter, features, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    with whole_model_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        features = None  # a sharded target's or the cache's memory goes before the whole one
        report_after_training(target, result, prompts, cfg)
    return result


def main(argv: list[str] | None = None) -> int:
    prog = "train/dflash.py"
    cfg = parse_cli(
        DFlashTrainConfig, sys.argv[1:] if argv is None else argv, DEFAULT_CONFIG, prog=prog
    )
    try:
        run(cfg)
    except SetupError as e:  # missing data, bad target, bad layer ids or mask token
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
