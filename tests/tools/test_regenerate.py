"""scripts/regenerate.py: the target's own answers, greedy or seeded-sampled, resumable."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.data.sources import DataError
from specdraft.tools.regenerate import main, regenerate

ROWS = [
    {"messages": [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "x"}]},
    {"text": "plain text is not a conversation"},
    {"conversations": [
        {"from": "human", "value": "import os"}, {"from": "gpt", "value": "y"},
        {"from": "human", "value": "class A:"}, {"from": "gpt", "value": "z"},
    ]},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "for i in"},
                  {"role": "assistant", "content": "w"}]},
]  # fmt: skip


@pytest.fixture
def data_file(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


@torch.no_grad()
def _greedy(target, history, n):
    prompt = target.tokenizer.apply_chat_template(
        history, add_generation_prompt=True, return_tensors="pt", return_dict=True
    )
    out = target.model.generate(**prompt, max_new_tokens=n, do_sample=False)
    return target.tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)


def test_greedy_answers_are_the_targets_and_turns_build_on_them(tiny_target, data_file, tmp_path):
    out = tmp_path / "regen.jsonl"
    counts = regenerate(tiny_target, str(data_file), out, max_new_tokens=8)
    assert counts["written"] == 3 and counts["skipped: plain text (see --prompt-tokens)"] == 1
    rows = _lines(out)
    assert [r["source"] for r in rows] == [f"{data_file}:1", f"{data_file}:3", f"{data_file}:4"]
    multi = rows[1]["messages"]
    assert [m["role"] for m in multi] == ["user", "assistant", "user", "assistant"]
    first = _greedy(tiny_target, multi[:1], 8)
    assert multi[1]["content"] == first and first not in ("y", "")
    assert multi[3]["content"] == _greedy(tiny_target, multi[:3], 8)  # history holds the new answer
    assert rows[2]["messages"][0] == {"role": "system", "content": "be brief"}


def test_resume_after_a_crash_writes_what_one_run_writes(tiny_target, data_file, tmp_path):
    whole = tmp_path / "whole.jsonl"
    regenerate(tiny_target, str(data_file), whole, max_new_tokens=6, temperature=1.0, seed=3)
    parts = tmp_path / "parts.jsonl"
    regenerate(
        tiny_target, str(data_file), parts, max_new_tokens=6, temperature=1.0, seed=3, limit=2
    )
    assert len(_lines(parts)) == 2
    with parts.open("a") as f:
        f.write('{"messages": [{"role": "us')  # a line cut off by a crash
    counts = regenerate(
        tiny_target, str(data_file), parts, max_new_tokens=6, temperature=1.0, seed=3
    )
    assert counts["already_done"] == 2 and counts["written"] == 1
    assert parts.read_text() == whole.read_text()


def test_cli_reports_a_missing_file(tiny_target_path, tmp_path, capsys):
    code = main(["--data", str(tmp_path / "nope.jsonl"), "--output", str(tmp_path / "o.jsonl"),
                 "--target", tiny_target_path])  # fmt: skip
    assert code == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert not (tmp_path / "o.jsonl").exists() or (tmp_path / "o.jsonl").read_text() == ""


def test_plain_text_is_continued_by_the_target_after_each_prompt(tiny_target, tmp_path):
    from specdraft.inference import generate

    text = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n" * 2
    data = tmp_path / "code.jsonl"
    data.write_text(json.dumps({"text": text}) + "\n" + json.dumps({"text": "x"}) + "\n")
    ids = tiny_target.tokenizer(text, add_special_tokens=False).input_ids
    out = tmp_path / "cont.jsonl"
    counts = regenerate(tiny_target, str(data), out, max_new_tokens=5, prompt_tokens=6, stride=7)
    rows = _lines(out)
    ends = list(range(6, len(ids), 7))
    assert counts["written"] == len(rows) == len(ends) > 2
    assert counts["skipped: not longer than --prompt-tokens"] == 1  # the one-token row
    decode = tiny_target.tokenizer.decode
    for row, end in zip(rows, ends, strict=True):
        prompt = ids[end - 6 : end]
        greedy = generate(tiny_target, prompt, None, max_new_tokens=5).tokens[0]
        assert row == {"text": decode(prompt) + decode(greedy, skip_special_tokens=True),
                       "source": f"{data}:1@{end}"}  # fmt: skip
    resumed = tmp_path / "resumed.jsonl"
    regenerate(tiny_target, str(data), resumed, max_new_tokens=5, prompt_tokens=6, stride=7,
               limit=2)  # fmt: skip
    again = regenerate(tiny_target, str(data), resumed, max_new_tokens=5, prompt_tokens=6, stride=7)
    assert again["written"] == len(ends) - 2 and _lines(resumed) == rows


def test_negative_prompt_tokens_is_an_error(tiny_target, tmp_path):
    with pytest.raises(DataError, match="--prompt-tokens and --stride must be >= 0"):
        regenerate(tiny_target, "demo", tmp_path / "x.jsonl", prompt_tokens=-1)


def test_a_hub_datasets_configuration_and_split_reach_the_reader(
    tiny_target, monkeypatch, tmp_path
):
    """--name and --split are what the dataset is read with (UltraChat 200k has no `train`
    split; its conversations are `train_sft`)."""
    from specdraft.tools import regenerate as script

    asked = []

    def read_rows(path, name=None, split="train"):
        asked.append((path, name, split))
        return iter(())

    monkeypatch.setattr(script, "read_rows", read_rows)
    args = script.parse_args(["--data", "org/chats", "--split", "train_sft", "--name", "default",
                              "--output", str(tmp_path / "out.jsonl")])  # fmt: skip
    regenerate(tiny_target, args.data, args.output, name=args.name, split=args.split)
    assert asked == [("org/chats", "default", "train_sft")]


def test_batched_answers_equal_one_at_a_time_and_a_lone_prompt_is_answered(
    tiny_target, data_file, tmp_path
):
    """Greedy, a batch of conversations (of different lengths and turn counts) decoded together
    writes what one at a time writes; a row that ends with a user turn gets its answer."""
    with data_file.open("a") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "def mul(a, b):"}]}) + "\n")
    alone, together = tmp_path / "alone.jsonl", tmp_path / "together.jsonl"
    regenerate(tiny_target, str(data_file), alone, max_new_tokens=10)
    counts = regenerate(tiny_target, str(data_file), together, max_new_tokens=10, batch_size=3)
    assert together.read_text() == alone.read_text()
    assert counts["written"] == 4 and counts["generated_tokens"] > 4
    lone = _lines(together)[-1]["messages"]
    assert [m["role"] for m in lone] == ["user", "assistant"]
    assert lone[1]["content"] == _greedy(tiny_target, lone[:1], 10) != ""


def test_stdlib_requests_are_a_dataset_on_every_machine(tiny_target, tmp_path):
    out = tmp_path / "requests.jsonl"
    counts = regenerate(tiny_target, "stdlib-requests", out, max_new_tokens=4, limit=3,
                        batch_size=2)  # fmt: skip
    rows = _lines(out)
    assert counts["written"] == 3 and len(rows) == 3
    assert all(r["source"].startswith("stdlib/") for r in rows)
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)


def test_a_bad_batch_size_is_refused_before_anything_is_written(tiny_target, data_file, tmp_path):
    out = tmp_path / "o.jsonl"
    with pytest.raises(DataError, match="--batch-size must be >= 1"):
        regenerate(tiny_target, str(data_file), out, batch_size=0)
    assert not out.exists()


def test_a_target_without_a_chat_template_is_named(tiny_target, data_file, tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_target.tokenizer, "chat_template", None)
    with pytest.raises(DataError, match=r"has no chat template.*--prompt-tokens"):
        regenerate(tiny_target, str(data_file), tmp_path / "o.jsonl", max_new_tokens=4)
