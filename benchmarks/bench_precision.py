"""bf16 against fp32 on this CPU: what `precision: auto` (specdraft/precision.py) decides on.

    python benchmarks/bench_precision.py                 # the figures in BENCHMARKS.md, "Precision"
    python benchmarks/bench_precision.py --repeats 5 --shape 512x4x1408

Random weights (time does not depend on their values), in this one process; each figure is the
median of --repeats after a warm-up, fp32 timed first, then bf16. Three measurements:

- a matrix product, 4096x512 @ 512x1408 (GFLOP/s);
- a Llama of each --shape (hidden x layers x MLP, 4 heads, a 4,096-token vocabulary: the demo
  target's is 256x8x688): one training step of 8 x 512 tokens (forward, backward, AdamW), fp32
  weights against bf16 autocast, as the trainer runs `mixed_precision: bf16` (tokens/s);
- the same Llama decoding: one forward over 1, 8 and 64 new tokens after a 150-token cache,
  fp32 weights against bf16 weights (ms).

It prints the CPU's model and whether its bf16 is native (AVX-512 BF16 or AMX), and a markdown
table; --output writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdraft.precision import cpu_flags, native_bf16

VOCAB = 4096
MATMUL = (4096, 512, 1408)  # (m, k, n): an MLP-sized product
TRAIN_BATCH = (8, 512)  # rows x tokens of a training step
PREFIX = 150  # the cache a decoding forward runs after
NEW_TOKENS = (1, 8, 64)


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_gflops(dtype: torch.dtype, repeats: int) -> float:
    m, k, n = MATMUL
    a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
    return 2 * m * k * n / median_seconds(lambda: a @ b, repeats) / 1e9


def llama(shape: str) -> LlamaForCausalLM:
    hidden, layers, mlp = (int(x) for x in shape.split("x"))
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=mlp,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def train_tokens_per_s(shape: str, bf16: bool, repeats: int) -> float:
    model = llama(shape).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, TRAIN_BATCH)

    def step():
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return ids.numel() / median_seconds(step, repeats)


@torch.no_grad()
def forward_ms(shape: str, dtype: torch.dtype, new: int, repeats: int) -> float:
    model = llama(shape).to(dtype).eval()
    prefix = torch.randint(0, VOCAB, (1, PREFIX))
    cache = DynamicCache(config=model.config)
    model(input_ids=prefix, cache=cache, use_cache=True)
    ids = torch.randint(0, VOCAB, (1, new))

    def forward():
        model(input_ids=ids, cache=cache, use_cache=True)
        cache.crop(-new)  # the next repeat sees the same cache

    return 1000 * median_seconds(forward, repeats)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags = sorted(cpu_flags() & {"avx2", "avx512f", "avx512_bf16", "amx_bf16"})
    print(f"CPU: {cpu_model()} ({' '.join(flags)}), {torch.get_num_threads()} threads; "
          f"native bf16: {native_bf16('cpu')}")  # fmt: skip
    m, k, n = MATMUL
    rows = [(f"{m}x{k} @ {k}x{n} matmul (GFLOP/s)",
             matmul_gflops(torch.float32, args.repeats), matmul_gflops(torch.bfloat16, args.repeats))]  # fmt: skip
    for shape in args.shape:
        rows.append((
            f"training step, {shape}, {TRAIN_BATCH[0]} x {TRAIN_BATCH[1]} tokens (tokens/s)",
            train_tokens_per_s(shape, False, args.train_repeats),
            train_tokens_per_s(shape, True, args.train_repeats),
        ))  # fmt: skip
        for new in NEW_TOKENS:
            rows.append((
                f"forward, {shape}, {new} new token(s) after {PREFIX} (ms)",
                forward_ms(shape, torch.float32, new, args.repeats),
                forward_ms(shape, torch.bfloat16, new, args.repeats),
            ))  # fmt: skip
    print(
        "\n| what (median) | fp32 | bf16 | bf16's speed over fp32's |\n| --- | ---: | ---: | ---: |"
    )
    for what, fp32, bf16 in rows:
        speed = fp32 / bf16 if what.endswith("(ms)") else bf16 / fp32  # a time, or a rate
        print(f"| {what} | {fp32:,.1f} | {bf16:,.1f} | {speed:.2f}x |")
    if args.output:
        out = [{"what": w, "fp32": a, "bf16": b} for w, a, b in rows]
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--shape", action="append", default=None, metavar="HIDDENxLAYERSxMLP",
        help="a Llama shape to time (repeat); default: the demo target's, 256x8x688",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=20, help="repeats of a product or forward")
    p.add_argument("--train-repeats", type=int, default=3, help="repeats of a training step")
    p.add_argument("--output", default=None, help="write the figures to this JSON file")
    args = p.parse_args(argv)
    if args.output and not Path(args.output).resolve().parent.is_dir():
        p.error(f"--output {args.output}: its folder does not exist; create it first")
    args.shape = args.shape or ["256x8x688"]
    for shape in args.shape:
        parts = shape.split("x")
        if len(parts) != 3 or not all(x.isdigit() and int(x) > 0 for x in parts):
            p.error(f"--shape {shape!r}: give HIDDENxLAYERSxMLP, three positive integers")
        if int(parts[0]) % 8:
            p.error(f"--shape {shape!r}: the hidden size must divide into 4 heads of even size")
    if args.repeats < 1 or args.train_repeats < 1:
        p.error("--repeats and --train-repeats must be >= 1")
    return args


if __name__ == "__main__":
    raise SystemExit(main())
