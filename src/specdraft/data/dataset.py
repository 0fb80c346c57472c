"""The one entry point trainers call: `build_datasets(cfg, tokenizer)`.

1. Read rows (sources.py), or the demo corpus for `path: demo`.
2. Parse each into a conversation or a text (formats.py); unusable rows are counted and skipped.
   Every row is checked against the benchmark prompt sets (benchmarks.py): a row that holds a
   benchmark prompt is a `DataError` naming it.
3. Shuffle with `seed`, keep `max_samples`, split off `eval_fraction` for evaluation. The split is
   by row, before tokenization, so the same data and seed give the same split for any tokenizer,
   and text documents never straddle the two splits.
4. Tokenize conversations with an assistant-only loss mask (chat.py) and pack texts into blocks
   (packing.py), per split; with `pack`, pack the conversations into rows of whole
   conversations too (packing.py); shuffle each split's examples with the same seeded generator.
5. Return the examples and a `DataSummary`, which is also logged: INFO for the counts, WARNING
   when rows were skipped. Zero usable training examples is a `DataError` naming the reasons.
"""

from __future__ import annotations

import logging
import random
from collections import Counter
from dataclasses import dataclass, field

from specdraft.data.benchmarks import benchmark_index, check_no_benchmark
from specdraft.data.chat import encode_conversation
from specdraft.data.data_config import FORMATS, OVERLONG, DataConfig
from specdraft.data.formats import Conversation, Example, Text, parse_record
from specdraft.data.packing import pack_documents, pack_texts
from specdraft.data.sources import DataError, Row, SkipRow, read_rows
from specdraft.data.stdlib_corpus import demo_corpus_texts

logger = logging.getLogger(__name__)

_EXAMPLES_PER_REASON = 3  # locations kept per skip reason, enough to find the pattern


@dataclass
class DataSummary:
    """What happened to the data, for the console and for the checkpoint's provenance."""

    source: str
    rows_read: int = 0
    rows_kept: int = 0  # conversations encoded + text documents packed
    rows_beyond_max_samples: int = 0  # usable rows left out by max_samples (not an error)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    skipped_where: dict[str, list[str]] = field(default_factory=dict)  # reason -> "where: detail"
    truncated: int = 0  # conversations cut to max_length
    tail_tokens_dropped: int = 0  # packed text after the last full block (packing.py)
    packed_conversations: int = 0  # conversations packed into rows (data.pack)
    packed_rows: int = 0  # the rows they fill
    train_examples: int = 0
    eval_examples: int = 0
    tokens: int = 0  # all tokens in train + eval examples
    loss_tokens: int = 0  # tokens with loss_mask == 1 (the tokens the model is trained on)
    # the benchmark prompt sets the rows were checked against (none of their prompts is in them)
    benchmarks_checked: tuple[str, ...] = ()
    benchmarks_unchecked: list[str] = field(default_factory=list)  # "set: why it was not"

    def skip(self, reason: str, where: str, detail: str) -> None:
        self.skipped[reason] += 1
        examples = self.skipped_where.setdefault(reason, [])
        if len(examples) < _EXAMPLES_PER_REASON:
            examples.append(f"{where}: {detail}")

    def format(self) -> str:
        lines = [
            f"data {self.source}: {self.rows_read} rows read, {self.rows_kept} kept, "
            f"{sum(self.skipped.values())} skipped; {self.train_examples} train / "
            f"{self.eval_examples} eval examples, {self.tokens} tokens, {self.loss_tokens} in the loss",
        ]
        if self.rows_beyond_max_samples:
            lines.append(
                f"  {self.rows_beyond_max_samples} usable rows beyond max_samples left out"
            )
        if self.truncated:
            lines.append(f"  {self.truncated} conversations truncated to max_length")
        if self.tail_tokens_dropped:
            lines.append(
                f"  {self.tail_tokens_dropped} packed text tokens after the last full block dropped"
            )
        if self.packed_rows:
            lines.append(
                f"  {self.packed_conversations} conversations packed into {self.packed_rows} rows "
                f"of at most max_length tokens"
            )
        if self.benchmarks_checked:
            lines.append(
                f"  no prompt of {', '.join(self.benchmarks_checked)} in the rows (benchmark "
                "contamination check)"
            )
        lines.extend(f"  not checked against {line}" for line in self.benchmarks_unchecked)
        for reason, count in self.skipped.most_common():
            lines.append(f"  skipped {count} x {reason}, e.g.")
            lines.extend(f"    {example}" for example in self.skipped_where[reason])
        return "\n".join(lines)


def build_datasets(cfg: DataConfig, tokenizer) -> tuple[list[Example], list[Example], DataSummary]:
    """(train examples, eval examples, summary) for `cfg`, tokenized with the target's `tokenizer`
    (a fast Hugging Face tokenizer; conversations need its chat template)."""
    _check_config(cfg, tokenizer)
    summary = DataSummary(source=cfg.path)
    items = _parse_rows(_rows(cfg), cfg.format if cfg.path != "demo" else "text", summary)
    _refuse_benchmarks(items, cfg, summary)

    rng = random.Random(cfg.seed)
    rng.shuffle(items)
    if cfg.max_samples is not None and len(items) > cfg.max_samples:
        summary.rows_beyond_max_samples = len(items) - cfg.max_samples
        items = items[: cfg.max_samples]
    n_eval = _eval_count(len(items), cfg.eval_fraction)
    eval_items, train_items = items[:n_eval], items[n_eval:]

    train = _encode(train_items, tokenizer, cfg, summary)
    evaluation = _encode(eval_items, tokenizer, cfg, summary)
    rng.shuffle(train)
    rng.shuffle(evaluation)

    summary.train_examples, summary.eval_examples = len(train), len(evaluation)
    for example in train + evaluation:
        summary.tokens += len(example.input_ids)
        summary.loss_tokens += sum(example.loss_mask)
    if not train:
        raise DataError(
            f"no usable training examples in {cfg.path}: {summary.rows_read} rows read.\n"
            f"{summary.format()}\nFix the rows above or point data.path at another dataset "
            f"(data.format is {cfg.format!r}; data/formats.py lists the formats read)."
        )
    logger.info("%s", summary.format())
    if summary.skipped:
        logger.warning(
            "data %s: skipped %d of %d rows (%s); see the summary above",
            cfg.path,
            sum(summary.skipped.values()),
            summary.rows_read,
            ", ".join(f"{reason} x{n}" for reason, n in summary.skipped.most_common()),
        )
    return train, evaluation, summary


def _check_config(cfg: DataConfig, tokenizer) -> None:
    problems = []
    if cfg.format not in FORMATS:
        problems.append(f"data.format must be one of {', '.join(FORMATS)}, got {cfg.format!r}")
    if cfg.overlong not in OVERLONG:
        problems.append(f"data.overlong must be 'truncate' or 'drop', got {cfg.overlong!r}")
    if cfg.pack and (cfg.path == "demo" or cfg.format == "text"):
        problems.append(
            "data.pack packs conversations, and "
            + ("data.path demo is the plain-text demo corpus" if cfg.path == "demo" else
               "data.format text reads plain text")
            + ", which is always packed into max_length blocks: set data.pack=false, or point "
            "data.path at conversations"
        )  # fmt: skip
    if not isinstance(cfg.max_length, int) or cfg.max_length < 2:
        problems.append(f"data.max_length must be an integer >= 2, got {cfg.max_length!r}")
    if not 0 <= cfg.eval_fraction < 1:
        problems.append(f"data.eval_fraction must be in [0, 1), got {cfg.eval_fraction!r}")
    if cfg.max_samples is not None and cfg.max_samples < 1:
        problems.append(
            f"data.max_samples must be a positive integer or null, got {cfg.max_samples!r}"
        )
    if not getattr(tokenizer, "is_fast", False):
        # Character offsets (return_offsets_mapping) exist only in the Rust-backed tokenizers.
        problems.append(
            f"the tokenizer must be a fast (tokenizers-backed) tokenizer, got {type(tokenizer).__name__}; "
            "load it with AutoTokenizer.from_pretrained(..., use_fast=True)"
        )
    if problems:
        raise DataError("bad data config: " + "; ".join(problems))


def _rows(cfg: DataConfig):
    if cfg.path == "demo":
        # The demo's held-out files are its evaluation prompts, not data here; eval examples
        # come from eval_fraction.
        return (Row(f"demo[{i}]", text) for i, text in enumerate(demo_corpus_texts(split="train")))
    return read_rows(cfg.path, cfg.name, cfg.split)


def _parse_rows(rows, fmt: str, summary: DataSummary) -> list[tuple[str, Conversation | Text]]:
    items = []
    for row in rows:
        summary.rows_read += 1
        if row.error is not None:
            summary.skip(row.error.reason, row.where, row.error.detail)
            continue
        try:
            items.append((row.where, parse_record(row.record, fmt)))
        except SkipRow as e:
            summary.skip(e.reason, row.where, e.detail)
    return items


def _refuse_benchmarks(
    items: list[tuple[str, Conversation | Text]], cfg: DataConfig, summary: DataSummary
) -> None:
    """A DataError naming the rows that hold a prompt of a benchmark set (data/benchmarks.py):
    a drafter trained on the prompts it is measured on flatters its figures."""
    index, summary.benchmarks_unchecked = benchmark_index()
    texts = (
        (
            where,
            item.text if isinstance(item, Text) else "\n".join(m.content for m in item.messages),
        )
        for where, item in items
    )
    found = check_no_benchmark(texts, index)
    if found:
        shown = "\n  ".join(found[:5]) + (
            f"\n  ... and {len(found) - 5} more" if len(found) > 5 else ""
        )
        raise DataError(
            f"{len(found)} {'row' if len(found) == 1 else 'rows'} of {cfg.path} "
            f"{'holds' if len(found) == 1 else 'hold'} benchmark prompts, and a drafter is not "
            f"trained on the prompts it is measured on:\n  {shown}\nRemove these rows from the "
            "data (data/benchmarks.py says how a match is found)."
        )
    summary.benchmarks_checked = index.sets
    for line in summary.benchmarks_unchecked:
        logger.warning("data %s: not checked against %s", cfg.path, line)


def _eval_count(n: int, fraction: float) -> int:
    # At least one eval row whenever evaluation is asked for and there are two rows to split,
    # and never all of them: training needs data more than evaluation does.
    if fraction <= 0 or n < 2:
        return 0
    return min(max(1, round(n * fraction)), n - 1)


def _encode(
    items: list[tuple[str, Conversation | Text]], tokenizer, cfg: DataConfig, summary: DataSummary
) -> list[Example]:
    conversations, texts = [], []
    for where, item in items:
        if isinstance(item, Text):
            texts.append(item.text)
            continue
        try:
            example = encode_conversation(item, tokenizer, cfg.max_length, cfg.overlong, where)
        except SkipRow as e:
            summary.skip(e.reason, where, e.detail)
            continue
        conversations.append(example)
        summary.rows_kept += 1
        summary.truncated += example.truncated
    examples = conversations
    if cfg.pack and conversations:
        examples = pack_documents(conversations, cfg.max_length)
        summary.packed_conversations += len(conversations)
        summary.packed_rows += len(examples)
    if texts:
        blocks, dropped = pack_texts(texts, tokenizer, cfg.max_length)
        examples.extend(blocks)
        summary.rows_kept += len(texts)
        summary.tail_tokens_dropped += dropped
    return examples
