"""Resident memory per process of a frozen target loaded whole against one sharded by ZeRO-3
(`target_sharding: zero3`), after loading and after forwards, on this machine's CPU processes.

    python benchmarks/bench_sharded_target.py --build /tmp/big --layers 40 --hidden 1024
    torchrun --nproc_per_node 2 benchmarks/bench_sharded_target.py /tmp/big --mode none
    torchrun --nproc_per_node 2 benchmarks/bench_sharded_target.py /tmp/big --mode zero3
    torchrun --nproc_per_node 2 benchmarks/bench_sharded_target.py /tmp/big --mode zero3 \\
        --max-live 2e7 --prefetch 0

--build writes a random Llama of the given depth and width (fp32, the demo tokenizer's 384-token
vocabulary, so the decoder layers are nearly all of it). Each process prints its resident
memory (VmRSS) and peak (VmHWM, reset after loading) in MiB: while and after loading, after three
forwards of 2 x 64 tokens, and after handing freed memory back to the OS (malloc_trim), which is
what the process holds: the CPU allocator keeps the buffers ZeRO-3 gathered weights into, so
plain RSS overstates it. --max-live and --prefetch set DeepSpeed's stage3_max_live_parameters
and stage3_prefetch_bucket_size (defaults 1e9 and 5e7 elements, tuned for GPUs).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys


def status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) // 1024
    return out


def trimmed() -> dict[str, int]:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return status()


def build(folder: str, layers: int, hidden: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdraft.targets.demo_target import ensure_demo_target

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_target(variant="tiny"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
        head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    print(f"{folder}: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, fp32")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", nargs="?", help="a model folder (see --build)")
    parser.add_argument("--mode", choices=("none", "zero3"), default="zero3")
    parser.add_argument("--max-live", type=float, help="stage3_max_live_parameters")
    parser.add_argument("--prefetch", type=float, help="stage3_prefetch_bucket_size")
    parser.add_argument("--build", metavar="FOLDER", help="write a random Llama there and stop")
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)
    if args.build:
        build(args.build, args.layers, args.hidden)
        return 0
    if not args.target:
        parser.error("pass a target folder (or --build FOLDER to write one)")

    import torch

    from specdraft.targets.sharded_target import load_sharded_target
    from specdraft.targets.target import load_target

    options = {}
    if args.max_live is not None:
        options["stage3_max_live_parameters"] = args.max_live
    if args.prefetch is not None:
        options["stage3_prefetch_bucket_size"] = args.prefetch
    if args.mode == "zero3":
        target = load_sharded_target(args.target, dtype="float32", zero_options=options)
    else:
        target = load_target(args.target, dtype=torch.float32)
    load_peak = status()["VmHWM"]
    loaded = trimmed()
    with open("/proc/self/clear_refs", "w") as f:  # the peak from here on
        f.write("5")
    ids = torch.randint(0, target.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    for _ in range(3):
        target.forward(ids, capture_layers=[2, target.num_layers // 2, target.num_layers - 3])
    forwards = status()
    row = {
        "mode": args.mode, "zero_options": options, "rank": int(os.environ.get("RANK", 0)),
        "load_peak": load_peak, "loaded_rss": loaded["VmRSS"], "forwards_peak": forwards["VmHWM"],
        "forwards_rss": forwards["VmRSS"], "held_rss": trimmed()["VmRSS"],
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
