"""What a batch does to speculation's economics on this machine: plain decoding's throughput, the
cost of verifying a draft, and the cost of drafting, against batch size.

    python benchmarks/bench_batch.py                       # as in BENCHMARKS.md
    python benchmarks/bench_batch.py --batch-sizes 1,4,16 --gammas 3 --repeats 1

Speculation pays where tau (tokens per target pass) exceeds what a verification pass of gamma + 1
tokens per row costs over a plain pass of one, plus the drafting. At batch 1 a pass is memory-
bound and verifying gamma + 1 tokens costs little more than one; as the batch grows the pass
becomes compute-bound and verification costs up to gamma + 1 plain passes. So this measures:

- `plain`: plain decoding through the loop (generate, no drafter) of a batch of prompts of
  different lengths: new tokens per second, and its ratio to batch 1;
- `verify`: one verification forward of B rows x (gamma + 1) tokens after a context of
  `--context` tokens, over a plain step's forward of B rows x 1 token: the tau at which a drafter
  that costs nothing breaks even (above it speculation wins; a real drafter needs more);
- `drafting`: drafting seconds per loop step at each batch size, for the demo configs' two-model
  student (one layer seeded from the target), Medusa heads, EAGLE-3 head and DFlash drafter,
  through the kind's session drafting the rows together (one drafter pass per depth for the
  batch; DFlash: one block pass) and row by row (batch_drafting=rows: one session per row).

The target: random weights of the demo target's shape (vocab 4,096, hidden 256, 8 layers, 4
heads, MLP 688), fp32 (`--dtype` otherwise); time does not depend on the weights' values, so the
benchmark needs no build of the demo target (about 32 minutes). Every figure is a ratio measured side by side
in this one process after a warm-up, the methods taking turns per repeat; the medians are
reported. No trained drafter is involved, so nothing here is a speedup: `scripts/evaluate.py
--batch-sizes` measures those on a trained drafter.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from specdraft.core import eos_ids
from specdraft.drafters.base import Drafter
from specdraft.inference.generate import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.distill.distill import DistillConfig, DistillDrafter, build_student
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.targets.target import Target


class _Vocab:
    """Just enough tokenizer for Target's fingerprint."""

    def __init__(self, n: int) -> None:
        self.vocab = {str(i): i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab


def demo_shaped_target(dtype: torch.dtype) -> Target:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=688, max_position_embeddings=2048,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None  # every row runs to max_new_tokens
    return Target(model, _Vocab(4096), name="demo-shaped-random")


def drafters(target: Target) -> dict[str, Drafter]:
    """The demo configs' two-model student (configs/distill/demo.yaml: one layer seeded from the
    target), Medusa heads (configs/medusa/demo.yaml), EAGLE-3 head (configs/eagle/demo.yaml) and
    DFlash drafter (configs/dflash/demo.yaml: one layer, blocks of 8), untrained."""
    student = build_student(DistillConfig(init="target", num_layers=1), target).eval()
    medusa = MedusaDrafter.build(
        MedusaConfig(num_heads=4, num_layers=1, output="own", loss="kl"), target
    ).eval()
    eagle = EagleDrafter.build(
        EagleConfig(draft_vocab_size=2048, ttt_steps=3, norm_before_residual=True), target
    ).eval()
    dflash = DFlashDrafter.build(
        DFlashConfig(num_layers=1, block_size=8, anchors=32), target
    ).eval()
    return {"distill": DistillDrafter(student), "medusa": medusa, "eagle3": eagle, "dflash": dflash}


def prompts(batch: int, generator: torch.Generator) -> list[list[int]]:
    """`batch` prompts of 16 to 47 tokens."""
    lengths = torch.randint(16, 48, (batch,), generator=generator).tolist()
    return [torch.randint(1, 4096, (n,), generator=generator).tolist() for n in lengths]


def time_plain(target: Target, batch: int, new: int, generator) -> float:
    """New tokens per second of plain batched decoding."""
    out = generate(target, prompts(batch, generator), max_new_tokens=new)
    return out.stats.tokens_per_s


def time_verify(
    target: Target, batch: int, gamma: int, context: int, generator, passes: int = 10
) -> float:
    """Mean seconds of a forward of batch x (gamma + 1) tokens after `context` cached ones (the
    cache cropped back after each of `passes` forwards, as a rejected draft is)."""
    ids = torch.randint(1, 4096, (batch, context + gamma + 1), generator=generator)
    cache = DynamicCache()
    with torch.no_grad():
        target.model(input_ids=ids[:, :context], cache=cache, use_cache=True)
        start = time.perf_counter()
        for _ in range(passes):
            target.model(input_ids=ids[:, context:], cache=cache, use_cache=True, logits_to_keep=0)
            cache.crop(-(gamma + 1))
        return (time.perf_counter() - start) / passes


def time_drafting(target: Target, drafter: Drafter, batch: int, rowwise: bool, new: int, gen):
    """Drafting seconds per loop step (the batch's), the rows drafted together by the kind's
    session or row by row (batch_drafting=rows)."""
    out = generate(
        target, prompts(batch, gen), drafter, max_new_tokens=new, gamma=4,
        batch_drafting="rows" if rowwise else "batch",
    )  # fmt: skip
    steps = max(s.target_passes for s in out.row_stats)
    return out.stats.draft_seconds / steps


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument(
        "--gammas", default="2,4,8", help="draft depths whose verification is timed"
    )
    parser.add_argument(
        "--context", type=int, default=256, help="cached tokens before a verification"
    )
    parser.add_argument("--new", type=int, default=32, help="new tokens per row when decoding")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--skip", action="append", default=[], choices=["plain", "verify", "drafting"]
    )
    parser.add_argument("--output", type=Path, help="also write the figures to this JSON file")
    args = parser.parse_args(argv)
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.gammas = [int(g) for g in args.gammas.split(",")]
    except ValueError:
        parser.error("--batch-sizes and --gammas take comma-separated integers, e.g. 1,2,4")
    if min(args.batch_sizes) < 1 or min(args.gammas) < 1:
        parser.error("--batch-sizes and --gammas must be >= 1")
    for name in ("context", "new", "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    target = demo_shaped_target(getattr(torch, args.dtype))
    assert not eos_ids(target.model)
    gen = torch.Generator().manual_seed(0)
    sizes = args.batch_sizes
    figures: dict = {"dtype": args.dtype, "batch_sizes": sizes}
    if "plain" not in args.skip:
        time_plain(target, max(sizes), 4, gen)  # warm-up
        runs = {b: [] for b in sizes}
        for _ in range(args.repeats):
            for b in sizes:
                runs[b].append(time_plain(target, b, args.new, gen))
        tps = {b: statistics.median(v) for b, v in runs.items()}
        figures["plain"] = {b: {"tokens_per_s": tps[b], "vs_batch_1": tps[b] / tps[sizes[0]]}
                            for b in sizes}  # fmt: skip
        print("plain decoding: tokens/s relative to batch", sizes[0])
        for b in sizes:
            print(f"  batch {b:3d}: {tps[b] / tps[sizes[0]]:6.2f}x")
    if "verify" not in args.skip:
        costs = {}
        for b in sizes:
            time_verify(target, b, max(args.gammas), args.context, gen)  # warm-up
            runs = {g: [] for g in [0, *args.gammas]}
            for _ in range(args.repeats):
                for g in runs:
                    runs[g].append(time_verify(target, b, g, args.context, gen))
            one = statistics.median(runs[0])
            costs[b] = {g: statistics.median(runs[g]) / one for g in args.gammas}
        figures["verify"] = costs
        print(
            f"verification of gamma + 1 tokens per row over a plain step (context {args.context})"
        )
        print("  batch  " + "".join(f"  gamma {g:<3d}" for g in args.gammas))
        for b in sizes:
            print(f"  {b:5d}  " + "".join(f"  {costs[b][g]:8.2f}" for g in args.gammas))
    if "drafting" not in args.skip:
        figures["drafting"] = {}
        for kind, drafter in drafters(target).items():
            time_drafting(target, drafter, max(sizes), False, 4, gen)  # warm-up
            per = {}
            for b in sizes:
                runs = {False: [], True: []}
                for _ in range(args.repeats):
                    for rowwise in runs:
                        runs[rowwise].append(
                            time_drafting(target, drafter, b, rowwise, args.new, gen)
                        )
                native, rows = (statistics.median(runs[k]) for k in (False, True))
                per[b] = {"batch_session_s": native, "row_by_row_s": rows, "ratio": rows / native}
            figures["drafting"][kind] = per
            print(f"drafting seconds per step, {kind}: row by row over the batch session")
            for b in sizes:
                print(f"  batch {b:3d}: {per[b]['ratio']:6.2f}x")
    if args.output:
        args.output.write_text(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
