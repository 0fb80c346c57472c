"""Distil a small draft model from the target: `accelerate launch train/distill.py [key=value ...]`.

Defaults to configs/distill/demo.yaml (a student for SmolLM2-135M-Instruct, on a CPU); `--config
llama3-8b.yaml` picks a recipe beside it, `--help` lists every key. Setup, train, save: the loop
is train/trainer.py, the student and its losses kinds/distill/distill.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdraft.config import default_config
from specdraft.data.dataset import build_datasets
from specdraft.kinds.distill.distill import DistillConfig, DistillDecode, DistillDrafter
from specdraft.targets.frozen import frozen_targets
from specdraft.train.after_training import (
    loop_prompts,
    report_after_training,
    warn_the_loop_loads_the_whole_target,
)
from specdraft.train.launch import whole_model_loading
from specdraft.train.train_config import TrainConfig, setting_up
from specdraft.train.trainer import TrainResult, train

DEFAULT_CONFIG = default_config("distill")


@dataclass
class DistillTrainConfig(TrainConfig):
    kind: ClassVar[str] = "distill"
    drafter: DistillConfig = field(default_factory=DistillConfig)
    decode: DistillDecode = field(default_factory=DistillDecode)


def run(cfg: DistillTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg`: what `main` does once the command line is
    read, and what scripts/compare.py calls. Raises SetupError before training for missing data, a
    bad target or a student of another vocabulary."""
    with setting_up():
        # the student reads only the target's logits; sharded, the weights it is seeded with
        # (drafter.init=target) are gathered for it
        target, _ = frozen_targets(
            cfg.target, dtype=cfg.target_dtype(), sharding=cfg.target_sharding, reads_weights=False
        )
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # the student's random init; identical on every process
        drafter = DistillDrafter.build(cfg.drafter, target)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        warn_the_loop_loads_the_whole_target(cfg, prompts)
    print(summary.format(), file=sys.stderr)
    n_params = sum(p.numel() for p in drafter.parameters())
    print(
        f"[specdraft] student: {cfg.drafter.num_layers} layers, {n_params / 1e6:.2f}M parameters "
        f"(target {target.num_parameters() / 1e6:.2f}M)",
        file=sys.stderr,
    )
    result = train(
        cfg, drafter, target, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    with whole_model_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        report_after_training(target, result, prompts, cfg)
    return result
