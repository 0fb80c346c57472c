"""The data section of every training config (`data:` in configs/<kind>/*.yaml)."""

from __future__ import annotations

from dataclasses import dataclass

from specdraft.config import choice

# The values `format` and `overlong` accept; the config engine (specdraft/config.py) reads them from the
# field metadata, so a typo fails when the config loads, not deep inside the pipeline.
FORMATS = ("auto", "sharegpt", "messages", "ultrachat", "text")
OVERLONG = ("truncate", "drop")


@dataclass
class DataConfig:
    # "demo" (the demo corpus: standard-library source), a local file or folder
    # (.json, .jsonl, .parquet, .txt/.py/.md text), or a hub dataset id read through `datasets`.
    path: str = "demo"
    # Hub datasets only: the configuration name (None: the default one).
    name: str | None = None
    # Hub datasets only: the split to read (train, test, ...).
    split: str = "train"
    # auto | sharegpt | messages | ultrachat | text. "auto" detects per row.
    format: str = choice(*FORMATS)
    # Tokens per sample (conversations), per packed row (conversations with pack: true) or
    # per packed block (plain text).
    max_length: int = 512
    # Pack several conversations into each row of max_length tokens, each attending only to
    # itself (document masks, position ids restarting per conversation; data/packing.py),
    # instead of one conversation per row padded to the micro-batch's longest. Training is the
    # same, token for token; the rows carry no padding.
    pack: bool = False
    # What to do with a conversation longer than max_length: truncate | drop.
    overlong: str = choice(*OVERLONG)
    # Held-out share for evaluation, taken after a seeded shuffle.
    eval_fraction: float = 0.05
    # Keep at most this many rows after shuffling (None: all).
    max_samples: int | None = None
    # Seeds the shuffle that picks the held-out split, max_samples and the example order.
    seed: int = 0
