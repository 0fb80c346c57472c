"""benchmarks/bench_precision.py at a tiny shape: every measurement is made in both precisions and
reported, and a bad --shape is named before anything runs."""

from __future__ import annotations

import json

import bench_precision
import pytest


def test_every_measurement_in_both_precisions(one_thread, tmp_path, capsys, monkeypatch):
    # the benchmark's sizes, shrunk: what is checked is that each is measured and reported
    monkeypatch.setattr(bench_precision, "MATMUL", (64, 32, 48))
    monkeypatch.setattr(bench_precision, "TRAIN_BATCH", (2, 16))
    monkeypatch.setattr(bench_precision, "PREFIX", 10)
    out = tmp_path / "precision.json"
    argv = ["--shape", "32x1x64", "--repeats", "1", "--train-repeats", "1", "--output", str(out)]
    assert bench_precision.main(argv) == 0
    rows = json.loads(out.read_text())
    whats = [r["what"] for r in rows]
    assert whats[0] == "64x32 @ 32x48 matmul (GFLOP/s)"
    assert any(w.startswith("training step, 32x1x64") for w in whats)
    assert [w for w in whats if w.startswith("forward")] == [
        f"forward, 32x1x64, {n} new token(s) after 10 (ms)" for n in bench_precision.NEW_TOKENS
    ]
    assert all(r["fp32"] > 0 and r["bf16"] > 0 for r in rows)
    printed = capsys.readouterr().out
    assert "native bf16:" in printed and printed.count("\n| ") == len(rows) + 2


@pytest.mark.parametrize("shape", ["256x8", "256x0x688", "255x8x688", "36x1x64", "axbxc"])
def test_a_bad_shape_is_named(shape, capsys):
    with pytest.raises(SystemExit) as e:
        bench_precision.main(["--shape", shape])
    assert e.value.code == 2 and f"--shape {shape!r}" in capsys.readouterr().err
