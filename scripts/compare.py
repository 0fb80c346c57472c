"""The four drafting families side by side on one target: train, tune, measure, report.

    python scripts/compare.py                       # the demo target, every family, ~45 min
    python scripts/compare.py --folder eagle=runs/eagle-demo/final \\
        --folder layerskip=runs/layerskip-demo/final --families eagle,layerskip

Each family (distill: a two-model draft; eagle: an EAGLE-3 head; medusa: Medusa-1 heads;
layerskip: the target fine-tuned to draft with its first layers) trains with its demo config
and an equal budget of training tokens (--budget-tokens), each in its own process (its log in
OUTPUT/FAMILY.log; a family that fails is reported as failed and the others go on), unless
--folder gives one already trained. Each one's chain settings are then chosen by measured
tokens/s on this machine (--tune-prompts; 0 keeps the saved ones), and every family, plain
decoding, prompt lookup and transformers' assisted and early-exit generation decode the same
prompts in this one process, greedy and then at temperature 1. Writes OUTPUT/report.md (one
table, the best of each column in bold), report.json, frontier.png (speedup against extra
memory), tau_vs_speedup.png, acceptance.png and simulated_tau.png; --wandb PROJECT logs the
table and plots to W&B too.
"""

from __future__ import annotations

import argparse
import sys

from specdraft.train.compare import FAMILIES, check_families, compare


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        report = compare(args)
    except ValueError as e:  # a folder that is no drafter or another family's, bad prompts
        print(f"scripts/compare.py: error: {e}", file=sys.stderr)
        return 2
    from specdraft.train.compare import markdown

    print(markdown(report))
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="demo", help="demo, a model folder or a hub id")
    parser.add_argument("--families", default=",".join(FAMILIES), help="comma-separated")
    parser.add_argument(
        "--budget-tokens",
        type=int,
        default=1_000_000,
        help="training tokens per family (padded length), the same for each",
    )
    parser.add_argument(
        "--folder",
        action="append",
        default=[],
        metavar="FAMILY=FOLDER",
        help="take this family's drafter from a trained folder instead of training it",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FAMILY:KEY=VALUE",
        help="a training setting for one family, over its demo config",
    )
    parser.add_argument("--prompts", default="demo", help="demo, or a .txt/.json/.jsonl file")
    parser.add_argument("--num-prompts", type=int, default=20)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tune-prompts", type=int, default=4, help="0: no tuning")
    parser.add_argument("--no-sampled", dest="sampled", action="store_false",
                        help="greedy only (no measurement at temperature 1)")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: as saved)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default="runs/compare")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to W&B")
    args = parser.parse_args(argv)
    try:
        args.families = check_families([f for f in args.families.split(",") if f])
    except ValueError as e:
        parser.error(str(e))
    if args.budget_tokens < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        parser.error("--budget-tokens, --num-prompts and --max-new-tokens must be >= 1")
    if args.tune_prompts < 0:
        parser.error("--tune-prompts must be >= 0")
    folders = []
    for item in args.folder:
        family, sep, folder = item.partition("=")
        if not sep or family not in FAMILIES or not folder:
            parser.error(f"--folder {item!r}: expected FAMILY=FOLDER, FAMILY one of {FAMILIES}")
        folders.append((family, folder))
    args.folders = folders
    settings = []
    for item in args.set:
        family, sep, setting = item.partition(":")
        if not sep or family not in FAMILIES or "=" not in setting:
            parser.error(f"--set {item!r}: expected FAMILY:KEY=VALUE, FAMILY one of {FAMILIES}")
        settings.append((family, setting))
    args.set = settings
    # what evaluate.py's run builders read
    args.gamma = args.tree_top_k = None
    args.top_p, args.top_k, args.temperature = 1.0, 0, 0.0
    args.drafter, args.baselines = [], "ar"
    return args


if __name__ == "__main__":
    sys.exit(main())
