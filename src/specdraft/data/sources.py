"""Where rows come from: local .json / .jsonl / .parquet / text files, folders of them, or a
dataset read through `datasets.load_dataset` (a hub id, with a configuration name and split).

Reading never interprets a row; it only says where the row came from, so every later message can
point at a file and line. A row that cannot be read (a malformed JSON line) still comes out, as a
`Row` carrying its error, so one bad line is counted and skipped rather than stopping the run.
Problems with the source as a whole (a missing file, an unsupported file type) are raised at once.
"""

from __future__ import annotations

import gzip
import json
import logging
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# Training sets that ship with specdraft, by name (data/answers/, docs/real-targets.md): a chat
# target's own answers to the standard-library requests of data/requests.py, made by
# scripts/regenerate.py (too slow to make on 2 CPU cores within the main job).
SHIPPED_ANSWERS = {
    "stdlib-requests.smollm2-135m": Path(__file__).parent
    / "answers"
    / "stdlib-requests.smollm2-135m.jsonl.gz",
}

JSON_SUFFIXES = (".json", ".jsonl", ".jsonl.gz")
PARQUET_SUFFIXES = (".parquet",)
TEXT_SUFFIXES = (".txt", ".text", ".md", ".rst", ".py")
SUPPORTED_SUFFIXES = JSON_SUFFIXES + PARQUET_SUFFIXES + TEXT_SUFFIXES
# Suffixes that can only mean a local file, so a missing `data.csv` is reported as a missing file
# rather than sent to the hub as a dataset id.
_FILE_LIKE_SUFFIXES = (
    *SUPPORTED_SUFFIXES,
    ".csv",
    ".tsv",
    ".arrow",
    ".gz",
    ".zip",
    ".xlsx",
    ".yaml",
)

SUPPORTED_HELP = (
    f"supported: a .json, .jsonl(.gz) or .parquet file, a text file "
    f"({', '.join(TEXT_SUFFIXES)}), a folder of these, 'demo', a shipped set "
    f"({', '.join(SHIPPED_ANSWERS)}), or a hub dataset id such as 'HuggingFaceH4/ultrachat_200k'"
)


class DataError(ValueError):
    """Data that cannot be used at all: a missing file, an unsupported type, zero usable rows.
    The message says what, where, and what to do."""


class SkipRow(Exception):
    """One row that cannot be used. `reason` is a short key counted in the summary
    (`empty_conversation`, `unknown_role`, ...); `detail` says what exactly was wrong."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True)
class Row:
    # Where the row came from, for messages: "chats.jsonl:12" (line, 1-based), "chats.parquet[3]"
    # and "chats.json[3]" (index, 0-based), "org/name (train)[3]", or a text file's path.
    where: str
    # A dict (a JSON object, a parquet or hub row) or a str (a whole text file, a JSON string).
    record: Any
    # Set when the row could not be read at all; `record` is then None.
    error: SkipRow | None = None


def read_rows(path: str, name: str | None = None, split: str = "train") -> Iterator[Row]:
    """All rows of `path`: a local file or folder when it looks like one, else a dataset id for
    `datasets.load_dataset(path, name, split=split)`. A missing file, an unsupported file type or
    a dataset that cannot be loaded raise `DataError` here, before the first row is read."""
    if path in SHIPPED_ANSWERS:
        return _read_local_files([SHIPPED_ANSWERS[path]])
    if looks_local(path):
        files = _local_files(Path(path).expanduser())
        return _read_local_files(files)
    return read_hub(path, name, split)


def suffix(file: Path) -> str:
    """A file's type as its name says it: `.jsonl.gz` for gzipped JSON Lines, else the last
    suffix, lower-cased."""
    name = file.name.lower()
    return ".jsonl.gz" if name.endswith(".jsonl.gz") else file.suffix.lower()


def looks_local(path: str) -> bool:
    """True for an existing path, or one that can only be a path (absolute, ./, ~, two or more
    slashes, or a file suffix). Hub ids are `name` or `org/name`."""
    if Path(path).expanduser().exists():
        return True
    return (
        path.startswith(("/", ".", "~"))
        or path.count("/") >= 2
        or Path(path).suffix.lower() in _FILE_LIKE_SUFFIXES
    )


def _local_files(path: Path) -> list[Path]:
    if not path.exists():
        raise DataError(f"data path not found: {path}. Check the path ({SUPPORTED_HELP}).")
    if path.is_file():
        if suffix(path) not in SUPPORTED_SUFFIXES:
            raise DataError(
                f"unsupported file type '{path.suffix}' for {path}; {SUPPORTED_HELP}. "
                "Convert it to .jsonl or .parquet."
            )
        return [path]
    # A folder: every supported file below it, in a fixed order so a seed means the same split
    # on every machine. Hidden files and folders (.git, .cache) are not data.
    files, ignored = [], Counter()
    for file in sorted(path.rglob("*")):
        relative = file.relative_to(path)
        if not file.is_file() or any(part.startswith(".") for part in relative.parts):
            continue
        if suffix(file) in SUPPORTED_SUFFIXES:
            files.append(file)
        else:
            ignored[file.suffix or "(no suffix)"] += 1
    if not files:
        found = ", ".join(f"{kind} x{n}" for kind, n in ignored.most_common()) or "nothing"
        raise DataError(
            f"no supported data files in folder {path} (found: {found}); {SUPPORTED_HELP}."
        )
    if ignored:
        logger.info(
            "%s: ignored %d files of unsupported types %s",
            path,
            sum(ignored.values()),
            dict(ignored),
        )
    return files


def _read_local_files(files: list[Path]) -> Iterator[Row]:
    for file in files:
        kind = suffix(file)
        if kind in (".jsonl", ".jsonl.gz"):
            with (gzip.open if kind == ".jsonl.gz" else open)(file, "rb") as f:
                try:
                    yield from _read_json_lines(file, f)
                except (OSError, EOFError) as e:  # gzip: not gzipped, or cut short
                    raise DataError(
                        f"cannot read {file} as gzipped JSON Lines: {e}. Is the file complete?"
                    ) from e
        elif kind == ".json":
            yield from _read_json(file)
        elif kind in PARQUET_SUFFIXES:
            yield from _read_parquet(file)
        else:
            yield _read_text(file)


def _read_json_lines(file: Path, lines: Iterable[bytes]) -> Iterator[Row]:
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{file}:{number}"
        try:
            yield Row(where, json.loads(line.decode("utf-8")))
        except UnicodeDecodeError as e:
            yield Row(where, None, SkipRow("not_utf8", f"byte {e.start} of the line is not UTF-8"))
        except json.JSONDecodeError as e:
            yield Row(where, None, SkipRow("malformed_json", f"{e.msg} at column {e.colno}"))


def _read_json(file: Path) -> Iterator[Row]:
    raw = file.read_bytes()
    try:
        data = json.loads(raw)
    except UnicodeDecodeError as e:
        yield Row(str(file), None, SkipRow("not_utf8", f"byte {e.start} of the file is not UTF-8"))
        return
    except json.JSONDecodeError as e:
        # Many exports write JSON Lines into a .json file: read it as such when its first line is
        # a JSON value on its own. Otherwise the file is one broken document, reported once.
        first = next((line for line in raw.splitlines() if line.strip()), b"")
        try:
            json.loads(first)
        except (json.JSONDecodeError, UnicodeDecodeError):
            detail = f"{e.msg} at line {e.lineno} column {e.colno}; the file is not valid JSON"
            yield Row(str(file), None, SkipRow("malformed_json", detail))
            return
        yield from _read_json_lines(file, raw.splitlines())
        return
    # A list of rows, or a single row (one conversation) as the whole file.
    rows = data if isinstance(data, list) else [data]
    for index, record in enumerate(rows):
        yield Row(f"{file}[{index}]", record)


def _read_parquet(file: Path) -> Iterator[Row]:
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(file)
    except Exception as e:  # pyarrow raises several types for a file that is not parquet
        raise DataError(f"cannot read {file} as parquet: {e}. Is the file complete?") from e
    records = (r for batch in parquet.iter_batches(batch_size=1024) for r in batch.to_pylist())
    for index, record in enumerate(records):
        yield Row(f"{file}[{index}]", record)


def _read_text(file: Path) -> Row:
    try:
        return Row(str(file), file.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        return Row(str(file), None, SkipRow("not_utf8", f"byte {e.start} is not UTF-8 text"))


def read_hub(
    path: str, name: str | None, split: str, cache_dir: str | None = None
) -> Iterator[Row]:
    """Rows of `datasets.load_dataset(path, name, split=split)`: a hub dataset id, or anything else
    `load_dataset` accepts (a local dataset folder with data files, a builder name)."""
    import datasets

    try:
        dataset = datasets.load_dataset(path, name, split=split, cache_dir=cache_dir)
    except Exception as e:  # load_dataset raises many types (network, missing split, bad config)
        raise DataError(
            f"could not load dataset '{path}' (config {name!r}, split {split!r}) with "
            f"datasets.load_dataset: {type(e).__name__}: {e}. If you meant a local file, check "
            f"the path; {SUPPORTED_HELP}. A hub dataset needs network access or a warm cache."
        ) from e
    return (Row(f"{path} ({split})[{index}]", record) for index, record in enumerate(dataset))
