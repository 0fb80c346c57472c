"""Train Medusa heads: `accelerate launch train/medusa.py [key=value ...]`.

Defaults to configs/medusa/demo.yaml (Medusa-1 heads on the frozen SmolLM2-135M-Instruct, on a
CPU); `--config medusa2-demo.yaml` co-trains the target through LoRA adapters (Medusa-2),
`--help` lists every key. Setup, train, report: train/beside_target.py, the heads, their loss
and their tree kinds/medusa/medusa.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import default_config
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig, MedusaDecode
from specdraft.train.beside_target import draft_vocab, train_beside_target
from specdraft.train.fine_tuned import finish_fine_tuning
from specdraft.train.train_config import TrainConfig
from specdraft.train.trainer import TrainResult

DEFAULT_CONFIG = default_config("medusa")


@dataclass
class MedusaTrainConfig(TrainConfig):
    kind: ClassVar[str] = "medusa"
    drafter: MedusaConfig = field(default_factory=MedusaConfig)
    decode: MedusaDecode = field(default_factory=MedusaDecode)
    # Medusa-2 (drafter.lora.rank > 0): after training, write the fine-tuned target with its
    # adapter merged to output_dir/target (a plain HF folder the heads decode with: evaluate.py
    # --target output_dir/target); off, only each checkpoint's adapter/ is written, which
    # load_target(BASE, adapter=...) merges at load time (what an 8B run wants: no copy).
    save_merged_target: bool = True


def build_heads(cfg: MedusaConfig, target, train_examples) -> MedusaDrafter:
    """The heads, with their draft vocabulary counted from the training data when reduced."""
    d2t = draft_vocab(train_examples, cfg.draft_vocab_size, target)
    return MedusaDrafter.build(cfg, target, d2t)


def heads_summary(heads: MedusaDrafter, target) -> str:
    hc = heads.config
    return (
        f"{hc.num_heads} Medusa heads x {hc.num_layers} block(s), output {hc.output}: "
        f"{heads.num_extra_parameters(target) / 1e6:.2f}M parameters (target "
        f"{target.num_parameters() / 1e6:.2f}M), draft vocab "
        f"{heads.draft_vocab_size}, loss {hc.loss} weighted {hc.loss_decay}^k"
    )


def run(cfg: MedusaTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg` (train/beside_target.py's recipe; sharded,
    Medusa-1 only, the heads read an embeddings-only copy of the target). Raises SetupError
    before training for missing data, a bad target or bad sizes."""

    def fine_tuned(heads: MedusaDrafter, target, eval_examples, prompts):
        if heads.peft is None:  # Medusa-1: the target as it was
            return target
        # Medusa-2: the fine-tuned target, its adapter merged as a user loads it
        return finish_fine_tuning(heads.peft, target, eval_examples, cfg, "Medusa-2", prompts)

    return train_beside_target(cfg, build_heads, heads_summary, finish=fine_tuned)
