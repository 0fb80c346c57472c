"""Choose a trained drafter's decoding settings by measured tokens/s, and save them into it.

    python scripts/tune.py runs/layerskip-demo/final
    python scripts/tune.py runs/eagle-demo/final --dtype bfloat16 --search gamma=3,4,5,6
    python scripts/tune.py runs/eagle-demo/final --batch-sizes 1,4,16

Searches the drafter's decoding settings one at a time (the exit layer for LayerSkip, tree width
and budget, draft depth gamma, the stop rule, int8 draft weights on a CPU, copying from the
context), racing each round's candidates against plain decoding on the same prompts, keeps the
fastest whose greedy output equals plain decoding's, races a setting again (up to --passes
passes) where another one changed since its round, then measures the saved defaults against
the result once more. Unless --dry-run, the folder's decoding defaults become the result, with
the hardware, dtype and figures they were measured with (`decode_measured` in config.json);
evaluate.py and the training scripts decode with them unless told otherwise. --output writes
every measurement as JSON.

--batch-sizes 1,4,16 then races, at each of those batch sizes, the result at every gamma of
the search (and a tree at every tree_budget) against plain decoding, on batches of the prompts,
and saves the winners as the settings' batch_schedule: generate decodes a batch with the entry
for its size, and not at all where plain decoding won or no setting beat it by more than
--min-gain (3%). Without it, a schedule saved before is kept as it was.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from specdraft.drafters.base import kinds_own_settings
from specdraft.formats.checkpoint import set_decode
from specdraft.formats.reading import folder_target, load_decoding, load_drafter
from specdraft.measuring.measure import choose_threads, load_prompts
from specdraft.measuring.tuning import (
    MIN_GAIN,
    SEARCH_ORDER,
    NoExactSetting,
    check_space,
    default_space,
    parse_space,
    summary,
    tune_against_saved,
    tune_batch_schedule,
)
from specdraft.tools.arguments import (
    add_batch_sizes_argument,
    add_prompts_arguments,
    add_threads_argument,
    new_parser,
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    log = lambda m: print(f"[tune] {m}", file=sys.stderr)  # noqa: E731
    try:
        # the target the folder decodes with (reading.folder_target), and the drafter
        target = folder_target(args.folder, args.target, dtype=args.dtype, device=args.device)
        drafter = load_drafter(args.folder, target)
        choose_threads(args.threads, target, log=log)
        prompts = load_prompts(args.prompts, args.num_prompts, target)
        space = parse_space(args.search, default_space(drafter, target), drafter.decode_class)
        check_space(drafter, space)
    except ValueError as e:  # TargetError, CheckpointError, ConfigError, a bad --search
        print(f"scripts/tune.py: error: {e}", file=sys.stderr)
        return 2
    saved = load_decoding(args.folder)
    try:
        tuned = tune_against_saved(
            target, drafter, prompts, space, saved=saved, max_new_tokens=args.max_new_tokens,
            temperature=args.temperature, seed=args.seed, passes=args.passes,
            require_equal=not args.allow_mismatch, source=args.prompts, log=log,
        )  # fmt: skip
    except NoExactSetting as e:
        print(
            f"scripts/tune.py: error: {e}; tune in float32 (--dtype float32), or pass "
            "--allow-mismatch to keep the fastest anyway; the folder is unchanged",
            file=sys.stderr,
        )
        return 1
    best, measured = tuned.decode, tuned.measured
    batch_rows = []
    if args.batch_sizes:
        schedule = tune_batch_schedule(
            target, drafter, prompts, space, base=best, batch_sizes=args.batch_sizes,
            max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed,
            require_equal=not args.allow_mismatch, min_gain=args.min_gain, log=log,
        )  # fmt: skip
        best, batch_rows = schedule.decode, schedule.rows
        measured["batch_schedule"] = schedule.measured
    else:  # tuned without it (tune_against_saved): a schedule saved before stays as it was
        best = best.replace(batch_schedule=saved.batch_schedule)
    print("\n".join(summary(saved, best, tuned, retuned=bool(args.batch_sizes))))
    if args.output:
        out = {"folder": args.folder, "decode": dataclasses.asdict(best), "measured": measured}
        out["search"], out["batch_search"] = tuned.rows, batch_rows
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    if not args.dry_run:
        set_decode(args.folder, best, measured)
        print(f"{args.folder} now decodes with these settings by default")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """scripts/tune.py's command line, checked: a bad value is the parser's error naming it."""
    parser = new_parser(__doc__)
    parser.add_argument("folder", help="a trained drafter folder (a run's final/ or best/)")
    parser.add_argument(
        "--target",
        default=None,
        help="the target (default: the folder itself for LayerSkip, else its run's target)",
    )
    parser.add_argument(
        "--search",
        nargs="*",
        default=[],
        metavar="KEY=V1,V2",
        help="values to try for a setting instead of the defaults (KEY= leaves it out): "
        + ", ".join(SEARCH_ORDER)
        + ", or the drafter kind's own ("
        + ", ".join(kinds_own_settings())
        + ")",
    )
    add_prompts_arguments(parser, "mt-bench", 8, first_turns=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    add_threads_argument(parser)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="passes over the settings; a later pass races a setting again where another one "
        "changed since its round (they interact: a shallow LayerSkip exit wants a short draft)",
    )
    add_batch_sizes_argument(
        parser,
        "also race gamma (and a tree's budget) against plain decoding at each of these batch "
        "sizes, and save the winners as the settings' batch_schedule (e.g. 1,4,16)",
        default=None,
        metavar="B1,B2,...",
    )
    parser.add_argument(
        "--min-gain",
        type=float,
        default=MIN_GAIN,
        help="with --batch-sizes: how much faster than plain decoding (a fraction) a setting must "
        f"be in its race to get an entry; else drafting is off there (default {MIN_GAIN})",
    )
    parser.add_argument("--dtype", default=None, help="float32, bfloat16, ... (default: as saved)")
    parser.add_argument("--device", default=None)
    parser.add_argument(
        "--allow-mismatch",
        action="store_true",
        help="keep the fastest setting even where its greedy output differs from plain decoding",
    )
    parser.add_argument("--dry-run", action="store_true", help="measure, but leave the folder")
    parser.add_argument("--output", default=None, help="write every measurement to this JSON")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_new_tokens < 1 or args.passes < 1:
        parser.error("--num-prompts, --max-new-tokens and --passes must be >= 1")
    if args.temperature < 0:
        parser.error("--temperature must be >= 0")
    if not args.min_gain >= 0:  # NaN too
        parser.error("--min-gain must be >= 0 (0: any win over plain decoding gets an entry)")
    return args


if __name__ == "__main__":
    sys.exit(main())
