"""A kind's trainer as the command line reaches it: `specdraft train KIND`, `accelerate launch
train/KIND.py` from a checkout, and scripts/compare.py, which trains every family in one process.

A kind trains if its folder has a trainer, `specdraft.kinds.KIND.KIND_trainer`: that module defines the kind's TrainConfig
subclass (with `kind` set), its DEFAULT_CONFIG (configs/KIND/demo.yaml) and `run(cfg)`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdraft.config import load_config, parse_cli
from specdraft.train.train_config import SetupError, TrainConfig
from specdraft.train.trainer import TrainResult


@dataclass(frozen=True)
class Recipe:
    """How a kind trains: its config class, its demo config, and the function that trains it
    once the command line is read."""

    config_class: type[TrainConfig]
    default_config: Path
    run: Callable[[TrainConfig], TrainResult]

    @classmethod
    def of(cls, kind: str) -> Recipe:
        """The recipe of `kind`; a kind with no trainer is a ValueError naming those that have."""
        if kind not in trained_kinds():
            raise ValueError(
                f"no trainer for the kind {kind!r}: the kinds that train are "
                f"{', '.join(trained_kinds())}"
            )
        module = importlib.import_module(f"specdraft.kinds.{kind}.{kind}_trainer")
        config_class = next(
            v
            for v in vars(module).values()
            if isinstance(v, type) and issubclass(v, TrainConfig) and v.kind == kind
        )
        return cls(config_class, Path(module.DEFAULT_CONFIG), module.run)

    def config(self, overrides: Sequence[str] = ()) -> TrainConfig:
        return load_config(self.config_class, self.default_config, overrides)


def trained_kinds() -> list[str]:
    """The kinds with a trainer: the registered kinds whose folder in specdraft/kinds holds a
    module KIND_trainer."""
    from specdraft.drafters.base import drafter_kinds

    return sorted(
        kind
        for kind in drafter_kinds()
        if importlib.util.find_spec(f"specdraft.kinds.{kind}") is not None
        and importlib.util.find_spec(f"specdraft.kinds.{kind}.{kind}_trainer") is not None
    )


def main(kind: str, argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """Train `kind` from a command line (`[--config PATH] [key=value ...]`, or `--help`): 0 when
    it trained, 2 for a setup error (missing data, a bad target, bad layer ids or sizes), printed
    as one line; a bad config exits 2 through the config parser."""
    prog = prog or f"specdraft train {kind}"
    recipe = Recipe.of(kind)
    argv = sys.argv[1:] if argv is None else list(argv)
    cfg = parse_cli(recipe.config_class, argv, recipe.default_config, prog=prog)
    try:
        recipe.run(cfg)
    except SetupError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0
