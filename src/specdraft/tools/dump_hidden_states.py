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
import sys

from specdraft.config import parse_cli
from specdraft.data.dataset import build_datasets
from specdraft.kinds.dflash import dflash
from specdraft.kinds.dflash import dflash_trainer as dflash_script
from specdraft.kinds.eagle import eagle
from specdraft.kinds.eagle import eagle_trainer as eagle_script
from specdraft.kinds.peagle import peagle_trainer as peagle_script
from specdraft.targets.hidden_cache import DTYPES, bytes_per_token, write_cache
from specdraft.targets.target import load_target
from specdraft.train.train_config import TrainConfig

# kind -> (its trainer's config class and default config, the layers its drafter reads)
KINDS = {
    "eagle": (
        eagle_script.EagleTrainConfig,
        eagle_script.DEFAULT_CONFIG,
        lambda cfg, target: eagle.EagleDrafter.capture_layers_for(
            eagle.resolve_config(cfg, target), target
        ),
    ),
    "peagle": (  # EAGLE-3's head: the same feature layers
        peagle_script.PEagleTrainConfig,
        peagle_script.DEFAULT_CONFIG,
        lambda cfg, target: eagle.EagleDrafter.capture_layers_for(
            eagle.resolve_config(cfg, target), target
        ),
    ),
    "dflash": (
        dflash_script.DFlashTrainConfig,
        dflash_script.DEFAULT_CONFIG,
        lambda cfg, target: dflash.resolve_config(cfg, target).aux_layers,
    ),
}

PROG = "scripts/dump_hidden_states.py"


def main(argv: list[str] | None = None) -> int:
    args, cfg = parse_args(sys.argv[1:] if argv is None else argv)
    layers_read = KINDS[args.kind][2]
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
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --out DIR [--kind KIND] [options] [--config PATH] [key=value ...]",
        description=__doc__,
        add_help=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--kind", default="eagle", choices=list(KINDS), help="whose run it feeds")
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
    config_class, default_config, _ = KINDS[args.kind]
    return args, parse_cli(config_class, rest, default_config, prog=PROG)


if __name__ == "__main__":
    sys.exit(main())
