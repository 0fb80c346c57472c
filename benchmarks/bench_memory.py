"""Peak memory of one training step of each drafter kind's loss at a large vocabulary, with the
loss's vocabulary-wide logits computed whole (loss_chunk_tokens=0) and a chunk of positions at a
time (specdraft/losses.py).

    python benchmarks/bench_memory.py --vocab 128256 --seq 2048
    python benchmarks/bench_memory.py --vocab 128256 --seq 8192 --json --kinds medusa layerskip

What runs: the target is a Llama of the given vocabulary with a small hidden size (64, two
layers) and random weights, so that the step fits and runs on a CPU and its memory is the loss's:
at hidden 64 the model's own activations are a few MB while one float32 copy of the logits of
8,192 positions over 128,256 tokens is 4.2 GB. Each kind's drafter is built at its defaults
(Medusa: 4 heads with their own output layers; LayerSkip: exits 1 and 2; two-model: a one-layer
student; EAGLE-3: a 32,000-token draft vocabulary and a training-time test of 7 steps), and one
training step runs as the trainer runs it: the target's forward (keeping only the last
position's logits where the drafter makes them from the final state itself), the drafter's
loss on one sequence of `--seq` tokens and its backward pass, in float32.

How memory is measured: each (kind, setting) runs in a process of its own, which builds the
target, the drafter and the batch, then reads its peak resident memory (getrusage ru_maxrss,
the high-water mark the kernel keeps) before and after the step: the figure is the growth of the
peak during the step, what the step needed above what was already held. The kernel counts
pages actually touched, not address space reserved; a fresh process per figure keeps one
setting's high-water mark from hiding another's. A process that goes over --limit-gib (an
address-space limit, so a setting too big for this machine fails instead of swapping or
taking the machine down) is reported as failed with the reason. Peak resident memory on a CPU
stands for what a GPU's allocator would have to hold: the same tensors live at the same time.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys

KINDS = ("medusa", "layerskip", "distill", "eagle", "dflash")
HIDDEN = 64
DRAFT_VOCAB = 32000  # EAGLE-3's reduced draft vocabulary (the speculators/SpecForge recipes')


class _Vocab:
    """A tokenizer stand-in: the fingerprint hashes a vocabulary, and there is none to read."""

    def __init__(self, n: int) -> None:
        self.vocab = {str(i): i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def build(kind: str, vocab: int, seq: int):
    """(the drafter of `kind`, the target, a one-sequence batch), seeded."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.targets.target import Target

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq + 16,
        tie_word_embeddings=False,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(config).eval(), _Vocab(vocab), name="bench")
    if kind == "medusa":
        from specdraft.kinds.medusa.medusa import MedusaDrafter
        from specdraft.kinds.medusa.medusa_config import MedusaConfig

        drafter = MedusaDrafter.build(MedusaConfig(), target)
    elif kind == "layerskip":
        from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDrafter

        drafter = LayerSkipDrafter.build(LayerSkipConfig(exit_layer=1, layer_dropout=0.0), target)
    elif kind == "distill":
        from specdraft.kinds.distill.distill import DistillConfig, DistillDrafter

        drafter = DistillDrafter.build(DistillConfig(init="random", num_layers=1), target)
    elif kind == "eagle":
        from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter

        draft = min(DRAFT_VOCAB, vocab)
        cfg = EagleConfig(version="eagle3", draft_vocab_size=draft, ttt_steps=7)
        drafter = EagleDrafter.build(cfg, target, torch.arange(draft))
    elif kind == "dflash":  # the Llama-3.1-8B recipe's blocks: 256 anchors x 15 scored slots
        from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter

        cfg = DFlashConfig(num_layers=1, block_size=16, anchors=256, mask_token_id=vocab - 1)
        drafter = DFlashDrafter.build(cfg, target)
    else:
        raise ValueError(f"unknown kind {kind!r}; use one of {', '.join(KINDS)}")
    ids = torch.randint(0, vocab, (1, seq))
    loss_mask = torch.ones_like(ids)
    loss_mask[:, : seq // 10] = 0  # a prompt without loss
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    if kind == "dflash":  # its anchors, drawn as the trainer's step draws them
        batch["example_index"] = torch.zeros(1, dtype=torch.long)
        batch = drafter.prepare_batch(batch, target, None, torch.Generator().manual_seed(0))
    return drafter.train(), target, batch


def step(drafter, target, batch) -> float:
    """One training step's loss and backward, as train/trainer.py runs it; the loss's value."""
    if drafter.runs_target:
        target_out = None
    else:
        layers, keep = list(drafter.capture_layers), 0
        if not drafter.reads_target_logits:
            layers += [] if target.num_layers in layers else [target.num_layers]
            keep = 1
        target_out = target.forward(
            batch["input_ids"], attention_mask=batch["attention_mask"], capture_layers=layers,
            logits_to_keep=keep,
        )  # fmt: skip
    loss, _ = drafter(batch, target_out)
    loss.backward()
    return float(loss.detach())


def measure(kind: str, vocab: int, seq: int, chunk: int) -> dict:
    """In this process: build, then the growth of the peak resident memory during one step."""
    import gc

    drafter, target, batch = build(kind, vocab, seq)
    drafter.loss_chunk_tokens = chunk
    gc.collect()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    loss = step(drafter, target, batch)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"peak_bytes": peak - before, "held_before_bytes": before, "loss": loss}


def run_one(kind: str, vocab: int, seq: int, chunk: int, limit_gib: float) -> dict:
    """`measure` in a fresh process under an address-space limit: its figures, or an error."""
    cmd = [sys.executable, __file__, "--one", kind, "--vocab", str(vocab), "--seq", str(seq),
           "--chunk", str(chunk), "--limit-gib", str(limit_gib)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        why = "killed (out of memory)" if proc.returncode == -9 else tail[0][-200:]
        return {"error": why}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=128256, help="target vocabulary size")
    parser.add_argument("--seq", type=int, default=2048, help="tokens in the one sequence")
    parser.add_argument(
        "--chunk", type=int, default=None,
        help="loss_chunk_tokens of the chunked runs (default: the trainer's default)",
    )  # fmt: skip
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument(
        "--limit-gib", type=float, default=20.0,
        help="address-space limit of each measuring process (GiB); over it a run fails",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="one JSON line per kind")
    parser.add_argument("--one", choices=KINDS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for key in ("vocab", "seq"):
        if getattr(args, key) < 4:
            parser.error(f"--{key} must be at least 4")
    if args.chunk is not None and args.chunk < (0 if args.one else 1):
        parser.error("--chunk must be >= 1 (the naive runs are the chunk-0 ones)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:  # a child: one measurement, as JSON
        limit = int(args.limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(measure(args.one, args.vocab, args.seq, args.chunk or 0)))
        return 0
    from specdraft.losses import DEFAULT_CHUNK_TOKENS

    chunk = args.chunk or DEFAULT_CHUNK_TOKENS
    for kind in args.kinds:
        naive = run_one(kind, args.vocab, args.seq, 0, args.limit_gib)
        chunked = run_one(kind, args.vocab, args.seq, chunk, args.limit_gib)
        row = {
            "kind": kind,
            "peak_bytes_naive": naive.get("peak_bytes"),
            "peak_bytes_chunked": chunked.get("peak_bytes"),
            "vocab": args.vocab,
            "seq": args.seq,
            "hidden": HIDDEN,
            "loss_chunk_tokens": chunk,
        }
        if row["peak_bytes_naive"] and row["peak_bytes_chunked"]:
            row["ratio"] = round(row["peak_bytes_naive"] / row["peak_bytes_chunked"], 2)
            row["loss_naive"], row["loss_chunked"] = naive["loss"], chunked["loss"]
        for name, result in (("naive", naive), ("chunked", chunked)):
            if "error" in result:
                row[f"error_{name}"] = result["error"]
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        figures = [
            f"{name} " + (f"{row[f'peak_bytes_{name}'] / 2**20:,.0f} MiB"
                          if row[f"peak_bytes_{name}"] is not None
                          else f"failed ({row[f'error_{name}']})")
            for name in ("naive", "chunked")
        ]  # fmt: skip
        ratio = f", {row['ratio']}x less" if "ratio" in row else ""
        print(
            f"{kind}: vocab {args.vocab}, {args.seq} tokens, peak step memory above the model: "
            f"{', '.join(figures)} (chunks of {chunk}){ratio}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
