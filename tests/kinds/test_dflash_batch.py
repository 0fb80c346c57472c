"""DFlash's session (DFlashSession) serving a batch: every drafting row's block in one pass, each
row drafting exactly what it drafts decoded alone (a session of one row) (fp32: the same tokens, so the same
per-step statistics), with prompts of different lengths (different known context counts), per-row
stop_below and depth, rows that draft nothing or accept a tree another drafter proposed, and
sampled rows that follow the target's distribution."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import V, make_target, ragged, sampled_rows_follow_the_target, tiny_llama
from test_eagle_batch import CopyingRows, CopyingSession, EveryOtherCopied, step_stats
from testkit import perturb

from specdraft.core import DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.sessions import BatchSession
from specdraft.inference import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter, DFlashSession

pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]

NEW = 16
GAMMA = 3


def batch_session(drafter, target, rows: int, **settings) -> BatchSession:
    decode = drafter.decode_settings(None, **settings)
    return drafter.new_batch_session(target, rows, sampling=SamplingSettings(), decode=decode)


@pytest.fixture
def drafts(monkeypatch) -> dict[tuple, list[int]]:
    """Every draft a DFlash session made, for a batch or one row, by the context it drafted after
    and its max depth (a row's contexts differ at every step)."""
    made = {}
    propose = DFlashSession.propose

    def recording(self, contexts):
        trees = propose(self, contexts)
        for context, tree in zip(contexts, trees, strict=True):
            if context is not None:
                made[(*context.tokens[0].tolist(), context.max_depth)] = tree.tokens[0].tolist()
        return trees

    monkeypatch.setattr(DFlashSession, "propose", recording)
    return made


@pytest.fixture
def block_passes(monkeypatch) -> list[int]:
    """The rows of every block pass, single-row or batch."""
    passes = []
    block_states = DFlashDrafter.block_states

    def counting(self, tokens, *args, **kwargs):
        passes.append(tokens.shape[0])
        return block_states(self, tokens, *args, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "block_states", counting)
    return passes


@pytest.mark.parametrize("stop_below", [0.0, 0.4], ids=["gamma", "stop_below"])
def test_batched_rows_draft_what_each_row_drafts_alone(
    random_target, examples, kind_drafter, drafts, block_passes, stop_below
):
    drafter = kind_drafter("dflash")
    session = batch_session(drafter, random_target, 3, stop_below=stop_below)
    assert type(session) is DFlashSession
    assert session.capture_layers == drafter.capture_layers
    options = dict(max_new_tokens=NEW, gamma=GAMMA, stop_below=stop_below)
    for size in (16, 3):
        prompts = ragged(examples, size)
        block_passes.clear()
        drafts.clear()
        out = generate(random_target, prompts, drafter, **options)
        passes, batched = list(block_passes), dict(drafts)
        drafts.clear()
        alone = [generate(random_target, p, drafter, **options) for p in prompts]
        assert out.rows() == [a.tokens[0].tolist() for a in alone]
        assert batched == drafts  # every step's draft, token for token
        assert [step_stats(s) for s in out.row_stats] == [step_stats(a.stats) for a in alone]
        assert out.stats.drafted > 0 and out.stats.accepted > 0
        # one block pass per step for every drafting row, never one per row
        steps = max(s.target_passes for s in out.row_stats)
        assert 0 < len(passes) < steps and passes[0] == size
        # rows finish at different steps (drop), and the context's buffers were measured
        assert len({s.target_passes for s in out.row_stats}) > 1
        assert out.stats.drafter_kv_bytes > 0
    if stop_below:  # the rule ended some chains, each row's where its own would end
        full = generate(random_target, prompts, drafter, max_new_tokens=NEW, gamma=GAMMA)
        assert out.stats.drafted < full.stats.drafted


def test_prompt_lookup_in_front_of_the_batch_session(random_target, examples, kind_drafter, drafts):
    """Copying (CopyingRows) drafts the rows whose context repeats; the batch session drafts the
    others, each as its single-row session does behind CopyingSession."""
    drafter = kind_drafter("dflash")
    prompts = ragged(examples, 8)
    options = dict(max_new_tokens=NEW, gamma=GAMMA, lookup_ngram=1)
    out = generate(random_target, prompts, drafter, **options)
    batched = dict(drafts)
    drafts.clear()
    alone = [generate(random_target, p, drafter, **options) for p in prompts]
    assert out.rows() == [a.tokens[0].tolist() for a in alone]
    assert batched == drafts and batched
    assert [step_stats(s) for s in out.row_stats] == [step_stats(a.stats) for a in alone]
    assert 0 < out.stats.copied_passes < out.stats.target_passes


def test_rows_that_copy_keep_drafting_what_they_draft_alone(
    random_target, examples, kind_drafter, monkeypatch
):
    """A row whose proposal another drafter made (a copy: no context for this session, then
    that tree at accept) drafts on afterwards exactly as it does decoded alone."""
    drafter = kind_drafter("dflash")
    prompts = ragged(examples, 5)
    plain = [generate(random_target, p, max_new_tokens=NEW).tokens[0].tolist() for p in prompts]
    rows = iter(range(len(prompts)))
    new_session, new_batch = type(drafter).new_session, type(drafter).new_batch_session

    def copying_alone(self, target, **kwargs):
        r = next(rows)
        row = EveryOtherCopied(plain[r], len(prompts[r]))
        return CopyingSession(new_session(self, target, **kwargs), row)

    def copying_batch(self, target, batch_size, **kwargs):
        inner = new_batch(self, target, batch_size, **kwargs)
        assert isinstance(inner, DFlashSession)
        return CopyingRows(
            inner, [EveryOtherCopied(plain[r], len(p)) for r, p in enumerate(prompts)]
        )

    monkeypatch.setattr(type(drafter), "new_session", copying_alone)
    monkeypatch.setattr(type(drafter), "new_batch_session", copying_batch)
    options = dict(max_new_tokens=NEW, gamma=GAMMA)
    out = generate(random_target, prompts, drafter, **options)
    alone = [generate(random_target, p, drafter, **options) for p in prompts]
    assert out.rows() == plain
    assert [step_stats(s) for s in out.row_stats] == [step_stats(a.stats) for a in alone]
    assert out.stats.accepted > out.stats.target_passes // 2  # the copies were accepted


def test_prefill_drop_and_memory(random_target, kind_drafter):
    """The first proposal is empty (no features yet); after the prompts' forward each row holds
    its own prompt's keys and values (the memory of the rows' single sessions), a dropped row
    takes its own with it, and a session told nothing of a verification says so."""
    drafter = kind_drafter("dflash")
    session = batch_session(drafter, random_target, 2)
    prompts = [[5, 17, 42], [9, 3, 8]]
    contexts = [DraftContext(torch.tensor([p]), max_depth=4) for p in prompts]
    assert all(len(tree) == 0 for tree in session.propose(contexts))
    assert session.extra_memory_bytes() == 0
    hidden = [
        random_target.forward(torch.tensor([p]), capture_layers=session.capture_layers)
        for p in prompts
    ]
    session.accept([DraftTree.empty()] * 2, [[], []], [h.hidden_states for h in hidden])
    decode = drafter.decode_settings(None)
    alone = drafter.new_session(random_target, sampling=SamplingSettings(), decode=decode)
    alone.accept(DraftTree.empty(), [], hidden[1].hidden_states)
    assert session.extra_memory_bytes() == 2 * alone.extra_memory_bytes() > 0
    session.drop([1])
    after = DraftContext(torch.tensor([[*prompts[1], 7]]), max_depth=4)
    drafted = session.propose([after])[0].tokens.tolist()
    assert drafted == alone.propose(after).tokens.tolist() and len(drafted[0]) > 0
    longer = [DraftContext(torch.tensor([[*prompts[1], 99, 7]]), max_depth=4)]
    with pytest.raises(RuntimeError, match=r"features of 3 positions of row 0.*has 5"):
        session.propose(longer)


def test_sampled_rows_follow_the_target():
    """Chi-square on the joint of the first two tokens (both drafted by one block) of five rows
    with one prompt, batched with a row of another length, through the batch session (q
    recorded per row and slot), with stop_below ending some chains."""
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    torch.manual_seed(6)
    drafter = DFlashDrafter.build(DFlashConfig(block_size=3), target).eval()
    with torch.no_grad():
        perturb(drafter.parameters(), 0.5)  # an untrained drafter that still drafts varied tokens
    options = dict(stop_below=0.3)
    assert isinstance(batch_session(drafter, target, 4, **options), DFlashSession)
    sampled_rows_follow_the_target(target, drafter, **options)
