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

from specdraft.measuring.evaluation import EvalSpec, parse_evaluate_args, runs_per_precision
from specdraft.measuring.evaluation_report import evaluation_report, make_report
from specdraft.measuring.measure import (
    choose_threads,
    measure_requests,
    read_bandwidth,
    read_requests,
)
from specdraft.measuring.report_writer import write_report
from specdraft.targets import load_target


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
    return parse_evaluate_args(__doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
