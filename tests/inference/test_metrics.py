"""Stats follow docs/architecture.md's definitions: tau counts the bonus token; alpha_i is
conditional on the verification reaching depth i."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.core import looping_share, loops
from specdraft.inference.generate import generate
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


def test_looping_share_counts_continuations_that_end_in_a_short_period():
    looping = [7] * 10 + [1, 2, 3] * 30  # a period of 3 at the end
    drifting = list(range(100))
    late = list(range(60)) + [5, 6] * 10  # loops, but too short a tail to tell yet
    assert loops(looping) and not loops(drifting) and not loops(late)
    assert loops([4, 5] * 60, max_period=2) and not loops(list(range(24)) * 5, max_period=23)
    assert looping_share([looping, drifting, late, looping]) == 0.5
    assert looping_share([]) == 0.0


def test_greedy_looping_decodes_each_prompt_plainly(random_target, monkeypatch):
    """What fine-tuning scripts report: the share of plain greedy continuations that loop, from
    our loop's own plain decoding."""
    from specdraft.train import fine_tuned

    prompts = [torch.tensor([[3, 4, 5]]), torch.tensor([[6, 7]]), torch.tensor([[8]])]
    outputs = [generate(random_target, p, None, max_new_tokens=80).tokens[0] for p in prompts]
    share = fine_tuned.greedy_looping(random_target, prompts, 80)
    assert share == looping_share([o.tolist() for o in outputs])
    assert fine_tuned.greedy_looping(random_target, [], 80) is None
    seen = []

    def fake_generate(target, ids, drafter, *, max_new_tokens):  # loops on the 2nd prompt only
        seen.append((ids, drafter, max_new_tokens))
        tokens = [1, 2] * 40 if len(seen) == 2 else list(range(80))
        return SimpleNamespace(tokens=torch.tensor([tokens]))

    monkeypatch.setattr(fine_tuned, "generate", fake_generate)
    assert fine_tuned.greedy_looping(random_target, prompts, 80) == pytest.approx(1 / 3)
    assert [(d, n) for _, d, n in seen] == [(None, 80)] * 3
    assert all(ids is p for (ids, _, _), p in zip(seen, prompts, strict=True))
