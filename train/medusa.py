"""Train Medusa heads: `accelerate launch train/medusa.py [key=value ...]`.

Defaults to configs/medusa/demo.yaml (Medusa-1 heads on the frozen demo target, on a CPU in
minutes); `--config medusa2-demo.yaml` co-trains the target through LoRA adapters (Medusa-2),
`--help` lists every key. Setup, train, report: the loop is
train/trainer.py, the heads, their loss and their tree drafters/medusa.py.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from specdraft.config import parse_cli
from specdraft.core import build_draft_vocab, eos_ids
from specdraft.data.dataset import build_datasets
from specdraft.drafters.base import adapter_hash
from specdraft.drafters.checkpoint import save_target_folder
from specdraft.drafters.medusa import MedusaConfig, MedusaDrafter
from specdraft.drafters.target import Target, load_target, merge_adapter
from specdraft.inference.measure import loop_prompts, report_after_training
from specdraft.train.config import TrainConfig
from specdraft.train.trainer import collate, train

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "configs" / "medusa" / "demo.yaml"


@dataclass
class MedusaTrainConfig(TrainConfig):
    kind: ClassVar[str] = "medusa"
    drafter: MedusaConfig = field(default_factory=MedusaConfig)
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


def main(argv: list[str] | None = None) -> int:
    prog = "train/medusa.py"
    cfg = parse_cli(
        MedusaTrainConfig, sys.argv[1:] if argv is None else argv, DEFAULT_CONFIG, prog=prog
    )
    try:
        target = load_target(cfg.target, dtype=cfg.target_dtype())
        train_examples, eval_examples, summary = build_datasets(cfg.data, target.tokenizer)
        torch.manual_seed(cfg.seed)  # identical heads on every process
        heads = build_heads(cfg.drafter, target, train_examples)
        prompts = loop_prompts(cfg.eval_loop, cfg.data.path, target, eval_examples)
    except (ValueError, OSError) as e:  # missing data, bad target, bad sizes
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(summary.format(), file=sys.stderr)
    hc = heads.config
    print(
        f"[specdraft] {hc.num_heads} Medusa heads x {hc.num_layers} block(s), output {hc.output}: "
        f"{heads.num_extra_parameters(target) / 1e6:.2f}M parameters (target "
        f"{sum(p.numel() for p in target.model.parameters()) / 1e6:.2f}M), draft vocab "
        f"{heads.draft_vocab_size}, loss {hc.loss} weighted {hc.loss_decay}^k",
        file=sys.stderr,
    )
    result = train(
        cfg, heads, target, train_examples, eval_examples, tokenizer=target.tokenizer,
        provenance={"data_rows": summary.rows_kept, "data_examples": summary.train_examples},
    )  # fmt: skip
    if heads.peft is not None and result.main_process and not result.stopped_by_signal:
        target = finish_medusa2(heads, target, eval_examples, cfg)
    report_after_training(target, result, prompts, cfg)
    return 0


def finish_medusa2(heads: MedusaDrafter, target, eval_examples, cfg: MedusaTrainConfig):
    """After Medusa-2: report what the fine-tuning cost the target (held-out loss of the base
    and the fine-tuned target, in output_dir/target_quality.json), merge the adapter into the
    target the heads decode with, and save it (save_merged_target). Returns that target."""
    from peft.utils import get_peft_model_state_dict

    digest = adapter_hash(get_peft_model_state_dict(heads.peft))
    heads.eval()
    with heads.peft.disable_adapter():
        base = heldout_loss(target, eval_examples, cfg.micro_batch_size, cfg.eval_batches)
    tuned = heldout_loss(target, eval_examples, cfg.micro_batch_size, cfg.eval_batches)
    quality = {"base_loss": base, "fine_tuned_loss": tuned, "adapter": digest}
    out = Path(cfg.output_dir)
    (out / "target_quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    print(
        f"[specdraft] Medusa-2 fine-tuned the target: held-out loss {base:.4f} (base) -> "
        f"{tuned:.4f} (fine-tuned, adapter {digest})",
        file=sys.stderr,
    )
    # Merged from the saved adapter, as load_target(base, adapter=final/adapter) merges it, so
    # the target measured here is the one a user loads (also when training ran in bf16).
    base = heads.peft.unload()  # the adapters taken out, unmerged: the base is not needed after
    merged = merge_adapter(base, out / "final" / "adapter")
    tuned_target = Target(merged, target.tokenizer, name=f"{cfg.target}+adapter")
    if cfg.save_merged_target:
        save_target_folder(merged, target.tokenizer, out / "target")
        print(
            f"[specdraft] fine-tuned target (adapter merged) in {out / 'target'}", file=sys.stderr
        )
    return tuned_target


@torch.no_grad()
def heldout_loss(target, examples, batch_size: int, batches: int) -> float:
    """The target's mean next-token cross-entropy over the loss tokens of the first `batches`
    held-out micro-batches (0: all)."""
    n = len(examples) if not batches else min(len(examples), batches * batch_size)
    total = count = 0.0
    for start in range(0, n, batch_size):
        batch = collate(examples[start : min(n, start + batch_size)], target.device)
        logits = target.forward(batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        log_q = torch.log_softmax(logits[:, :-1].float(), dim=-1)
        nll = -log_q.gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        w = batch["loss_mask"][:, 1:].float()
        total += float((nll * w).sum())
        count += float(w.sum())
    return total / max(count, 1.0)


if __name__ == "__main__":
    sys.exit(main())
