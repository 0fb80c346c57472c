"""Training tokens per second on packed rows (data.pack) against padded ones, at equal results.

    python benchmarks/bench_packing.py                          # EAGLE-3 and Medusa-1, as in BENCHMARKS.md
    python benchmarks/bench_packing.py --kind medusa --conversations 64 --repeats 1

The data: `--conversations` chat rows cut from the demo corpus (data/stdlib_corpus.py,
`demo_conversations`: a function asked for by its signature, answered with its source), read
through `build_datasets` twice, padded and packed (`data.pack`), with the same seed: the same
conversations, cut to `--max-length` tokens. The target: random weights of the demo target's
shape (hidden 256, 8 layers, 4 heads, MLP 688) with the demo tokenizer (4,096 tokens) trained on
30 corpus files, in fp32; time does not depend on the weights' values, so the benchmark needs no
build of the demo target. The drafters: the demo configs' (configs/<kind>/demo.yaml), untrained.

What is timed is one optimizer step's work over all the conversations, as the trainer does it:
per micro-batch the target's forward, the drafter's loss and its backward, the loss divided by
the step's scored tokens. Padded: micro-batches of `--micro-batch` conversations in the data's
shuffled order, each padded to its longest; packed: the same conversations in rows of
`--max-length`, micro-batches of `--micro-batch` rows. The step's loss and gradients are the same
in both (checked here, as tests/train/test_packed_training.py checks them exactly), so equal results
are by construction; the optimizer's update, the same in both, is left out. The two take turns
after a warm-up, in this one process; tokens/s counts the conversations' tokens, not padding.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdraft.attention import target_inputs
from specdraft.data import DataConfig, build_datasets
from specdraft.data.stdlib_corpus import build_demo_tokenizer, demo_conversations, demo_corpus_texts
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.targets.target import Target
from specdraft.train.lr_schedule import collate

# The demo configs' drafters (configs/eagle/demo.yaml, configs/medusa/demo.yaml).
KINDS = {
    "eagle3": lambda target: EagleDrafter.build(
        EagleConfig(version="eagle3", draft_vocab_size=2048, ttt_steps=3, ttt_decay=0.8,
                    norm_before_residual=True), target),
    "medusa": lambda target: MedusaDrafter.build(
        MedusaConfig(num_heads=4, num_layers=1, output="own", loss="kl", loss_decay=0.8), target),
}  # fmt: skip
MODES = ("padded", "packed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--kind", action="append", choices=sorted(KINDS), help="(repeat; default: all)"
    )
    parser.add_argument("--conversations", type=int, default=256)
    parser.add_argument(
        "--max-length", type=int, default=256, help="data.max_length: a row's tokens"
    )
    parser.add_argument("--micro-batch", type=int, default=8, help="conversations or rows")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per mode, taking turns")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    for name in ("conversations", "max_length", "micro_batch", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    tok = build_demo_tokenizer(demo_corpus_texts()[:30], 4096)
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=256, num_hidden_layers=8, intermediate_size=688,
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(config).eval(), tok)
    data = {mode: _examples(args, tok, pack=mode == "packed") for mode in MODES}
    tokens = sum(len(e.input_ids) for e in data["padded"])
    assert tokens == sum(len(e.input_ids) for e in data["packed"])
    print(
        f"{len(data['padded'])} conversations, {tokens} tokens, packed into "
        f"{len(data['packed'])} rows of at most {args.max_length}; micro-batches of "
        f"{args.micro_batch}; {torch.get_num_threads()} threads",
        flush=True,
    )
    results = {}
    for kind in args.kind or sorted(KINDS):
        torch.manual_seed(0)
        drafter = KINDS[kind](target).train()
        batches = {
            mode: [
                collate(examples[i : i + args.micro_batch], "cpu")
                for i in range(0, len(examples), args.micro_batch)
            ]
            for mode, examples in data.items()
        }
        step = {mode: _step(drafter, target, batches[mode]) for mode in MODES}  # warm-up
        grad_gap = max(
            float((step["packed"][1][n] - g).abs().max() / g.abs().max().clamp(min=1e-30))
            for n, g in step["padded"][1].items()
        )
        seconds = dict.fromkeys(MODES, 0.0)
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                t0 = time.perf_counter()
                _step(drafter, target, batches[mode])
                seconds[mode] += time.perf_counter() - t0
        per_s = {mode: tokens * args.repeats / seconds[mode] for mode in MODES}
        results[kind] = {
            "tokens_per_s": per_s,
            "ratio": per_s["packed"] / per_s["padded"],
            "loss": {mode: step[mode][0] for mode in MODES},
            "max_relative_gradient_gap": grad_gap,
            "micro_batches": {mode: len(batches[mode]) for mode in MODES},
            "padded_tokens": {
                mode: int(sum(b["input_ids"].numel() for b in batches[mode])) for mode in MODES
            },
        }
        print(
            f"{kind}: padded {per_s['padded']:.0f} tok/s, packed {per_s['packed']:.0f} tok/s: "
            f"x{results[kind]['ratio']:.2f}; step loss {step['padded'][0]:.6f} vs "
            f"{step['packed'][0]:.6f}, gradients within {grad_gap:.1e}",
            flush=True,
        )
    if args.output:
        args.output.write_text(json.dumps({"args": _jsonable(args), "results": results}, indent=1))


def _examples(args: argparse.Namespace, tok, pack: bool):
    """The training examples of the demo conversations, padded or packed (no held-out split)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "demo-conversations.jsonl"
        rows = demo_conversations(args.conversations)
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        cfg = DataConfig(path=str(path), max_length=args.max_length, eval_fraction=0.0, pack=pack)
        examples, _, _ = build_datasets(cfg, tok)
    return examples


def _step(drafter, target, batches) -> tuple[float, dict[str, torch.Tensor]]:
    """One step's forwards and backwards over `batches`: (its token-mean loss, the gradients)."""
    drafter.zero_grad(set_to_none=True)
    total = sum(float(drafter.loss_tokens(b)) for b in batches)
    loss_sum = 0.0
    for batch in batches:
        out = target.forward(
            batch["input_ids"], **target_inputs(batch), capture_layers=drafter.capture_layers
        )
        loss, _ = drafter(batch, out)
        (loss / total).backward()
        loss_sum += float(loss.detach())
    grads = {n: p.grad for n, p in drafter.named_parameters() if p.grad is not None}
    return loss_sum / total, grads


def _jsonable(args: argparse.Namespace) -> dict:
    return {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}


if __name__ == "__main__":
    main()
