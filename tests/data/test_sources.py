"""Reading rows: every supported file kind, where each row came from, and the clear errors for a
missing file, an unsupported type, and a malformed line (skipped, not fatal)."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from specdraft.data.sources import SHIPPED_ANSWERS, DataError, looks_local, read_hub, read_rows

CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}


def test_jsonl_rows_carry_their_line_numbers(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n\n" + json.dumps({"text": "x"}) + "\n")
    rows = list(read_rows(str(path)))
    assert [row.where for row in rows] == [f"{path}:1", f"{path}:3"]  # blank line 2 is no row
    assert rows[0].record == CHAT and rows[0].error is None


def test_gzipped_json_lines_in_a_file_and_a_folder_and_a_cut_file_is_named(tmp_path):
    path = tmp_path / "chats.jsonl.gz"
    whole = gzip.compress((json.dumps(CHAT) + "\n" + json.dumps({"text": "x"}) + "\n").encode())
    path.write_bytes(whole)
    rows = list(read_rows(str(path)))
    assert [r.where for r in rows] == [f"{path}:1", f"{path}:2"] and rows[0].record == CHAT
    assert [r.record for r in read_rows(str(tmp_path))] == [CHAT, {"text": "x"}]
    path.write_bytes(whole[: len(whole) // 2])  # a download cut short
    with pytest.raises(DataError, match=r"chats\.jsonl\.gz as gzipped JSON Lines.*complete"):
        list(read_rows(str(path)))
    path.write_text(json.dumps(CHAT))  # named .gz, never gzipped
    with pytest.raises(DataError, match="gzipped JSON Lines"):
        list(read_rows(str(path)))


def test_a_shipped_set_is_read_by_name_from_any_folder(tmp_path, monkeypatch):
    """The main job's data ships with specdraft and is named, not a path relative to a checkout:
    the target's own answers, conversations with an assistant turn to learn."""
    monkeypatch.chdir(tmp_path)
    name = "stdlib-requests.smollm2-135m"
    assert SHIPPED_ANSWERS[name].is_file()
    rows = list(read_rows(name))
    assert len(rows) >= 500 and all(r.error is None for r in rows)
    roles = [m["role"] for m in rows[0].record["messages"]]
    assert roles[0] == "user" and roles[-1] == "assistant"


def test_malformed_json_line_is_one_skipped_row(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps(CHAT) + "\n{not json\n" + json.dumps(CHAT) + "\n")
    rows = list(read_rows(str(path)))
    assert len(rows) == 3
    assert rows[1].where == f"{path}:2"
    assert rows[1].error.reason == "malformed_json" and rows[1].record is None
    assert rows[2].record == CHAT  # reading went on after the bad line


def test_json_list_single_object_and_json_lines_in_a_json_file(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps([CHAT, CHAT]))
    single = tmp_path / "single.json"
    single.write_text(json.dumps(CHAT, indent=2))
    lines = tmp_path / "lines.json"
    lines.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n")

    assert [r.where for r in read_rows(str(as_list))] == [f"{as_list}[0]", f"{as_list}[1]"]
    assert [r.record for r in read_rows(str(single))] == [CHAT]
    assert [r.where for r in read_rows(str(lines))] == [f"{lines}:1", f"{lines}:2"]


def test_broken_json_file_is_reported_once_with_its_position(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('[\n  {"text": "a"},\n  {"text": \n]')
    (row,) = read_rows(str(path))
    assert row.error.reason == "malformed_json"
    assert "line 4" in row.error.detail


def test_parquet_rows(tmp_path):
    path = tmp_path / "chats.parquet"
    pq.write_table(pa.Table.from_pylist([CHAT, CHAT]), path)
    rows = list(read_rows(str(path)))
    assert [r.where for r in rows] == [f"{path}[0]", f"{path}[1]"]
    assert rows[1].record == CHAT


def test_folder_reads_supported_files_in_order_and_ignores_others(tmp_path):
    (tmp_path / "b.txt").write_text("second")
    (tmp_path / "a.py").write_text("first = 1\n")
    (tmp_path / "notes.csv").write_text("x,y\n")
    (tmp_path / ".hidden.txt").write_text("never")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.md").write_text("third")
    rows = list(read_rows(str(tmp_path)))
    assert [r.record for r in rows] == ["first = 1\n", "second", "third"]


def test_text_file_that_is_not_utf8_is_a_skipped_row(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("café".encode("latin-1"))
    (row,) = read_rows(str(path))
    assert row.error.reason == "not_utf8"


def test_missing_file_is_an_immediate_error_naming_path_and_formats(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(DataError, match="not found") as info:
        read_rows(str(missing))  # raised on the call, before any row is asked for
    assert str(missing) in str(info.value)
    assert ".parquet" in str(info.value)


def test_unsupported_extension_is_an_immediate_error(tmp_path):
    path = tmp_path / "chats.csv"
    path.write_text("a,b\n")
    with pytest.raises(DataError, match=r"unsupported file type '\.csv'") as info:
        read_rows(str(path))
    assert str(path) in str(info.value) and ".jsonl" in str(info.value)


def test_folder_without_supported_files_is_an_error(tmp_path):
    (tmp_path / "a.csv").write_text("a\n")
    with pytest.raises(DataError, match=r"no supported data files .*\.csv x1"):
        read_rows(str(tmp_path))


def test_local_paths_and_hub_ids_are_told_apart(tmp_path):
    assert looks_local(str(tmp_path))
    assert looks_local("data/chats.jsonl")  # a file suffix: a path even when missing
    assert looks_local("./chats")
    assert looks_local("a/b/c")
    assert not looks_local("HuggingFaceH4/ultrachat_200k")
    assert not looks_local("bigcode/the-stack-v1.2")


def test_hub_path_reads_through_load_dataset(tmp_path):
    # The code path a hub id takes, pointed at a local dataset folder (no network here).
    repo = tmp_path / "repo"
    repo.mkdir()
    pq.write_table(
        pa.Table.from_pylist([CHAT, {"messages": CHAT["messages"][:1]}]), repo / "train.parquet"
    )
    rows = list(read_hub(str(repo), None, "train", cache_dir=str(tmp_path / "cache")))
    assert [r.record["messages"] for r in rows] == [CHAT["messages"], CHAT["messages"][:1]]
    assert rows[1].where == f"{repo} (train)[1]"


def test_unloadable_hub_dataset_is_a_clear_error(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    pq.write_table(pa.Table.from_pylist([CHAT]), repo / "train.parquet")
    with pytest.raises(DataError, match=r"could not load dataset .*split 'validation'"):
        read_hub(str(repo), None, "validation", cache_dir=str(tmp_path / "cache"))
