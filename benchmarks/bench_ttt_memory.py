"""Peak memory of one EAGLE-3 training-time-test step (forward + backward of the unroll), with
the dense (S, (k + 1) S) attention mask against ttt_attention, which builds none.

    python benchmarks/bench_ttt_memory.py                       # S=2048, k=7, an 8B-shaped head
    python benchmarks/bench_ttt_memory.py --seq 1024 --steps 4 --dtype float32 --limit-gib 18

The head is EAGLE-3's over a target of Llama-3.1-8B's attention shape (hidden 4096, 32 query
and 8 key/value heads of 128) with random weights, sliced where attention memory does not
depend on it (MLP 1024 wide, a 4096-token vocabulary, 2 target layers) so that it fits and runs
on a CPU. Each variant runs in its own process (peak resident memory only grows), and the
figure is the peak during the step above the memory held before it. Variants: the dense mask
through SDPA as the CPU runs it (its flash kernel takes a mask, so the mask is the cost), the
dense mask through SDPA's math kernel (the scores materialised, as where a GPU's flash kernel
cannot take a mask), and ttt_attention.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def measure(seq: int, steps: int, dtype: str, variant: str) -> dict:
    import contextlib

    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
    from specdraft.targets.target import Target

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=4096, num_hidden_layers=2, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, intermediate_size=1024,
        max_position_embeddings=seq + steps + 8,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(getattr(torch, dtype)).eval()
    target = Target(model, _Vocab(4096))
    head = EagleDrafter.build(EagleConfig(version="eagle3", ttt_steps=steps), target)
    head = head.to(getattr(torch, dtype)).train()
    ids = torch.randint(0, 4096, (1, seq + 1))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    out = target.forward(ids, capture_layers=head.capture_layers)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux: KiB)
    # dense-math: the dense mask through SDPA's math kernel, which materialises the scores, as
    # a GPU's SDPA does where its flash kernel cannot take a mask
    kernel = sdpa_kernel(SDPBackend.MATH) if variant == "dense-math" else contextlib.nullcontext()
    start = time.perf_counter()
    with kernel:
        unrolled = head.unroll(batch, out, steps, dense=variant != "lean")
        sum(s["logits"].float().logsumexp(-1).mean() for s in unrolled).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"variant": variant, "peak_step_mib": peak - before, "seconds": seconds}


# dense: the (S, (k + 1) S) mask through the layer's SDPA attention (on a CPU its flash kernel
# takes the mask); dense-math: the same through SDPA's math kernel; lean: ttt_attention, no mask
VARIANTS = ("dense", "dense-math", "lean")


class _Vocab:
    def __init__(self, n: int) -> None:
        self.vocab = {str(i): i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--limit-gib", type=float, default=20.0,
        help="address-space limit of each variant's process (GiB); over it the variant fails",
    )  # fmt: skip
    parser.add_argument("--one", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:  # a child: one variant, its figures as JSON
        # over the limit an allocation fails: the variant is reported too big for the machine
        # instead of swapping it or waking the kernel's out-of-memory killer
        limit = int(args.limit_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        print(json.dumps(measure(args.seq, args.steps, args.dtype, args.one)))
        return
    for variant in VARIANTS:
        cmd = [sys.executable, __file__, "--seq", str(args.seq), "--steps", str(args.steps),
               "--dtype", args.dtype, "--limit-gib", str(args.limit_gib), "--one", variant]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            over = proc.returncode == -9 or "alloc" in proc.stderr or "MemoryError" in proc.stderr
            why = f"over the {args.limit_gib:g} GiB limit" if over else proc.stderr[-300:]
            print(f"S={args.seq} k={args.steps} {args.dtype} {variant}: failed ({why})", flush=True)
            continue
        result = json.loads(proc.stdout)
        print(
            f"S={args.seq} k={args.steps} {args.dtype} {variant}: peak {result['peak_step_mib']:.0f} "
            f"MiB above the model, {result['seconds']:.1f} s forward + backward",
            flush=True,
        )


if __name__ == "__main__":
    main()
