"""After training a drafter that fine-tunes its target (Medusa-2 through LoRA adapters,
`finish_fine_tuning`; LayerSkip, fully or through LoRA, `finish_layerskip`): say what the
fine-tuning cost the target (held-out loss, how often greedy continuations loop, LayerSkip's
per-exit agreement), and build or load the fine-tuned target the drafter decodes with, as a user
would load it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from specdraft.attention import target_inputs
from specdraft.core import LOOP_TOKENS, looping_share
from specdraft.formats.checkpoint import save_target_folder
from specdraft.inference.generate import generate
from specdraft.kinds.layerskip.layerskip import LayerSkipDrafter
from specdraft.losses import token_losses
from specdraft.targets.target import Target, load_target, merge_adapter, peft_hash
from specdraft.train.after_training import report_after_training
from specdraft.train.lr_schedule import collate


def finish_fine_tuning(
    peft_model, target: Target, eval_examples, cfg, what: str, prompts=()
) -> Target:
    """Report the held-out loss of the base (adapters off) and of the fine-tuned target, and
    how often their greedy continuations of `prompts` loop, in output_dir/target_quality.json.
    Then return the fine-tuned target, merged from the run's saved final/adapter as
    load_target(base, adapter=...) merges it (so the target measured after training is the one
    a user loads, also after a bf16 run), and save it to output_dir/target when
    cfg.save_merged_target. `peft_model` is `target`'s model with the
    adapters in; after this the base is gone from memory."""
    digest = peft_hash(peft_model)
    peft_model.eval()
    tokens = cfg.eval_loop.max_new_tokens
    held_out = (eval_examples, cfg.micro_batch_size, cfg.eval_batches, cfg.loss_chunk_tokens)
    with peft_model.disable_adapter():
        base = heldout_loss(target, *held_out)
        base_looping = greedy_looping(target, prompts, tokens)
    tuned = heldout_loss(target, *held_out)
    tuned_looping = greedy_looping(target, prompts, tokens)
    looping = looping_figures(base_looping, tuned_looping, prompts, tokens)
    write_quality(cfg.output_dir, base, tuned, digest, what, looping)
    out = Path(cfg.output_dir)
    plain = peft_model.unload()  # the adapters taken out, unmerged
    merged = merge_adapter(plain, out / "final" / "adapter")
    if cfg.save_merged_target:
        save_target_folder(merged, target.tokenizer, out / "target")
        print(
            f"[specdraft] fine-tuned target (adapter merged) in {out / 'target'}", file=sys.stderr
        )
    tuned = Target(merged, target.tokenizer, name=f"{cfg.target}+adapter")
    tuned.saved_dtype = target.saved_dtype  # the base's: what decoding "as saved" means
    return tuned


def write_quality(
    output_dir, base: float, tuned: float, digest: str, what: str, extra: dict | None = None
) -> None:
    """output_dir/target_quality.json (with `extra`'s keys) and one line: what fine-tuning cost
    the target."""
    quality = {"base_loss": base, "fine_tuned_loss": tuned, "adapter": digest, **(extra or {})}
    (Path(output_dir) / "target_quality.json").write_text(json.dumps(quality, indent=2) + "\n")
    print(
        f"[specdraft] {what} fine-tuned the target: held-out loss {base:.4f} (base) -> "
        f"{tuned:.4f} (fine-tuned, {digest})",
        file=sys.stderr,
    )


@torch.no_grad()
def greedy_looping(target: Target, prompts, max_new_tokens: int) -> float | None:
    """The share of `prompts` ((1, L) ids) whose plain greedy continuation of `max_new_tokens`
    tokens ends in a loop (specdraft.core.loops); None without prompts, or with continuations
    too short for the loop test to tell (LOOP_TOKENS)."""
    if not prompts or max_new_tokens < LOOP_TOKENS:
        return None
    outputs = [
        generate(target, ids, None, max_new_tokens=max_new_tokens).tokens[0].tolist()
        for ids in prompts
    ]
    return looping_share(outputs)


def looping_figures(base: float | None, tuned: float | None, prompts, max_new_tokens: int) -> dict:
    """target_quality.json's "greedy_looping" entry (empty without prompts), and one line saying
    what fine-tuning did to it: a loss that falls can hide generations that got worse."""
    if base is None or tuned is None:
        return {}
    print(
        f"[specdraft] greedy continuations that loop: {base:.0%} (base) -> {tuned:.0%} "
        f"(fine-tuned), {len(prompts)} prompts x {max_new_tokens} tokens",
        file=sys.stderr,
    )
    figures = {"base": base, "fine_tuned": tuned, "prompts": len(prompts)}
    return {"greedy_looping": {**figures, "max_new_tokens": max_new_tokens}}


@torch.no_grad()
def heldout_loss(
    target: Target, examples, batch_size: int, batches: int, chunk_tokens: int = 0
) -> float:
    """The target's mean next-token cross-entropy over the loss tokens of the first `batches`
    held-out micro-batches (0: all), from its final states and LM head `chunk_tokens` positions
    at a time (specdraft/losses.py; 0: all at once): its (batch, seq, vocab) logits are never
    made."""
    L = target.num_layers
    total = count = 0.0
    for batch in _heldout_batches(examples, batch_size, batches, target.device):
        out = target.forward(
            batch["input_ids"], **target_inputs(batch), capture_layers=[L], logits_to_keep=1
        )
        keep = batch["loss_mask"][:, 1:].bool()
        scored = token_losses(
            out.hidden_states[L][:, :-1][keep], target.lm_head,
            labels=batch["input_ids"][:, 1:][keep], chunk_tokens=chunk_tokens,
        )  # fmt: skip
        total += float(scored.ce.sum())
        count += float(keep.sum())
    return total / max(count, 1.0)


@torch.no_grad()
def exit_agreement(drafter, examples, batch_size: int, batches: int) -> dict[int, dict]:
    """A LayerSkip drafter's per-exit figures over the first `batches` held-out micro-batches
    (0: all): {exit: {"agreement": top-1 agreement with the final layer, "alpha": sampled
    acceptance}} for every candidate exit layer."""
    device = next(drafter.parameters()).device
    sums: dict[int, torch.Tensor] = {}
    for batch in _heldout_batches(examples, batch_size, batches, device):
        for e, figures in drafter.agreement_per_exit(batch).items():
            sums[e] = sums.get(e, 0) + figures.double().cpu()
    return {
        e: {"agreement": float(s[0] / max(s[2], 1)), "alpha": float(s[1] / max(s[2], 1))}
        for e, s in sums.items()
    }


def _heldout_batches(examples, batch_size: int, batches: int, device):
    """The first `batches` held-out micro-batches (0: all), collated on `device`."""
    n = len(examples) if not batches else min(len(examples), batches * batch_size)
    for start in range(0, n, batch_size):
        yield collate(examples[start : min(n, start + batch_size)], device)


def finish_layerskip(
    cfg, result, as_saved: dict, held_out, base_loss: float, before: dict, prompts
) -> None:
    """The end of a LayerSkip run (train/layerskip.py) on the main process: the fine-tuned model, as a user loads it, is both
    target and drafter from here on; report its quality (held-out loss, and how often greedy
    continuations loop, against the base), its exits, and its speed."""
    tokens = cfg.eval_loop.max_new_tokens
    base_looping = None  # the base as a user loads it, let go before the fine-tuned model loads
    if prompts and tokens >= LOOP_TOKENS:
        base_looping = greedy_looping(load_target(cfg.target, **as_saved), prompts, tokens)
    tuned = load_target(result.output_dir / "final", **as_saved)
    # "as saved" is the base's precision (a DeepSpeed bf16 run saves bf16 weights)
    tuned.saved_dtype = as_saved["dtype"]
    loss = heldout_loss(tuned, *held_out, chunk_tokens=cfg.loss_chunk_tokens)
    after = exit_agreement(LayerSkipDrafter(cfg.drafter, tuned.model), *held_out)
    print(exit_table(before, after, cfg.drafter.exit_layer), file=sys.stderr)
    extra = {"exit_agreement": {"before": before, "after": after}}
    tuned_looping = greedy_looping(tuned, prompts, tokens)
    extra |= looping_figures(base_looping, tuned_looping, prompts, tokens)
    write_quality(cfg.output_dir, base_loss, loss, tuned.fingerprint["adapter"], "LayerSkip", extra)
    report_after_training(tuned, result, prompts, cfg)


def exit_table(before: dict, after: dict, chosen: int) -> str:
    """The per-exit figures before and after training, one line per candidate exit layer."""
    lines = [
        "[specdraft] each exit layer against the final one, held-out "
        "(top-1 agreement, sampled acceptance alpha), before -> after training:"
    ]
    for e in sorted(after):
        b, a = before[e], after[e]
        mark = "  <- trained exit" if e == chosen else ""
        lines.append(
            f"  exit {e:>2}: agreement {b['agreement']:.3f} -> {a['agreement']:.3f}, "
            f"alpha {b['alpha']:.3f} -> {a['alpha']:.3f}{mark}"
        )
    return "\n".join(lines)
