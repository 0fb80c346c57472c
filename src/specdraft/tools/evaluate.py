"""Measure drafters in specdraft's loop beside plain decoding and transformers' own methods.

    python scripts/evaluate.py --target smollm2-135m --drafter runs/eagle-demo/final \\
        --baselines ar,hf_ar,prompt_lookup,hf_assisted,hf_prompt_lookup \\
        --prompts mt-bench --num-prompts 8 --max-new-tokens 128 --temperature 0 --gamma 5 \\
        --output eval/demo

`--prompts mt-bench` (the default) measures MT-Bench's questions turn by turn, the second after
the target's own answer to the first, and report.md holds a table per category and per turn in
Spec-Bench's shape (categories as columns); `--prompts humaneval` the same for code.

Every method decodes the same prompts in this one process, after a warm-up, and new tokens are
counted the same way for all (up to and including the first EOS). Speedups are ratios to our own
plain decoding (`ar`, always run). Writes DIR/report.json, DIR/report.md and PNG plots
(acceptance per position, tau distribution, speedup with its draft/verify split), which name
each run by a short label (eagle#1, ...) that report.md and report.json key to its full name.
A lossy run (a Medusa drafter with acceptance=typical at temperature > 0) is labelled
"(lossy)", and its mean log p (the target's log-likelihood of its output) shows the drift.

Methods: `ar` (our loop, no drafter), `hf_ar` (transformers' generate), `prompt_lookup`, its
`hf_prompt_lookup`, each --drafter in our loop, `hf_assisted` (generate(assistant_model=...),
constant gamma) per two-model drafter, `hf_early_exit` (assistant_early_exit) per LayerSkip one.
`--dtype float32,bfloat16` measures every method in each precision, against the fastest plain.

`--batch-sizes 1,2,4,8,16` measures every method at each batch size (b prompts decoded together
per call, the methods taking turns per batch), each against plain decoding at the same batch
size: report.json has one run per method and batch size (its `batch_size`) and each method's
`crossover` (the smallest batch size where it is slower than plain decoding, or null);
report.md a table of speedup against batch size; batch_sizes.png tokens/s and speedup against
batch size. Every batch size decodes the same prompts, in whole batches: the first multiple of
every batch size (16 of 20 prompts for 1,2,4,8,16). Transformers' assisted methods decode one
sequence at a time, so they run at batch size 1 only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdraft.core import DecodeConfig
from specdraft.drafters.base import kinds_own_settings
from specdraft.measuring.evaluation import (
    BASELINES,
    HF_GAMMA,
    EvalSpec,
    default_target,
    parse_dtypes,
    runs_per_precision,
)
from specdraft.measuring.evaluation_report import evaluation_report, make_report
from specdraft.measuring.measure import (
    choose_threads,
    measure_requests,
    read_bandwidth,
    read_requests,
)
from specdraft.measuring.report_writer import write_report
from specdraft.targets import load_target
from specdraft.targets.target import DEFAULT_TARGET, TARGET_HELP
from specdraft.tools.arguments import (
    add_batch_sizes_argument,
    add_prompts_arguments,
    add_threads_argument,
    new_parser,
)


def main(argv: list[str] | None = None) -> int:
    args, spec = parse_args(argv)
    try:
        spec.check_prompts(args.target)  # before any model is loaded
    except ValueError as e:  # TargetError too
        raise SystemExit(f"scripts/evaluate.py: error: {e}") from None
    targets = [load_target(args.target, dtype=d, device=args.device) for d in args.dtypes]
    choose_threads(args.threads, targets[0], log=_log)
    try:
        requests = read_requests(spec.prompts, spec.num_prompts)
        requests = requests[: spec.prompts_measured(len(requests), f"--prompts {spec.prompts}")]
    except ValueError as e:
        raise SystemExit(f"--prompts: {e}") from None
    try:
        runs = runs_per_precision(spec, targets, loaded={})
    except ValueError as e:  # a bad --drafter: its folder, or a decoding setting
        raise SystemExit(str(e)) from None
    cases = measure_requests(runs, requests, targets[0], log=_log)
    bandwidth = read_bandwidth() if targets[0].device.type == "cpu" else None

    report = make_report(spec, targets, runs, bandwidth, cases=cases, requests=requests)
    report = evaluation_report(report, runs)
    write_report(report, Path(args.output), args.wandb)
    print(report.markdown)
    return 0


def _log(message: str) -> None:
    print(f"[evaluate] {message}", file=sys.stderr)


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, EvalSpec]:
    """scripts/evaluate.py's options, and what to measure as an EvalSpec; the precisions asked
    for in args.dtypes (parse_dtypes)."""
    parser = new_parser(__doc__)
    parser.add_argument(
        "--target",
        default=None,
        help=f"{TARGET_HELP} (default: the first --drafter folder's own, else {DEFAULT_TARGET})",
    )
    parser.add_argument(
        "--drafter",
        action="append",
        default=[],
        metavar="FOLDER[:KEY=VALUE,...]",
        help="a trained drafter (repeat; the same folder may come back with other settings): "
        "after a colon, decoding settings for this drafter only, over its saved defaults "
        "(every kind's: "
        + ", ".join(DecodeConfig.setting_names())
        + "; a kind's own: "
        + ", ".join(kinds_own_settings())
        + "; Medusa's acceptance=typical is lossy at temperature > 0 and marked so)",
    )
    parser.add_argument("--baselines", default=",".join(BASELINES))
    add_prompts_arguments(parser, EvalSpec.prompts, EvalSpec.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument(
        "--gamma",
        type=int,
        default=None,
        help="draft depth (chain length, tree depth) for every method; default: each drafter's "
        f"saved setting ({HF_GAMMA} for prompt lookup)",
    )
    parser.add_argument(
        "--tree-top-k",
        dest="tree_top_k",
        type=int,
        default=None,
        help="tree_top_k of every trained drafter: 1 drafts a chain, k > 1 a tree (EAGLE-2's "
        "dynamic tree expanding k nodes per level into k children each; Medusa, P-EAGLE and "
        "DFlash: the best paths through each position's k best candidates); default: each "
        "drafter's own",
    )
    parser.add_argument("--seed", type=int, default=0)
    add_batch_sizes_argument(
        parser,
        "measure every method at each of these batch sizes (comma-separated, e.g. "
        "1,2,4,8,16), each against plain decoding at the same batch size (default: 1)",
    )
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--dtype",
        default=None,
        help="float32, bfloat16, float16 or several (float32,bfloat16), for the target and "
        "drafters (default: as saved); bf16 on a CPU without native bf16 is emulated and slow",
    )
    add_threads_argument(parser)
    parser.add_argument("--output", required=True, help="folder for report.json/.md and plots")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to W&B")
    args = parser.parse_args(argv)
    try:
        spec = EvalSpec(
            drafters=args.drafter, baselines=args.baselines.split(","), prompts=args.prompts,
            num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, gamma=args.gamma,
            tree_top_k=args.tree_top_k, seed=args.seed, batch_sizes=args.batch_sizes,
        )  # fmt: skip
    except ValueError as e:
        parser.error(str(e))
    try:
        args.dtypes = parse_dtypes(args.dtype, args.device)
    except ValueError as e:
        parser.error(f"--dtype: {e}")
    try:
        args.target = args.target or default_target(args.drafter)
    except ValueError as e:  # the drafter's folder does not say: --target
        parser.error(str(e))
    return args, spec


if __name__ == "__main__":
    sys.exit(main())
