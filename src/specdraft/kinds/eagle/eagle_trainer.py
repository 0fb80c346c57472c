"""Train an EAGLE head on the target's hidden states: `accelerate launch train/eagle.py [key=value ...]`.

Defaults to configs/eagle/demo.yaml (the main job: an EAGLE-3 head for SmolLM2-135M-Instruct, on a
CPU in about 15 minutes; SPECDRAFT_CONFIGS names another folder of defaults);
`--config configs/eagle/llama3.1-8b-eagle3.yaml` picks a recipe, `--help` lists every key.
Setup, train, report: train/beside_target.py, the head and its loss kinds/eagle/eagle.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import ConfigError, default_config
from specdraft.kinds.eagle import eagle
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.train.beside_target import draft_vocab, train_beside_target
from specdraft.train.train_config import TrainConfig
from specdraft.train.trainer import TrainResult

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
    size = cfg.draft_vocab_size if cfg.version == "eagle3" else 0  # eagle1: the whole vocabulary
    return cls.build(cfg, target, draft_vocab(train_examples, size, target))


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
    """Set up, train and report one run of `cfg` (train/beside_target.py's recipe, online or
    from the hidden-state cache). Raises SetupError before training for missing data, a bad
    target, bad layer ids or vocabulary size. A kind trained the same way, on the target's hidden
    states (P-EAGLE, DFlash, DSpark), gives its own `build(drafter config, target, train
    examples)`, `describe(head)` (the line printed before training) and `release_lm_head(head)`
    (whether a sharded run may let the head's copy of the LM head go)."""

    def line(head: EagleDrafter, target) -> str:
        return (
            f"{describe(head)}: {head.num_extra_parameters(target) / 1e6:.2f}M parameters "
            f"(target {target.num_parameters() / 1e6:.2f}M), features from layers "
            f"{head.capture_layers}"
        )

    return train_beside_target(
        cfg, build, line, hidden_cache=cfg.hidden_cache, release_lm_head=release_lm_head
    )
