"""Dump the target's hidden states of an EAGLE, P-EAGLE or DFlash run's data, for offline training.

    python scripts/dump_hidden_states.py --out runs/eagle-cache [--dtype bf16] [--config X] [key=value ...]
    accelerate launch train/eagle.py hidden_cache=runs/eagle-cache
    python scripts/dump_hidden_states.py --kind dflash --out runs/dflash-cache [key=value ...]
    accelerate launch train/dflash.py hidden_cache=runs/dflash-cache

The data, target and drafter settings come from the same config as the kind's trainer
(kinds/KIND/KIND_trainer.py for eagle, peagle or dflash: its demo.yaml by default, `--config` and `key=value` as
there), so the cache holds exactly the examples and layers that run needs: the drafter's
feature layers plus the final state the target's distribution is computed from. Rerunning after
an interruption continues after the last finished shard.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from types import ModuleType

from specdraft.config import parse_cli
from specdraft.data.dataset import build_datasets
from specdraft.targets.hidden_cache import DTYPES, bytes_per_token, write_cache
from specdraft.targets.target import load_target
from specdraft.tools.arguments import new_parser
from specdraft.train.entry import Recipe, trained_kinds
from specdraft.train.train_config import TrainConfig


def cached_kinds() -> dict[str, ModuleType]:
    """kind -> its trainer module, for the kinds that train from the cache: those whose trainer
    says which target layers its drafter reads (`layers_read(drafter config, target)`)."""
    trainers = {
        k: importlib.import_module(f"specdraft.kinds.{k}.{k}_trainer") for k in trained_kinds()
    }
    return {k: m for k, m in trainers.items() if hasattr(m, "layers_read")}


PROG = "scripts/dump_hidden_states.py"


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(sys.argv[1:] if argv is None else argv)
    layers_read = cached_kinds()[args.kind].layers_read
    try:
        target = load_target(cfg.target, dtype=cfg.target_dtype())
        train_examples, eval_examples, _ = build_datasets(cfg.data, target.tokenizer)
        layers = sorted({*layers_read(cfg.drafter, target), target.num_layers})
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


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, TrainConfig]:
    """The cache's own options, and the run's config from the rest of the command line
    (`--config PATH`, `key=value`), read as the kind's trainer reads it. `--help` prints
    both."""
    usage = f"{PROG} --out DIR [--kind KIND] [options] [--config PATH] [key=value ...]"
    parser = new_parser(__doc__, prog=PROG, usage=usage, add_help=False)
    parser.add_argument(
        "--kind", default="eagle", choices=list(cached_kinds()), help="whose run it feeds"
    )
    parser.add_argument("--out", help="the cache folder, required (created; resumed if there)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="stored precision")
    parser.add_argument("--shard-examples", type=int, default=256, help="examples per shard file")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    args, rest = parser.parse_known_args(argv)
    if "-h" in rest or "--help" in rest:  # parse_cli then lists the config keys and exits
        parser.print_help()
        print(f"\nThe {args.kind} run's config (`specdraft train {args.kind}`'s keys):\n")
    elif args.out is None:
        parser.error("the following arguments are required: --out")
    recipe = Recipe.of(args.kind)
    return args, parse_cli(recipe.config_class, rest, recipe.default_config, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
