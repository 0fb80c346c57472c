"""Choose a trained drafter's decoding settings by measured tokens/s, and save them into it.

    python scripts/tune.py runs/layerskip-demo/final
    python scripts/tune.py runs/eagle-demo/final --dtype bfloat16 --search gamma=3,4,5,6

Searches the drafter's decoding settings one at a time (the exit layer for LayerSkip, tree width
and budget, draft depth gamma, the stop rule, int8 draft weights on a CPU, copying from the
context), racing each round's candidates against plain decoding on the same prompts, keeps the
fastest whose greedy output equals plain decoding's, races a setting again (up to --passes
passes) where another one changed since its round, then measures the saved defaults against
the result once more. Unless --dry-run, the folder's decoding defaults become the result, with
the hardware, dtype and figures they were measured with (`decode_measured` in config.json);
evaluate.py and the training scripts decode with them unless told otherwise. --output writes
every measurement as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import yaml

from specdraft.drafters.checkpoint import (
    drafter_class,
    load_decoding,
    load_drafter,
    read_metadata,
    set_decode,
)
from specdraft.drafters.target import load_target
from specdraft.inference.evaluate import dtype_name, fine_tuned_target
from specdraft.inference.measure import load_prompts
from specdraft.inference.tune import (
    SEARCH_ORDER,
    changed,
    check_space,
    default_space,
    hardware,
    parse_space,
    race,
    search_decode,
)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        target, drafter = load(args)
        prompts = load_prompts(args.prompts, args.num_prompts, target)
        space = parse_space(args.search, default_space(drafter, target))
        check_space(drafter, space)
    except ValueError as e:  # TargetError, CheckpointError, ConfigError, a bad --search
        print(f"scripts/tune.py: error: {e}", file=sys.stderr)
        return 2
    sampling = {"temperature": args.temperature, "seed": args.seed}
    say = lambda m: print(f"[tune] {m}", file=sys.stderr)  # noqa: E731
    saved = load_decoding(args.folder)
    best, rows = search_decode(
        target, drafter, prompts, space, max_new_tokens=args.max_new_tokens, start=saved,
        require_equal=not args.allow_mismatch, passes=args.passes, log=say, **sampling,
    )  # fmt: skip
    if (
        args.temperature == 0
        and not args.allow_mismatch
        and rows
        and not any(r["kept"] for r in rows)
    ):
        print(
            f"scripts/tune.py: error: no setting gave plain decoding's greedy output in "
            f"{dtype_name(target.dtype)} (near ties between tokens flip under low precision); "
            "tune in float32 (--dtype float32), or pass --allow-mismatch to keep the fastest "
            "anyway; the folder is unchanged",
            file=sys.stderr,
        )
        return 1
    # the saved defaults against the result, once more, in one race
    plain, before, after = race(
        target, drafter, prompts, [saved, best], max_new_tokens=args.max_new_tokens, **sampling
    )
    kept_saved = before.tokens_per_s >= after.tokens_per_s and best != saved
    if kept_saved:  # the search's pick lost the final race: noise, or a drifting machine
        best, after = saved, before
    measured = {
        "hardware": hardware(target.device),
        "dtype": dtype_name(target.dtype),
        "temperature": args.temperature,
        "prompts": f"{args.prompts} x {len(prompts)}, {args.max_new_tokens} new tokens",
        "tokens_per_s": after.tokens_per_s,
        "plain_tokens_per_s": plain.tokens_per_s,
        "speedup": after.tokens_per_s / plain.tokens_per_s,
        "tau": after.stats.tau,
        "kept_saved": kept_saved,
        "before": {
            "decode": dataclasses.asdict(saved),
            "tokens_per_s": before.tokens_per_s,
            "speedup": before.tokens_per_s / plain.tokens_per_s,
            "tau": before.stats.tau,
        },
    }
    diff = changed(saved, best)
    if kept_saved:
        print("the saved settings were as fast as the search's pick in the final race: kept")
    print(
        f"saved settings: {before.tokens_per_s:.1f} tok/s ({measured['before']['speedup']:.2f}x "
        f"plain, tau {before.stats.tau:.2f}); tuned: {after.tokens_per_s:.1f} tok/s "
        f"({measured['speedup']:.2f}x, tau {after.stats.tau:.2f}); plain decoding "
        f"{plain.tokens_per_s:.1f} tok/s; on {measured['hardware']}, {measured['dtype']}"
    )
    print(
        "changes: " + (", ".join(f"{k} {old} -> {new}" for k, (old, new) in diff.items()) or "none")
    )
    if args.output:
        out = {"folder": args.folder, "decode": dataclasses.asdict(best), "measured": measured}
        Path(args.output).write_text(json.dumps({**out, "search": rows}, indent=2) + "\n")
    if not args.dry_run:
        set_decode(args.folder, best, measured)
        print(f"{args.folder} now decodes with these settings by default")
    return 0


def load(args):
    """The target the folder decodes with, and the drafter. The target: --target; else the
    folder itself for LayerSkip (its own target), else the target its run trained against (its
    train_config.yaml); a Medusa-2 folder gets that target with its adapter merged."""
    meta, _ = read_metadata(args.folder)
    name = args.target
    if name is None:
        if meta is not None and drafter_class(meta["kind"]).uses_target_weights:
            name = args.folder  # a drafter that is its own target (LayerSkip)
        else:
            config = Path(args.folder) / "train_config.yaml"
            if not config.is_file():
                raise ValueError(
                    f"{args.folder} does not say which target it drafts for (no "
                    "train_config.yaml): pass --target"
                )
            name = str(yaml.safe_load(config.read_text())["target"])
    args.target = name
    target = load_target(name, dtype=args.dtype, device=args.device)
    target = fine_tuned_target(args.folder, target, args) or target
    return target, load_drafter(args.folder, target)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
        + ", ".join(SEARCH_ORDER),
    )
    parser.add_argument("--prompts", default="demo", help="demo, or a .txt/.json/.jsonl file")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--passes",
        type=int,
        default=2,
        help="passes over the settings; a later pass races a setting again where another one "
        "changed since its round (they interact: a shallow LayerSkip exit wants a short draft)",
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
    return args


if __name__ == "__main__":
    sys.exit(main())
