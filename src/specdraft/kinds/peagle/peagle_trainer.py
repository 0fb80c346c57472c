"""Train a P-EAGLE head on the target's hidden states: `accelerate launch train/peagle.py [key=value ...]`.

Defaults to configs/peagle/demo.yaml (a P-EAGLE head for SmolLM2-135M-Instruct, on a CPU);
`--config configs/peagle/llama3.1-8b.yaml` picks a recipe, `--help` lists every key. The head
is EAGLE-3's, so setup, training and the report are kinds/eagle/eagle_trainer.py's `run` (online or from the
hidden-state cache, `hidden_cache`), given this kind's head; the head and its COD loss are
kinds/peagle/peagle.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from specdraft.config import default_config
from specdraft.kinds.eagle import eagle_trainer
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("peagle")


@dataclass
class PEagleTrainConfig(eagle_trainer.EagleTrainConfig):
    kind: ClassVar[str] = "peagle"
    drafter: PEagleConfig = field(default_factory=PEagleConfig)


# the target hidden states the head reads: EAGLE-3's feature layers
layers_read = eagle_trainer.layers_read


def head_summary(head: PEagleDrafter) -> str:
    c = head.config
    return (
        f"P-EAGLE head, {c.num_depths} tokens per forward, COD ratio {c.down_sample_ratio} "
        f"(floor {c.down_sample_ratio_min}), mask token {c.mask_token_id}, "
        f"draft vocab {head.draft_vocab_size}"
    )


def run(cfg: PEagleTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (kinds/eagle/eagle_trainer.py's `run` with a P-EAGLE head)."""
    return eagle_trainer.run(
        cfg, build=partial(eagle_trainer.build_head, cls=PEagleDrafter), describe=head_summary
    )
