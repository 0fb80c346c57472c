"""Batched decoding (generate with a batch of prompts): each row's greedy output equals decoding
it alone, for plain decoding and every kind, chains and trees, with prompts of different lengths
and rows that stop at different steps (an EOS, max_new_tokens); sliding-window targets; the
cache's hole compaction; sampled rows follow the target's distribution (chi-square); a bad batch
is a clear error. Every run checks that drafting happened, so none passes vacuously."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    KINDS,
    V,
    make_target,
    perturbed,
    ragged,
    sampled_rows_follow_the_target,
    sliding_model,
    tiny_llama,
)

from specdraft import batch as batch_module
from specdraft.inference import generate
from specdraft.kinds.distill.distill import DistillDrafter
from specdraft.kinds.distill.distill_session import DistillSession
from specdraft.kinds.medusa.medusa_session import MedusaSession

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

NEW = 16


def alone(target, prompts, drafter, **options) -> list[list[int]]:
    return [generate(target, p, drafter, **options).tokens[0].tolist() for p in prompts]


@pytest.fixture
def with_eos(random_target, examples):
    """random_target with an EOS that some rows of `ragged` reach within NEW tokens and others
    do not, so the rows stop at different steps; put back afterwards."""
    plain = alone(random_target, ragged(examples, 16), None, max_new_tokens=NEW)
    counts = {}
    for row in plain:
        for token in set(row[2:]):
            counts[token] = counts.get(token, 0) + 1
    eos = max(counts, key=lambda t: (0 < counts[t] < len(plain) // 2, counts[t]))
    config = random_target.model.generation_config
    config.eos_token_id = [eos]
    yield eos
    config.eos_token_id = None


CASES = [(kind, 1) for kind in KINDS] + [
    (k, 3) for k in ("distill", "eagle3", "medusa", "peagle", "dflash")
]


@pytest.mark.parametrize(("kind", "topk"), CASES, ids=[f"{k}-top{t}" for k, t in CASES])
def test_batched_greedy_rows_equal_each_row_alone(
    random_target, examples, kind_drafter, with_eos, kind, topk
):
    drafter = kind_drafter(kind)
    options = dict(max_new_tokens=NEW, gamma=3, tree_top_k=topk)
    for size in (16, 3):
        prompts = ragged(examples, size)
        out = generate(random_target, prompts, drafter, **options)
        assert out.rows() == alone(random_target, prompts, drafter, **options)
        assert out.stats.batch_size == size and len(out.row_stats) == size
        assert out.stats.drafted > 0 and out.stats.accepted > 0
    ends = [row[-1] == with_eos for row in out.rows()]
    assert any(ends) and not all(ends)  # some rows stopped at the EOS, others ran to NEW
    assert out.tokens.shape == (size, max(out.lengths))
    passes = sum(s.target_passes for s in out.row_stats)
    assert out.stats.tau == pytest.approx(sum(out.lengths) / passes)


BATCH_NATIVE = {
    "distill": DistillSession,
    "medusa": MedusaSession,
}  # kind -> its session drafting a batch at once


@pytest.mark.parametrize("kind", sorted(BATCH_NATIVE))
def test_a_batch_native_session_drafts_what_each_row_drafts_alone(
    random_target, examples, kind_drafter, kind, monkeypatch
):
    """Row for row the same drafts as each row decoded alone: the same tokens, so the same
    statistics (drafted, reached and accepted per depth), with each row's own stop_below and
    dynamic gamma."""
    drafter = kind_drafter(kind)
    sessions = []
    new = type(drafter).new_batch_session

    def recording(self, *args, **kwargs):
        sessions.append(new(self, *args, **kwargs))
        return sessions[-1]

    monkeypatch.setattr(type(drafter), "new_batch_session", recording)
    prompts = ragged(examples, 7)
    for options in (
        dict(gamma=3),
        dict(gamma=5, stop_below=0.5),
        dict(gamma=2, dynamic_gamma=True) if kind == "distill" else dict(gamma=2),
    ):
        options = dict(options, max_new_tokens=NEW)
        out = generate(random_target, prompts, drafter, **options)
        assert isinstance(sessions[-1], BATCH_NATIVE[kind])
        single = [generate(random_target, p, drafter, **options) for p in prompts]
        assert out.rows() == [s.tokens[0].tolist() for s in single]
        for batched, one in zip(out.row_stats, single, strict=True):
            assert (batched.drafted, batched.reached_at, batched.accepted_at) == (
                one.stats.drafted,
                one.stats.reached_at,
                one.stats.accepted_at,
            )
        assert out.stats.accepted > 0


def test_batch_drafting_rows_drafts_row_by_row(random_target, examples, kind_drafter, monkeypatch):
    """batch_drafting=rows gives a kind with a batch session one session per row instead (each
    as a single sequence drafts: drafters/lean.py's paths among them), with the same output."""
    drafter = kind_drafter("eagle3")
    started = []
    for name in ("new_batch_session", "row_sessions"):
        method = getattr(type(drafter), name)
        monkeypatch.setattr(
            type(drafter),
            name,
            lambda self, *a, _m=method, _n=name, **k: started.append(_n) or _m(self, *a, **k),
        )
    prompts = ragged(examples, 5)
    options = dict(max_new_tokens=NEW, gamma=3)
    batched = generate(random_target, prompts, drafter, **options)
    rows = generate(random_target, prompts, drafter, batch_drafting="rows", **options)
    assert started == ["new_batch_session", "row_sessions"]
    assert batched.rows() == rows.rows() == alone(random_target, prompts, drafter, **options)
    assert drafter.drafts_batches_together(drafter.decode_settings(None, gamma=3))
    assert not drafter.drafts_batches_together(drafter.decode_settings(None, tree_top_k=2))


@pytest.mark.parametrize("drafter", [None, "prompt_lookup", "copy-with-lookup"])
def test_plain_and_copying_batches(random_target, examples, kind_drafter, drafter):
    options = dict(max_new_tokens=NEW)
    if drafter == "copy-with-lookup":  # prompt lookup in front of a two-model draft, per row
        drafter, options = kind_drafter("distill"), dict(options, gamma=3, lookup_ngram=1)
    prompts = ragged(examples, 8)
    out = generate(random_target, prompts, drafter, **options)
    assert out.rows() == alone(random_target, prompts, drafter, **options)
    assert all(n == NEW for n in out.lengths)
    if drafter is None:
        assert out.stats.tau == 1 and out.stats.drafted == 0
    else:  # (the random target rarely repeats itself: copies are drafted, seldom accepted)
        assert out.stats.drafted > 0
    if "lookup_ngram" in options:
        assert 0 < out.stats.copied_passes < out.stats.target_passes


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_rows_equal_each_row_alone(name):
    """Rows decoded past the window (8) of a target whose every layer slides (Mistral) or whose
    layers mix sliding and full attention with a rope per type (Gemma-3)."""
    target = make_target(sliding_model(name))
    drafter = DistillDrafter(perturbed(target.model, scale=0.05, seed=1))
    prompts = [[3, 9, 27, 17], list(range(1, 13)), [5], [40, 2, 2, 7, 11, 30, 21]]
    for options in (dict(), dict(gamma=3), dict(gamma=3, tree_top_k=2)):
        d = drafter if options else None
        out = generate(target, prompts, d, max_new_tokens=20, **options)
        assert out.rows() == alone(target, prompts, d, max_new_tokens=20, **options)
    assert out.stats.accepted > 0


def test_compacting_the_holes_keeps_rows_exact(random_target, examples, kind_drafter, monkeypatch):
    """Compaction every step (the cache squeezed whenever any row has a hole) gives the same
    rows as no compaction at all."""
    drafter = kind_drafter("distill")
    prompts = ragged(examples, 6)
    options = dict(max_new_tokens=NEW, gamma=3, tree_top_k=2)
    squeezed = []
    compact = batch_module.BatchCache.compact

    def counting(self):
        squeezed.append(self.columns)
        compact(self)

    monkeypatch.setattr(batch_module.BatchCache, "compact", counting)
    monkeypatch.setattr(batch_module, "COMPACT_FACTOR", 1)
    out = generate(random_target, prompts, drafter, **options)
    assert squeezed  # it did compact
    monkeypatch.setattr(batch_module, "COMPACT_FACTOR", 10**6)
    never = generate(random_target, prompts, drafter, **options)
    assert out.rows() == never.rows() == alone(random_target, prompts, drafter, **options)


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_sampled_rows_follow_the_target(topk):
    """The chi-square test through a two-model draft's batched rows, chain and tree."""
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    drafter = perturbed(target.model, 0.3, seed=4)
    sampled_rows_follow_the_target(target, drafter, top_p=0.9, tree_top_k=topk)


def test_a_bad_batch_is_a_clear_error(random_target):
    t = random_target
    cases = [
        ([[1, 2], []], "prompt 1 is empty"),
        ([[1, 2], 3], "mixes token ids and prompts"),
        (torch.zeros(0, 4, dtype=torch.long), "holds no prompt"),
        ([[1, 2], list(range(1, 250))], r"prompt 1 \(249 tokens\).*exceeds the target's 256"),
        ([[1, 2], [5, 400]], r"prompt 1: input_ids must be token ids in \[0, 384\)"),
    ]
    for ids, message in cases:
        with pytest.raises(ValueError, match=message):
            generate(t, ids, max_new_tokens=8)
