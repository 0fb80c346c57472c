"""The data section of every training config (`data:` in configs/<kind>/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def choice(*choices: str) -> Any:
    """A str config field limited to `choices`; the first one is the default.

    The choices live in the field's metadata, so the config loader (train/config.py) validates
    against and `--help` lists the same tuple (OmegaConf has no `Literal`, hence this instead of
    a type). Every config section uses it: data, trainer and drafter sections alike.
    """
    return field(default=choices[0], metadata={"choices": choices})


# The values `format` and `overlong` accept; the config loader (train/config.py) reads them from the
# field metadata, so a typo fails when the config loads, not deep inside the pipeline.
FORMATS = ("auto", "sharegpt", "messages", "ultrachat", "text")
OVERLONG = ("truncate", "drop")


@dataclass
class DataConfig:
    # "demo" (the demo corpus: standard-library source), a local file or folder
    # (.json, .jsonl, .parquet, .txt/.py/.md text), or a hub dataset id read through `datasets`.
    path: str = "demo"
    # Hub datasets only: the configuration name and the split to read.
    name: str | None = None
    split: str = "train"
    # auto | sharegpt | messages | ultrachat | text. "auto" detects per row.
    format: str = choice(*FORMATS)
    # Tokens per sample (conversations) or per packed block (plain text).
    max_length: int = 512
    # What to do with a conversation longer than max_length: truncate | drop.
    overlong: str = choice(*OVERLONG)
    # Held-out share for evaluation, taken after a seeded shuffle.
    eval_fraction: float = 0.05
    # Keep at most this many rows after shuffling (None: all).
    max_samples: int | None = None
    seed: int = 0
