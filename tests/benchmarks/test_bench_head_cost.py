"""The head-cost benchmark (its figures are for BENCHMARKS.md) on a tiny shape: every mode
drafts, its pass cost is the drafting time over the passes drafted, and the printed line says
those figures. It fails when a mode drafts nothing (the old script printed a figure anyway, the
drafting time over max(1, 0) passes) or when the printed cost is not the pass over the step."""

from __future__ import annotations

import re

import bench_head_cost
import pytest
import torch

from specdraft.data.stdlib_corpus import build_demo_tokenizer, demo_corpus_texts


def test_every_mode_drafts_and_its_pass_is_priced_in_target_steps():
    tok = build_demo_tokenizer(demo_corpus_texts()[:30], 4096)
    ids = tok("def f(x):\n    return x\n" * 6, return_tensors="pt").input_ids
    torch.manual_seed(0)
    m = bench_head_cost.measure_shape("64x1x128", tok, ids, new_tokens=8)
    for mode in bench_head_cost.MODES:
        assert m["drafted"][mode] > 0
        assert m["pass_steps"][mode] == pytest.approx(m["pass_ms"][mode] / m["step_ms"])


def test_prints_a_pass_cost_per_mode_and_forward_costs(capsys):
    bench_head_cost.main(["--shape", "64x1x128", "--new-tokens", "8", "--verify", "1,3"])
    out = capsys.readouterr().out
    for mode in bench_head_cost.MODES:
        found = re.search(rf"{mode} ([0-9.]+) ms = ([0-9.]+)", out)
        assert found and float(found.group(1)) > 0 and float(found.group(2)) > 0
    assert re.search(r"1: [0-9.]+ ms, 3: [0-9.]+ ms", out)
