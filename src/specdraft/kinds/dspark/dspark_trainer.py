"""Train a DSpark drafter on the target's hidden states: `specdraft train dspark [key=value ...]`.

Defaults to configs/dspark/demo.yaml (a one-layer DSpark drafter for SmolLM2-135M-Instruct, on a
CPU); `--config configs/dspark/qwen3-8b.yaml` picks a recipe, `--help` lists every key. Setup,
training and the report are kinds/eagle/eagle_trainer.py's `run` (online or from the hidden-state
cache, `hidden_cache`, which scripts/dump_hidden_states.py --kind dspark writes), given this
kind's drafter; the drafter and its loss are kinds/dspark/dspark.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import default_config
from specdraft.kinds.dflash import dflash_trainer
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter
from specdraft.kinds.eagle import eagle_trainer
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("dspark")

# the target hidden states it reads: DFlash's aux_layers
layers_read = dflash_trainer.layers_read


@dataclass
class DSparkTrainConfig(eagle_trainer.EagleTrainConfig):
    kind: ClassVar[str] = "dspark"
    drafter: DSparkConfig = field(default_factory=DSparkConfig)


def build_drafter(cfg: DSparkConfig, target, train_examples) -> DSparkDrafter:
    return DSparkDrafter.build(cfg, target)


def drafter_summary(drafter: DSparkDrafter) -> str:
    dc = drafter.config
    heads = "a Markov head" + (" and a confidence head" if dc.enable_confidence_head else "")
    return (
        f"DSpark drafter, {dc.num_layers} layer(s), blocks of {dc.block_size} drafting "
        f"{drafter.drafts_per_block} (mask token {dc.mask_token_id}), {heads} of rank "
        f"{dc.markov_rank}, {dc.anchors} anchors a sequence"
    )


def run(cfg: DSparkTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (kinds/eagle/eagle_trainer.py's `run` with a
    DSpark drafter, which shares the target's LM head, so a sharded run keeps it)."""
    return eagle_trainer.run(
        cfg, build=build_drafter, describe=drafter_summary, release_lm_head=lambda _: False
    )
