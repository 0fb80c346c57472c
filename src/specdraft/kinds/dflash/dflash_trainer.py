"""Train a DFlash drafter on the target's hidden states: `accelerate launch train/dflash.py [key=value ...]`.

Defaults to configs/dflash/demo.yaml (a one-layer DFlash drafter for SmolLM2-135M-Instruct, on a
CPU); `--config configs/dflash/qwen3-8b.yaml` picks a recipe, `--help` lists every key.
Setup, training and the report are kinds/eagle/eagle_trainer.py's `run` (online or from the hidden-state cache,
`hidden_cache`), given this kind's drafter; the drafter and its loss are kinds/dflash/dflash.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import default_config
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter, resolve_config
from specdraft.kinds.eagle import eagle_trainer
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("dflash")


@dataclass
class DFlashTrainConfig(eagle_trainer.EagleTrainConfig):
    kind: ClassVar[str] = "dflash"
    drafter: DFlashConfig = field(default_factory=DFlashConfig)
    # hidden_cache (EagleTrainConfig's): a folder written by scripts/dump_hidden_states.py
    # --kind dflash, holding the drafter's aux_layers


def layers_read(cfg: DFlashConfig, target) -> list[int]:
    """The target hidden states the drafter reads (what scripts/dump_hidden_states.py caches)."""
    return resolve_config(cfg, target).aux_layers


def build_drafter(cfg: DFlashConfig, target, train_examples) -> DFlashDrafter:
    return DFlashDrafter.build(cfg, target)


def drafter_summary(drafter: DFlashDrafter) -> str:
    dc = drafter.config
    return (
        f"DFlash drafter, {dc.num_layers} layer(s), blocks of {dc.block_size} (mask token "
        f"{dc.mask_token_id}), {dc.anchors} anchors a sequence"
    )


def run(cfg: DFlashTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (kinds/eagle/eagle_trainer.py's `run` with a DFlash drafter,
    which shares the target's LM head, so a sharded run keeps it)."""
    return eagle_trainer.run(
        cfg, build=build_drafter, describe=drafter_summary, release_lm_head=lambda _: False
    )
