"""Resident memory of loading a target whole against only its embedding and LM head
(`load_target(embeddings_only=True)`, what EAGLE training from a hidden-state cache loads), in
the saved dtype and converted to fp32.

    python benchmarks/bench_target_load.py --build /tmp/big --layers 32 --hidden 1024 \\
        --vocab 128256 --shards 4
    python benchmarks/bench_target_load.py /tmp/big

--build writes a random Llama of the given depth, width and vocabulary in bf16, split into
about --shards weight files (the demo tokenizer beside it: loading needs one, nothing is tokenized).
Each load runs in its own process (a peak only grows) and reports the bytes of weights it
holds outside the meta device and the growth of its peak resident memory (VmHWM) over the load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

LOADS = (  # (embeddings_only, dtype): None keeps the saved dtype
    (False, None),
    (True, None),
    (False, "float32"),
    (True, "float32"),
)


def peak_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmHWM"))
    return int(line.split()[1]) / 1024


def build(folder: str, layers: int, hidden: int, vocab: int, shards: int) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from specdraft.targets.demo_target import ensure_demo_target

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_target(variant="tiny"))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
        num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=4,
        head_dim=64, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=f"{size // shards // 2**20 + 1}MB")
    tokenizer.save_pretrained(folder)
    files = len(list(Path(folder).glob("*.safetensors")))  # whole tensors: maybe one more
    print(f"{folder}: {size / 2**30:.2f} GiB of bf16 weights in {files} files")


def measure(folder: str, embeddings_only: bool, dtype: str | None) -> dict:
    import torch

    from specdraft.targets.target import load_target

    before = peak_mib()
    target = load_target(folder, embeddings_only=embeddings_only, dtype=dtype)
    held = sum(
        t.numel() * t.element_size()
        for t in [*target.model.parameters(), *target.model.buffers()]
        if t.device.type != "meta"
    )
    return {
        "embeddings_only": embeddings_only,
        "dtype": str(dtype or target.dtype).removeprefix("torch."),
        "weights_mib": held / 2**20,
        "peak_growth_mib": peak_mib() - before,
        "torch": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", nargs="?", help="a model folder (see --build)")
    parser.add_argument("--build", metavar="FOLDER", help="write a random Llama there and stop")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child: one load, as JSON
    args = parser.parse_args(argv)
    if args.build:
        build(args.build, args.layers, args.hidden, args.vocab, args.shards)
        return 0
    if not args.target:
        parser.error("give a model folder, or --build FOLDER to write one")
    if args.one:
        only, dtype = json.loads(args.one)
        print(json.dumps(measure(args.target, only, dtype)))
        return 0
    for only, dtype in LOADS:
        cmd = [sys.executable, __file__, args.target, "--one", json.dumps([only, dtype])]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            print(f"failed: {proc.stderr[-400:]}", file=sys.stderr)
            return 1
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        what = "embeddings only" if only else "whole target"
        print(
            f"{what}, {r['dtype']}: {r['weights_mib']:,.0f} MiB of weights held, peak resident "
            f"memory +{r['peak_growth_mib']:,.0f} MiB",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
