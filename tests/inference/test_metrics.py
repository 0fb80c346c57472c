"""Stats follow DESIGN.md's definitions: tau counts the bonus token; alpha_i is conditional on the
verification reaching depth i."""

from __future__ import annotations

import pytest

from specdraft.inference.metrics import Stats


def test_tau_and_acceptance_per_position():
    s = Stats()
    s.record_step(tree_size=4, tree_depth=4, path_len=2, emitted=3)  # depth 3 rejected
    s.record_step(tree_size=4, tree_depth=4, path_len=4, emitted=5)  # all accepted + bonus
    s.record_step(tree_size=0, tree_depth=0, path_len=0, emitted=1)  # no draft
    assert s.tau == pytest.approx(9 / 3) and s.target_passes == 3
    assert s.reached_at == [2, 2, 2, 1] and s.accepted_at == [2, 2, 1, 1]
    assert s.acceptance_per_position == [1.0, 1.0, 0.5, 1.0]
    assert (s.drafted, s.accepted, s.emitted_per_pass) == (8, 6, [3, 5, 1])


def test_merge_adds_counts_and_keeps_the_larger_memory():
    a, b = Stats(drafter_kv_bytes=10), Stats(drafter_kv_bytes=30)
    a.record_step(2, 2, 2, 3)
    b.record_step(6, 3, 0, 1)  # a tree of 6 nodes, 3 deep, nothing accepted
    m = a.merge(b)
    assert m.reached_at == [2, 1] and m.accepted_at == [1, 1]
    assert m.new_tokens == 4 and m.target_passes == 2 and m.drafter_kv_bytes == 30
