"""Train an EAGLE head on the target's hidden states: `accelerate launch train/eagle.py [key=value ...]`.

Defaults to configs/eagle/demo.yaml (an EAGLE-3 head on the demo target, on a CPU in minutes);
`--config configs/eagle/llama3.1-8b-eagle3.yaml` picks a recipe, `--help` lists every key.
Setup, train, report: the loop is train/trainer.py, the head and its loss drafters/eagle.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdraft.config import ConfigError, choice, parse_cli
from specdraft.core import build_draft_vocab, eos_ids
from specdraft.data.dataset import build_datasets
from specdraft.data.hidden_cache import CachedTarget, HiddenStateCache
from specdraft.drafters.eagle import EagleConfig, EagleDrafter, resolve_config
from specdraft.drafters.target import load_sharded_target, load_target
from specdraft.inference.measure import loop_prompts, report_after_training
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import plain_loading, train

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "eagle" / "demo.yaml"


@dataclass
class EagleTrainConfig(TrainConfig):
    kind: ClassVar[str] = "eagle"
    drafter: EagleConfig = field(default_factory=EagleConfig)
    # Offline training: a folder written by scripts/dump_hidden_states.py for this config's target
    # and data; the target's forward then leaves the loop. None: run the target online.
    hidden_cache: str | None = None
    # Online training against a target too big for one device: zero3 partitions the frozen
    # target over the processes (DeepSpeed ZeRO-3 inference; each holds 1/N of it and gathers a
    # layer's weights for its forward), none loads it whole on every process. The head, its
    # optimizer and its data parallelism are the launcher's business as always.
    target_sharding: str = choice("none", "zero3")

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.target_sharding != "none" and self.hidden_cache:
            raise ConfigError(
                "target_sharding shards the target for online training, and hidden_cache trains "
                "offline, where no target forward runs: drop one of them",
                key="target_sharding",
            )


def build_head(cfg: EagleConfig, target, train_examples) -> EagleDrafter:
    """The head, with its draft vocabulary counted from the training data (eagle3)."""
    cfg = resolve_config(cfg, target)
    d2t = None
    if cfg.version == "eagle3" and 0 < cfg.draft_vocab_size < target.vocab_size:
        eos = eos_ids(target.model, target.tokenizer)
        d2t = build_draft_vocab(train_examples, cfg.draft_vocab_size, target.vocab_size, always=eos)
    return EagleDrafter.build(cfg, target, d2t)


def main(argv: list[str] | None = None) -> int:
    prog = "train/eagle.py"
    cfg = parse_cli(
        EagleTrainConfig, sys.argv[1:] if argv is None else argv, DEFAULT_CONFIG, prog=prog
    )
    try:
        # offline, the target's hidden states come from the cache, and sharded, from its
        # partitioned forward: the head's own copy of the target reads only its embedding and
        # LM head, on every process (the decoder layers stay on the meta device)
        offline, sharded = bool(cfg.hidden_cache), cfg.target_sharding == "zero3"
        features = None
        if sharded:  # the forward runs partitioned; the head keeps the whole embedding, LM head
            features = load_sharded_target(cfg.target, dtype=cfg.target_dtype())
            held, total = features.parameters_held()
            print(
                f"[specdraft] target sharded by ZeRO-3 over {torch.distributed.get_world_size()} "
                f"process(es): this one holds {held / 1e6:.2f}M of its {total / 1e6:.2f}M "
                "parameters",
                file=sys.stderr,
            )
        target = load_target(
            cfg.target,
            dtype=cfg.target_dtype(),
            embeddings_only=offline or sharded,
            device=features.device if sharded else None,
        )
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # the head's random init; identical on every process
        head = build_head(cfg.drafter, target, train_examples)
        if cfg.hidden_cache:  # offline: hidden states and p come from the cache
            cache = HiddenStateCache(
                cfg.hidden_cache, target, [*train_examples, *eval_examples], head.capture_layers
            )
            features = CachedTarget(target, cache)
        if features is None:
            features = target
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        if sharded and prompts:
            print(
                "[specdraft] eval_loop is on: after training the main process loads the whole "
                "target on its device to decode with the head; for a target that does not fit "
                "one device set eval_loop.enabled=false (training and its checkpoints are "
                "unaffected)",
                file=sys.stderr,
            )
    except (ValueError, OSError) as e:  # missing data, bad target, bad layer ids or vocab size
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    cfg.drafter = head.config  # the resolved layers and steps go into train_config.yaml
    print(summary.format(), file=sys.stderr)
    hc = head.config
    print(
        f"[specdraft] {hc.version} head: {head.num_extra_parameters(target) / 1e6:.2f}M parameters "
        f"(target {sum(p.numel() for p in target.model.parameters()) / 1e6:.2f}M), features from "
        f"layers {head.capture_layers}, draft vocab {head.draft_vocab_size}, "
        f"training-time test {hc.ttt_steps} steps",
        file=sys.stderr,
    )
    result = train(
        cfg, head, features, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    with plain_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        if (
            (offline or sharded)
            and prompts
            and result.main_process
            and not result.stopped_by_signal
        ):
            device = target.device  # where the trainer placed the embedding: the GPU
            del features, target  # the embeddings-only stand-in
            target = load_target(cfg.target, dtype=cfg.target_dtype(), device=device)
        report_after_training(target, result, prompts, cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
