"""Train Medusa heads: `accelerate launch train/medusa.py [key=value ...]`.

Defaults to configs/medusa/demo.yaml (Medusa-1 heads on the frozen SmolLM2-135M-Instruct, on a
CPU); `--config medusa2-demo.yaml` co-trains the target through LoRA adapters (Medusa-2),
`--help` lists every key. Setup, train, report: the loop is
train/trainer.py, the heads, their loss and their tree kinds/medusa/medusa.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from specdraft.config import default_config
from specdraft.core import eos_ids
from specdraft.data.dataset import build_datasets
from specdraft.drafting import build_draft_vocab
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig, MedusaDecode
from specdraft.targets.frozen import frozen_targets
from specdraft.train.after_training import (
    loop_prompts,
    report_after_training,
    warn_the_loop_loads_the_whole_target,
)
from specdraft.train.fine_tuned import finish_fine_tuning
from specdraft.train.launch import whole_model_loading
from specdraft.train.train_config import TrainConfig, setting_up
from specdraft.train.trainer import TrainResult, train

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
    d2t = None
    if 0 < cfg.draft_vocab_size < target.vocab_size:
        eos = eos_ids(target.model, target.tokenizer)
        d2t = build_draft_vocab(train_examples, cfg.draft_vocab_size, target.vocab_size, always=eos)
    return MedusaDrafter.build(cfg, target, d2t)


def run(cfg: MedusaTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg`: what `main` does once the command line is
    read, and what scripts/compare.py calls. Raises SetupError before training for missing data, a
    bad target or bad sizes."""
    with setting_up():
        # sharded (Medusa-1 only), the heads read an embeddings-only copy of the target
        target, frozen = frozen_targets(
            cfg.target, dtype=cfg.target_dtype(), sharding=cfg.target_sharding, reads_weights=True
        )
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # identical heads on every process
        heads = build_heads(cfg.drafter, target, train_examples)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
        warn_the_loop_loads_the_whole_target(cfg, prompts)
    print(summary.format(), file=sys.stderr)
    hc = heads.config
    print(
        f"[specdraft] {hc.num_heads} Medusa heads x {hc.num_layers} block(s), output {hc.output}: "
        f"{heads.num_extra_parameters(target) / 1e6:.2f}M parameters (target "
        f"{target.num_parameters() / 1e6:.2f}M), draft vocab "
        f"{heads.draft_vocab_size}, loss {hc.loss} weighted {hc.loss_decay}^k",
        file=sys.stderr,
    )
    result = train(
        cfg, heads, frozen, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    if heads.peft is not None and result.main_process and not result.stopped_by_signal:
        target = finish_fine_tuning(heads.peft, target, eval_examples, cfg, "Medusa-2", prompts)
    with whole_model_loading():  # the saved drafter, loaded whole, also after a ZeRO-3 run
        frozen = None  # a sharded target's memory goes before the whole one
        report_after_training(target, result, prompts, cfg)
    return result
