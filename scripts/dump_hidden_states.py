"""Dump the target's hidden states of an EAGLE or DFlash run's data, for offline training.

    python scripts/dump_hidden_states.py --out runs/eagle-cache [--dtype bf16] [--config X] [key=value ...]
    accelerate launch train/eagle.py hidden_cache=runs/eagle-cache
    python scripts/dump_hidden_states.py --kind dflash --out runs/dflash-cache [key=value ...]
    accelerate launch train/dflash.py hidden_cache=runs/dflash-cache

The data, target and drafter settings come from the same config as the kind's entry script
(train/eagle.py or train/dflash.py: its demo.yaml by default, `--config` and `key=value` as
there), so the cache holds exactly the examples and layers that run needs: the drafter's
feature layers plus the final state the target's distribution is computed from. Rerunning after
an interruption continues after the last finished shard.
"""

from __future__ import annotations

import argparse
import sys

from specdraft.config import parse_cli
from specdraft.data.dataset import build_datasets
from specdraft.drafters import dflash, eagle
from specdraft.targets.hidden_cache import DTYPES, bytes_per_token, write_cache
from specdraft.targets.target import load_target
from specdraft.train import dflash as dflash_script
from specdraft.train import eagle as eagle_script

# kind -> (its entry script's config class and default config, the layers its drafter reads)
KINDS = {
    "eagle": (
        eagle_script.EagleTrainConfig,
        eagle_script.DEFAULT_CONFIG,
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


def main(argv: list[str] | None = None) -> int:
    prog = "scripts/dump_hidden_states.py"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, add_help=False,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--kind", default="eagle", choices=list(KINDS), help="whose run it feeds")
    parser.add_argument("--out", required=True, help="the cache folder (created; resumed if there)")
    parser.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="stored precision")
    parser.add_argument("--shard-examples", type=int, default=256, help="examples per shard file")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per target forward")
    args, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    config_class, default_config, layers_read = KINDS[args.kind]
    cfg = parse_cli(config_class, rest, default_config, prog=prog)
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
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    print(
        f"[specdraft] hidden-state cache in {args.out}: layers {layers}, {args.dtype}, "
        f"{bytes_per_token(args.out):.0f} bytes per token"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
