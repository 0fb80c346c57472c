"""Dump the target's hidden states of an EAGLE run's data, for offline training.

    python scripts/dump_hidden_states.py --out runs/eagle-cache [--dtype bf16] [--config X] [key=value ...]
    accelerate launch train/eagle.py hidden_cache=runs/eagle-cache

The data, target and head settings come from the same config as train/eagle.py (its demo.yaml by
default, `--config` and `key=value` as there), so the cache holds exactly the examples and layers
that run needs: the head's feature layers plus the final state the target's distribution is
computed from. Rerunning after an interruption continues after the last finished shard.
"""

from __future__ import annotations

import argparse
import sys

from specdraft.config import parse_cli
from specdraft.data.dataset import build_datasets
from specdraft.drafters.eagle import EagleDrafter, resolve_config
from specdraft.targets.hidden_cache import DTYPES, bytes_per_token, write_cache
from specdraft.targets.target import load_target
from specdraft.train.eagle import DEFAULT_CONFIG, EagleTrainConfig

PROG = "scripts/dump_hidden_states.py"


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        target = load_target(cfg.target, dtype=cfg.target_dtype())
        train_examples, eval_examples, _ = build_datasets(cfg.data, target.tokenizer)
        head_cfg = resolve_config(cfg.drafter, target)
        layers = sorted({*EagleDrafter.capture_layers_for(head_cfg, target), target.num_layers})
        write_cache(
            args.out, target, [*train_examples, *eval_examples], layers, dtype=args.dtype,
            shard_examples=args.shard_examples, batch_size=args.batch_size,
            progress=lambda line: print(f"[specdraft] {line}", file=sys.stderr),
        )  # fmt: skip
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    print(
        f"[specdraft] hidden-state cache in {args.out}: layers {layers}, {args.dtype}, "
        f"{bytes_per_token(args.out):.0f} bytes per token"
    )
    return 0


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, EagleTrainConfig]:
    """The cache's own options, and the EAGLE run's config from the rest of the command line
    (`--config PATH`, `key=value`), read as train/eagle.py reads it. `--help` prints both."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --out DIR [options] [--config PATH] [key=value ...]",
        description=__doc__,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--out", help="the cache folder, required (created; resumed if there)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="stored precision")
    parser.add_argument("--shard-examples", type=int, default=256, help="examples per shard file")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:  # parse_cli then lists the config keys and exits
        parser.print_help()
        print("\nThe EAGLE run's config (train/eagle.py's keys):\n")
    elif args.out is None:
        parser.error("the following arguments are required: --out")
    return args, parse_cli(EagleTrainConfig, rest, DEFAULT_CONFIG, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
