"""build_datasets end to end: bad rows are counted and skipped without stopping the run, the
summary says what happened, zero usable rows is an error naming file and reasons, and the
shuffle and split are a function of the seed alone."""

from __future__ import annotations

import json
import logging
from collections import Counter

import pytest

from specdraft.data import DataConfig, DataError, build_datasets


def chat(user: str, answer: str, system: str | None = None) -> dict:
    messages = [{"role": "system", "content": system}] if system else []
    messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return {"messages": messages}


def write_jsonl(path, rows) -> str:
    path.write_text(
        "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
    )
    return str(path)


def test_bad_rows_are_skipped_counted_and_located(tmp_path, llama3_tokenizer, caplog):
    long_answer = " ".join(["Paris is the capital of France."] * 40)
    path = write_jsonl(
        tmp_path / "chats.jsonl",
        [
            chat("What is the capital of France?", "Paris.", system="You are a helpful assistant."),
            {"messages": []},  # line 2: empty conversation
            {
                "messages": [
                    {"role": "wizard", "content": "x"},
                    {"role": "assistant", "content": "y"},
                ]
            },
            chat("What is the capital of Italy?", 42),  # line 4: non-string content
            {"messages": [{"role": "user", "content": "unanswered"}]},  # line 5: no assistant turn
            "{this line is not json",  # line 6
            chat("What is the capital of France?", long_answer),  # line 7: over max_length
            {
                "conversations": [
                    {"from": "human", "value": "And of Italy?"},
                    {"from": "gpt", "value": "Rome."},
                ]
            },
        ],
    )
    cfg = DataConfig(path=path, max_length=64, overlong="drop", eval_fraction=0.0)

    with caplog.at_level(logging.INFO, logger="specdraft.data"):
        train, evaluation, summary = build_datasets(cfg, llama3_tokenizer)

    assert summary.rows_read == 8 and summary.rows_kept == 2
    assert summary.skipped == Counter(
        {
            "empty_conversation": 1,
            "unknown_role": 1,
            "non_string_content": 1,
            "no_assistant_turn": 1,
            "malformed_json": 1,
            "overlong": 1,
        }
    )
    assert summary.skipped_where["unknown_role"] == [
        f"{path}:3: message 0 has role 'wizard'; known roles: assistant, bard, bing, chatgpt, gpt, human, model, system, user"
    ]
    assert summary.skipped_where["malformed_json"][0].startswith(f"{path}:6: ")
    assert summary.skipped_where["overlong"][0].startswith(f"{path}:7: ")
    assert len(train) == 2 and evaluation == []
    assert summary.tokens == sum(len(e.input_ids) for e in train)
    assert summary.loss_tokens == sum(sum(e.loss_mask) for e in train) > 0
    for example in train:
        assert len(example.input_ids) == len(example.loss_mask) <= 64
    # The summary is visible: counts at INFO, a warning because rows were skipped.
    assert "8 rows read, 2 kept, 6 skipped" in caplog.text
    assert any(
        r.levelno == logging.WARNING and "skipped 6 of 8 rows" in r.getMessage()
        for r in caplog.records
    )


def test_overlong_truncate_keeps_the_row(tmp_path, llama3_tokenizer):
    long_answer = " ".join(["Paris is the capital of France."] * 40)
    path = write_jsonl(
        tmp_path / "chats.jsonl", [chat("What is the capital of France?", long_answer)]
    )
    train, _, summary = build_datasets(
        DataConfig(path=path, max_length=64, eval_fraction=0.0), llama3_tokenizer
    )
    assert len(train[0].input_ids) == 64 and train[0].truncated
    assert summary.truncated == 1 and not summary.skipped


def test_template_rejection_skips_only_that_row(tmp_path, llama3_tokenizer):
    tokenizer = llama3_tokenizer.__class__(
        tokenizer_object=llama3_tokenizer.backend_tokenizer, eos_token="<|eot_id|>"
    )
    tokenizer.chat_template = (
        r"{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        r"{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '<|eot_id|>' }}{% endfor %}"
        r"{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
    )
    path = write_jsonl(
        tmp_path / "chats.jsonl", [chat("Hi", "Hello", system="Be brief."), chat("Hi", "Hello")]
    )
    train, _, summary = build_datasets(DataConfig(path=path, eval_fraction=0.0), tokenizer)
    assert len(train) == 1
    assert summary.skipped == Counter({"template_rejected": 1})
    assert "System role not supported" in summary.skipped_where["template_rejected"][0]


def test_zero_usable_rows_is_an_error_naming_file_and_reasons(tmp_path, llama3_tokenizer):
    path = write_jsonl(
        tmp_path / "bad.jsonl",
        [{"messages": []}, "{oops", {"messages": [{"role": "user", "content": "Hi"}]}],
    )
    with pytest.raises(DataError) as info:
        build_datasets(DataConfig(path=path), llama3_tokenizer)
    message = str(info.value)
    assert path in message
    for reason in ("empty_conversation", "malformed_json", "no_assistant_turn"):
        assert reason in message
    assert f"{path}:2" in message  # where the malformed line is


def test_missing_file_and_unsupported_extension_fail_at_once(tmp_path, llama3_tokenizer):
    with pytest.raises(DataError, match="not found"):
        build_datasets(DataConfig(path=str(tmp_path / "missing.jsonl")), llama3_tokenizer)
    (tmp_path / "chats.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type"):
        build_datasets(DataConfig(path=str(tmp_path / "chats.csv")), llama3_tokenizer)


def test_bad_config_values_name_the_key(llama3_tokenizer):
    with pytest.raises(DataError, match=r"data\.overlong .* got 'cut'") as info:
        build_datasets(DataConfig(overlong="cut", format="alpaca"), llama3_tokenizer)
    assert "data.format" in str(info.value)


def numbered_chats(tmp_path, n: int) -> str:
    return write_jsonl(
        tmp_path / "chats.jsonl", [chat(f"Question {i}?", f"Answer {i}.") for i in range(n)]
    )


def decoded_users(tokenizer, examples) -> list[str]:
    return [tokenizer.decode(e.input_ids).split("Question ")[1].split("?")[0] for e in examples]


def test_split_and_order_are_a_function_of_the_seed(tmp_path, llama3_tokenizer):
    path = numbered_chats(tmp_path, 20)
    cfg = DataConfig(path=path, eval_fraction=0.25, seed=3)

    train, evaluation, summary = build_datasets(cfg, llama3_tokenizer)
    again_train, again_eval, _ = build_datasets(cfg, llama3_tokenizer)
    other_train, _, _ = build_datasets(
        DataConfig(path=path, eval_fraction=0.25, seed=4), llama3_tokenizer
    )

    assert [e.input_ids for e in train] == [e.input_ids for e in again_train]
    assert [e.input_ids for e in evaluation] == [e.input_ids for e in again_eval]
    assert [e.input_ids for e in train] != [e.input_ids for e in other_train]
    train_ids = decoded_users(llama3_tokenizer, train)
    eval_ids = decoded_users(llama3_tokenizer, evaluation)
    assert len(eval_ids) == 5 and len(train_ids) == 15
    assert sorted(train_ids + eval_ids, key=int) == [
        str(i) for i in range(20)
    ]  # disjoint, complete
    assert (summary.train_examples, summary.eval_examples) == (15, 5)


def test_max_samples_keeps_a_seeded_subset(tmp_path, llama3_tokenizer):
    path = numbered_chats(tmp_path, 20)
    train, evaluation, summary = build_datasets(
        DataConfig(path=path, max_samples=6, eval_fraction=0.2), llama3_tokenizer
    )
    assert (len(train), len(evaluation)) == (5, 1)
    assert summary.rows_beyond_max_samples == 14 and not summary.skipped


def test_text_folder_is_packed_per_split_with_loss_everywhere(tmp_path, llama3_tokenizer):
    for i in range(10):
        (tmp_path / f"doc{i}.txt").write_text(f"The capital of France is Paris. Document {i}.\n")
    cfg = DataConfig(path=str(tmp_path), max_length=16, eval_fraction=0.2)

    train, evaluation, summary = build_datasets(cfg, llama3_tokenizer)

    eos = llama3_tokenizer.eos_token_id
    assert train and evaluation
    for example in train + evaluation:
        assert example.loss_mask == [1] * len(example.input_ids)
    assert all(len(e.input_ids) == 16 for e in train)
    # Eval documents are packed on their own: no document's text is in both splits.
    eval_text = llama3_tokenizer.decode([t for e in evaluation for t in e.input_ids if t != eos])
    train_text = llama3_tokenizer.decode([t for e in train for t in e.input_ids if t != eos])
    eval_docs = {d for d in range(10) if f"Document {d}." in eval_text}
    assert eval_docs and not any(f"Document {d}." in train_text for d in eval_docs)
    assert summary.rows_read == summary.rows_kept == 10


def test_demo_corpus_is_read_as_plain_text(llama3_tokenizer):
    demo = pytest.importorskip("specdraft.data.stdlib_corpus")
    if not hasattr(demo, "demo_corpus_texts"):
        pytest.skip("specdraft.data.stdlib_corpus.demo_corpus_texts is not written yet")
    cfg = DataConfig(path="demo", max_length=32, max_samples=4, eval_fraction=0.25)
    train, evaluation, summary = build_datasets(cfg, llama3_tokenizer)
    assert summary.rows_read > 100 and summary.rows_kept == 4
    assert train and evaluation
    assert all(e.loss_mask == [1] * len(e.input_ids) for e in train)
