"""The head-cost benchmark runs end to end on a tiny shape (its figures are for BENCHMARKS.md)."""

from __future__ import annotations

import re

from specdraft.scripts import bench_head_cost


def test_prints_a_pass_cost_per_mode_and_forward_costs(capsys):
    bench_head_cost.main(["--shape", "64x1x128", "--new-tokens", "8", "--verify", "1,3"])
    out = capsys.readouterr().out
    for mode in bench_head_cost.MODES:
        assert re.search(rf"{mode} [0-9.]+ ms = [0-9.]+", out)
    assert re.search(r"1: [0-9.]+ ms, 3: [0-9.]+ ms", out)
