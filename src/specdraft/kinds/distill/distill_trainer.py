"""Distil a small draft model from the target: `accelerate launch train/distill.py [key=value ...]`.

Defaults to configs/distill/demo.yaml (a student for SmolLM2-135M-Instruct, on a CPU); `--config
llama3-8b.yaml` picks a recipe beside it, `--help` lists every key. Setup, train, report:
train/beside_target.py, the student and its losses kinds/distill/distill.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import default_config
from specdraft.kinds.distill.distill import DistillConfig, DistillDecode, DistillDrafter
from specdraft.train.beside_target import train_beside_target
from specdraft.train.train_config import TrainConfig
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("distill")


@dataclass
class DistillTrainConfig(TrainConfig):
    kind: ClassVar[str] = "distill"
    drafter: DistillConfig = field(default_factory=DistillConfig)
    decode: DistillDecode = field(default_factory=DistillDecode)


def student_summary(student: DistillDrafter, target) -> str:
    n_params = sum(p.numel() for p in student.parameters())
    return (
        f"student: {student.config.num_layers} layers, {n_params / 1e6:.2f}M parameters "
        f"(target {target.num_parameters() / 1e6:.2f}M)"
    )


def run(cfg: DistillTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (train/beside_target.py's recipe). Raises
    SetupError before training for missing data, a bad target or a student of another
    vocabulary."""
    # the student reads only the target's logits; sharded, the weights it is seeded with
    # (drafter.init=target) are gathered for it
    return train_beside_target(
        cfg,
        lambda drafter_cfg, target, _: DistillDrafter.build(drafter_cfg, target),
        student_summary,
        reads_weights=False,
    )
