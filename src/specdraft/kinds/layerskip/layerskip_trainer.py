"""Fine-tune the target for LayerSkip: `accelerate launch train/layerskip.py [key=value ...]`.

Defaults to configs/layerskip/demo.yaml (SmolLM2-135M-Instruct, fully fine-tuned on a CPU);
`--help` lists every key. The target itself trains (layer dropout and the early-exit loss,
kinds/layerskip/layerskip.py; drafter.lora.rank > 0 trains LoRA adapters instead), so every checkpoint
is a plain HF model folder that is its own target: `evaluate.py --target runs/layerskip-demo/final
--drafter runs/layerskip-demo/final`. Setup, train, report: the loop is train/trainer.py.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import ClassVar

from specdraft.config import default_config
from specdraft.data.dataset import build_datasets
from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDecode, LayerSkipDrafter
from specdraft.targets.target import load_target
from specdraft.train.after_training import loop_prompts
from specdraft.train.fine_tuned import exit_agreement, finish_layerskip, heldout_loss
from specdraft.train.launch import whole_model_loading
from specdraft.train.train_config import TrainConfig, setting_up
from specdraft.train.trainer import TrainResult, train

DEFAULT_CONFIG = default_config("layerskip")


@dataclass
class LayerSkipTrainConfig(TrainConfig):
    kind: ClassVar[str] = "layerskip"
    drafter: LayerSkipConfig = field(default_factory=LayerSkipConfig)
    decode: LayerSkipDecode = field(default_factory=LayerSkipDecode)


def run(cfg: LayerSkipTrainConfig) -> TrainResult:
    """Set up, train and report one run of `cfg`: what `main` does once the command line is
    read, and what scripts/compare.py calls. Raises SetupError before training for missing data, a
    bad target or bad layer counts."""
    with setting_up():
        # the weights train: fp32 master weights (mixed_precision autocasts the products)
        dtype = "float32" if cfg.dtype == "auto" else cfg.dtype
        target = load_target(cfg.target, dtype=dtype)
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        drafter = LayerSkipDrafter.build(cfg.drafter, target)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
    print(summary.format(), file=sys.stderr)
    dc, layers = drafter.config, drafter.num_layers
    trained = sum(p.numel() for p in drafter.parameters() if p.requires_grad)
    print(
        f"[specdraft] LayerSkip: draft with layers 1-{dc.exit_layer} of {layers}, early-exit "
        f"loss after {dc.exits(layers)} ({dc.early_exit_scale}, curriculum {dc.curriculum}"
        + (f", {dc.exit_distill:g} against the final layer" if dc.exit_distill else "")
        + "), "
        f"layer dropout up to {dc.layer_dropout} ({dc.dropout_scale}); training "
        f"{trained / 1e6:.2f}M parameters ({'LoRA' if dc.lora.rank else 'full fine-tuning'})",
        file=sys.stderr,
    )
    held_out = (eval_examples, cfg.micro_batch_size, cfg.eval_batches)
    base_loss = heldout_loss(target, *held_out, chunk_tokens=cfg.loss_chunk_tokens)
    before = exit_agreement(drafter, *held_out)
    result = train(
        cfg, drafter, target, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    if not result.main_process or result.stopped_by_signal:
        return result
    as_saved = {"dtype": target.saved_dtype, "device": target.device}
    del target, drafter  # the trained model: the saved one is loaded as a user loads it
    with whole_model_loading():  # whole, also after a ZeRO-3 run
        finish_layerskip(cfg, result, as_saved, held_out, base_loss, before, prompts)
    return result
