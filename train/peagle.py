"""Train a P-EAGLE head on the target's hidden states: `accelerate launch train/peagle.py [key=value ...]`.

Defaults to configs/peagle/demo.yaml (a P-EAGLE head for SmolLM2-135M-Instruct, on a CPU);
`--config configs/peagle/llama3.1-8b.yaml` picks a recipe, `--help` lists every key. The head
is EAGLE-3's, so setup, training and the report are train/eagle.py's `run` (online or from the
hidden-state cache, `hidden_cache`), given this kind's head; the head and its COD loss are
drafters/peagle.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

from specdraft.config import default_config, parse_cli
from specdraft.drafters.peagle import PEagleConfig, PEagleDrafter
from specdraft.train import eagle
from specdraft.train.config import SetupError
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("peagle")


@dataclass
class PEagleTrainConfig(eagle.EagleTrainConfig):
    kind: ClassVar[str] = "peagle"
    drafter: PEagleConfig = field(default_factory=PEagleConfig)


def head_summary(head: PEagleDrafter) -> str:
    c = head.config
    return (
        f"P-EAGLE head, {c.num_depths} tokens per forward, COD ratio {c.down_sample_ratio} "
        f"(floor {c.down_sample_ratio_min}), mask token {c.mask_token_id}, "
        f"draft vocab {head.draft_vocab_size}"
    )


def run(cfg: PEagleTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (train/eagle.py's `run` with a P-EAGLE head)."""
    return eagle.run(cfg, build=partial(eagle.build_head, cls=PEagleDrafter), describe=head_summary)


def main(argv: list[str] | None = None) -> int:
    prog = "train/peagle.py"
    cfg = parse_cli(
        PEagleTrainConfig, sys.argv[1:] if argv is None else argv, DEFAULT_CONFIG, prog=prog
    )
    try:
        run(cfg)
    except SetupError as e:  # missing data, bad target, bad layer ids, vocab size or mask token
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
