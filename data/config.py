"""The data section of every training config (`data:` in configs/<kind>/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass, field

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
    format: str = field(default="auto", metadata={"choices": FORMATS})
    # Tokens per sample (conversations) or per packed block (plain text).
    max_length: int = 512
    # What to do with a conversation longer than max_length: truncate | drop.
    overlong: str = field(default="truncate", metadata={"choices": OVERLONG})
    # Held-out share for evaluation, taken after a seeded shuffle.
    eval_fraction: float = 0.05
    # Keep at most this many rows after shuffling (None: all).
    max_samples: int | None = None
    seed: int = 0
