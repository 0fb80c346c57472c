"""The drafting families side by side on one target: train, tune, measure, report.

    python scripts/compare.py --dtype bfloat16      # SmolLM2-135M-Instruct, every family
    python scripts/compare.py --folder eagle=runs/eagle-demo/final \\
        --folder layerskip=runs/layerskip-demo/final --families eagle,layerskip

A family is a drafter kind with a demo config, configs/KIND/demo.yaml (--help lists them: a
two-model draft, an EAGLE-3 head, Medusa-1 heads, the target fine-tuned for LayerSkip). Each
trains with that config and an equal budget of training tokens (--budget-tokens), one after another in this process through its trainer's
own function (what it prints goes to OUTPUT/FAMILY.log; a family whose training fails is
reported as failed and the others go on), unless --folder gives one already trained. Each one's
chain settings are then chosen by measured tokens/s on this machine (--tune-prompts; 0 keeps the
saved ones), and every family, plain decoding, prompt lookup and transformers' assisted and
early-exit generation decode the same prompts in this one process, greedy and then at
temperature 1. Writes OUTPUT/report.md (the family table, the best of each column in bold, then
every run's row), report.json, frontier.png (speedup against extra memory), tau_vs_speedup.png,
acceptance.png and simulated_tau.png; --wandb PROJECT logs the table and plots to W&B too.
--batch-sizes 1,2,4,8,16 measures every run at each batch size, as scripts/evaluate.py does: the
family table gains each family's crossover (the smallest batch size where it is slower than
plain decoding), report.md the speedup against batch size, and batch_sizes.png the greedy sweep.
"""

from __future__ import annotations

import sys

from specdraft.targets.target import DEFAULT_TARGET, TARGET_HELP
from specdraft.tools.arguments import add_batch_sizes_argument, add_prompts_arguments, new_parser
from specdraft.train.comparison import CompareSpec, compare, families


def main(argv: list[str] | None = None) -> int:
    spec = parse_args(argv)
    try:
        report = compare(spec)
    except ValueError as e:  # a folder that is no drafter or another family's, bad prompts
        print(f"scripts/compare.py: error: {e}", file=sys.stderr)
        return 2
    print(report.markdown)
    return 0


def parse_args(argv: list[str] | None) -> CompareSpec:
    parser = new_parser(__doc__)
    parser.add_argument(
        "--target",
        default=DEFAULT_TARGET,
        help=f"{TARGET_HELP} (default: {DEFAULT_TARGET}, the demo configs' target)",
    )
    parser.add_argument(
        "--families", default="", help=f"comma-separated (default: all, {','.join(families())})"
    )
    parser.add_argument(
        "--budget-tokens",
        type=int,
        default=100_000,
        help="training tokens per family (padded length), the same for each (default: about 6 "
        "minutes of EAGLE-3 and 24 of LayerSkip on SmolLM2-135M-Instruct on 2 CPU cores; the "
        "main job trains EAGLE-3 on 256,000)",
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
    add_prompts_arguments(parser, CompareSpec.prompts, CompareSpec.num_prompts)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--tune-prompts", type=int, default=4, help="0: no tuning")
    parser.add_argument("--no-sampled", dest="sampled", action="store_false",
                        help="greedy only (no measurement at temperature 1)")  # fmt: skip
    parser.add_argument("--dtype", default=None, help="float32, bfloat16 (default: as saved)")
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    add_batch_sizes_argument(
        parser,
        "measure every run at each of these batch sizes (comma-separated, e.g. 1,2,4,8,16) "
        "against plain decoding at the same batch size (default: 1)",
    )
    parser.add_argument("--output", default="runs/compare")
    parser.add_argument("--wandb", default=None, metavar="PROJECT", help="also log to W&B")
    args = parser.parse_args(argv)
    folders = {}
    for item in args.folder:
        family, sep, folder = item.partition("=")
        if not sep or not family or not folder:
            parser.error(f"--folder {item!r}: expected FAMILY=FOLDER")
        folders[family] = folder
    settings: dict[str, list[str]] = {}
    for item in args.set:
        family, sep, setting = item.partition(":")
        if not sep or not family or "=" not in setting:
            parser.error(f"--set {item!r}: expected FAMILY:KEY=VALUE")
        settings.setdefault(family, []).append(setting)
    try:
        return CompareSpec(
            target=args.target, families=tuple(f for f in args.families.split(",") if f),
            budget_tokens=args.budget_tokens, folders=folders, settings=settings,
            prompts=args.prompts, num_prompts=args.num_prompts,
            max_new_tokens=args.max_new_tokens, tune_prompts=args.tune_prompts,
            sampled=args.sampled, dtype=args.dtype, device=args.device, seed=args.seed,
            output=args.output, wandb=args.wandb, batch_sizes=args.batch_sizes,
        )  # fmt: skip
    except ValueError as e:  # an unknown family, a count below 1
        parser.error(str(e))


if __name__ == "__main__":
    sys.exit(main())
