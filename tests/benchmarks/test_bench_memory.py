"""benchmarks/bench_memory.py at tiny sizes: every kind's step runs naive and chunked with the same
loss, and the report has one JSON line per kind with the keys the issue names."""

from __future__ import annotations

import json

import bench_memory
import pytest


@pytest.mark.parametrize("kind", bench_memory.KINDS)
def test_every_kind_steps_with_the_same_loss_naive_and_chunked(one_thread, kind):
    naive = bench_memory.measure(kind, vocab=96, seq=12, chunk=0)
    chunked = bench_memory.measure(kind, vocab=96, seq=12, chunk=5)
    assert chunked["loss"] == pytest.approx(naive["loss"], rel=1e-5)


def test_the_peak_is_the_growth_of_the_resident_peak_during_the_step(one_thread, monkeypatch):
    """getrusage's ru_maxrss (KiB on Linux) read before and after the step: the step's figure is
    their difference in bytes, what it needed above what the process already held."""
    readings = iter([1000, 1600])
    monkeypatch.setattr(
        bench_memory.resource, "getrusage", lambda who: type("R", (), {"ru_maxrss": next(readings)})
    )
    got = bench_memory.measure("medusa", vocab=96, seq=12, chunk=0)
    assert got["peak_bytes"] == 600 * 1024 and got["held_before_bytes"] == 1000 * 1024


def test_json_lines_name_the_kind_and_both_peaks(one_thread, monkeypatch, capsys):
    """The parent's report, its measuring processes run in this one."""
    calls = []

    def in_process(kind, vocab, seq, chunk, limit_gib):
        calls.append(chunk)
        return bench_memory.measure(kind, vocab, seq, chunk)

    monkeypatch.setattr(bench_memory, "run_one", in_process)
    argv = ["--vocab", "64", "--seq", "20", "--chunk", "3", "--kinds", "medusa", "eagle", "dflash"]
    assert bench_memory.main([*argv, "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["kind"] for r in rows] == ["medusa", "eagle", "dflash"] and calls == [0, 3] * 3
    for row in rows:
        assert isinstance(row["peak_bytes_naive"], int)
        assert isinstance(row["peak_bytes_chunked"], int)
        assert row["vocab"] == 64 and row["seq"] == 20 and row["loss_chunk_tokens"] == 3


def test_bad_arguments_are_refused():
    for argv in (["--seq", "2"], ["--chunk", "0"], ["--kinds", "bigram"]):
        with pytest.raises(SystemExit):
            bench_memory.parse_args(argv)
    assert bench_memory.parse_args(["--one", "medusa", "--chunk", "0"]).chunk == 0
