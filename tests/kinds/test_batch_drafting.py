"""A kind's one session serving a batch: EAGLE's (EagleSession, P-EAGLE's PEagleSession) and
DFlash's (DFlashSession) draft the chains of the rows together, one drafter pass per depth for
every row (P-EAGLE and DFlash: one pass), each row drafting exactly what it drafts decoded alone
(fp32: the same tokens, so the same per-step statistics), with prompts of different lengths,
per-row stop_below and depth, rows that draft nothing or accept a tree another drafter
proposed, and sampled rows that follow the target's distribution."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import (
    V,
    make_target,
    perturbed,
    ragged,
    sampled_rows_follow_the_target,
    tiny_llama,
)
from testkit import perturb

from specdraft.core import DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.sessions import BatchSession, DraftSession, RowSessions
from specdraft.inference import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter, DFlashSession
from specdraft.kinds.distill.distill import DistillDrafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_session import EagleSession
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, PEagleSession

pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]

NEW = 16
GAMMA = 3
KINDS = ["eagle1", "eagle3", "peagle", "dflash"]
SESSION = {"eagle1": EagleSession, "eagle3": EagleSession, "peagle": PEagleSession,
           "dflash": DFlashSession}  # fmt: skip
PASSES_PER_STEP = {"eagle1": GAMMA, "eagle3": GAMMA, "peagle": 1, "dflash": 1}


def batch_session(drafter, target, rows: int, **settings) -> BatchSession:
    decode = drafter.decode_settings(None, **settings)
    return drafter.new_batch_session(target, rows, sampling=SamplingSettings(), decode=decode)


def step_stats(stats) -> tuple:
    """What a row drafted and accepted, step by step."""
    return stats.drafted, stats.reached_at, stats.accepted_at, stats.emitted_per_pass


@pytest.fixture
def drafts(monkeypatch) -> dict[tuple, list[int]]:
    """Every draft a session made, for a batch or one row, by the context it drafted after and
    its max depth (a row's contexts differ at every step)."""
    made = {}
    for cls in (EagleSession, PEagleSession, DFlashSession):
        propose = cls.propose

        def recording(self, contexts, propose=propose):
            trees = propose(self, contexts)
            for context, tree in zip(contexts, trees, strict=True):
                if context is not None:
                    made[(*context.tokens[0].tolist(), context.max_depth)] = tree.tokens[0].tolist()
            return trees

        monkeypatch.setattr(cls, "propose", recording)
    return made


@pytest.fixture
def passes(monkeypatch) -> list[int]:
    """The rows of every drafter pass: an EAGLE head pass, a DFlash block pass."""
    seen = []
    for cls, name in ((EagleSession, "_step"), (DFlashDrafter, "block_states")):
        run = getattr(cls, name)

        def counting(self, tokens, *args, run=run, **kwargs):
            seen.append(tokens.shape[0])
            return run(self, tokens, *args, **kwargs)

        monkeypatch.setattr(cls, name, counting)
    return seen


@pytest.mark.parametrize("stop_below", [0.0, 0.4], ids=["gamma", "stop_below"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_rows_draft_what_each_row_drafts_alone(
    random_target, examples, kind_drafter, drafts, passes, kind, stop_below
):
    drafter = kind_drafter(kind)
    assert type(batch_session(drafter, random_target, 3, stop_below=stop_below)) is SESSION[kind]
    options = dict(max_new_tokens=NEW, gamma=GAMMA, stop_below=stop_below)
    for size in (16, 3):
        prompts = ragged(examples, size)
        passes.clear()
        drafts.clear()
        out = generate(random_target, prompts, drafter, **options)
        batch_passes, batched = list(passes), dict(drafts)
        drafts.clear()
        alone = [generate(random_target, p, drafter, **options) for p in prompts]
        assert out.rows() == [a.tokens[0].tolist() for a in alone]
        assert batched == drafts  # every step's draft, token for token
        assert [step_stats(s) for s in out.row_stats] == [step_stats(a.stats) for a in alone]
        assert out.stats.drafted > 0 and out.stats.accepted > 0
        # every row at once: at most PASSES_PER_STEP passes per step, never one per row
        steps = max(s.target_passes for s in out.row_stats)
        assert 0 < len(batch_passes) <= steps * PASSES_PER_STEP[kind]
        assert batch_passes[0] == size
        # rows finish at different steps (drop), and the drafter's cache was measured
        assert len({s.target_passes for s in out.row_stats}) > 1
        assert out.stats.drafter_kv_bytes > 0
    if stop_below:  # the rule ended some chains, each row's where its own would end
        full = generate(random_target, prompts, drafter, max_new_tokens=NEW, gamma=GAMMA)
        assert out.stats.drafted < full.stats.drafted


@pytest.mark.parametrize("kind", KINDS)
def test_rows_alike_draft_without_a_mask_what_they_draft_alone(
    random_target, examples, kind_drafter, drafts, kind, monkeypatch
):
    """Prompts of one length: the first proposal feeds every row alike (no holes: the pass runs
    without a mask, as one row's does), later ones with masks; each row drafts what it drafts
    alone."""
    drafter = kind_drafter(kind)
    prompts = [list(e.input_ids[:6]) for e in examples[:4]]
    masks = []
    for cls, name in ((EagleSession, "_step"), (DFlashDrafter, "block_states")):
        run = getattr(cls, name)

        def noting(self, *args, run=run, **kwargs):  # EAGLE's visible, DFlash's mask: 4th
            masks.append(args[3] if len(args) > 3 else None)
            return run(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, noting)
    options = dict(max_new_tokens=NEW, gamma=GAMMA)
    out = generate(random_target, prompts, drafter, **options)
    batched, unmasked = dict(drafts), masks[0] is None
    drafts.clear()
    alone = [generate(random_target, p, drafter, **options) for p in prompts]
    assert out.rows() == [a.tokens[0].tolist() for a in alone]
    assert batched == drafts and batched and unmasked and len(masks) > 1


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_trees_draft_row_by_row(random_target, kind_drafter, kind):
    session = batch_session(kind_drafter(kind), random_target, 3, tree_top_k=2)
    assert isinstance(session, RowSessions)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_prompt_lookup_in_front_of_the_session(random_target, examples, kind_drafter, drafts, kind):
    """Copying (CopyingRows) drafts the rows whose context repeats; the session drafts the
    others, each as it drafts the row decoded alone."""
    drafter = kind_drafter(kind)
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


class EveryOtherCopied:
    """A row's every other proposal is the target's own next tokens (a copy, accepted whole)
    instead of its drafter's, which then sees no proposal and accepts a tree it did not draft."""

    def __init__(self, continuation: list[int], prompt: int) -> None:
        self.continuation, self.prompt = continuation, prompt
        self.proposals = 0

    def copies(self) -> bool:
        self.proposals += 1
        return self.proposals % 2 == 0

    def copy(self, context: DraftContext) -> DraftTree:
        done = context.tokens.shape[1] - self.prompt
        tokens = self.continuation[done : done + min(2, context.max_depth)]
        return DraftTree.chain(torch.tensor([tokens]))


class CopyingSession(DraftSession):
    def __init__(self, inner: DraftSession, row: EveryOtherCopied) -> None:
        self.inner, self.row = inner, row
        self.capture_layers = inner.capture_layers

    def propose(self, context: DraftContext) -> DraftTree:
        return self.row.copy(context) if self.row.copies() else self.inner.propose(context)

    def accept(self, tree, path, hidden_states=None) -> None:
        self.inner.accept(tree, path, hidden_states)


class CopyingRows(BatchSession):
    def __init__(self, inner: BatchSession, rows: list[EveryOtherCopied]) -> None:
        self.inner, self.rows = inner, rows
        self.capture_layers = inner.capture_layers

    def propose(self, contexts):
        copied = [c is not None and r.copies() for r, c in zip(self.rows, contexts, strict=True)]
        asked = [None if copy else c for copy, c in zip(copied, contexts, strict=True)]
        drafted = self.inner.propose(asked)
        return [
            row.copy(c) if copy else tree
            for row, c, copy, tree in zip(self.rows, contexts, copied, drafted, strict=True)
        ]

    def accept(self, trees, paths, hidden_states) -> None:
        self.inner.accept(trees, paths, hidden_states)

    def drop(self, keep) -> None:
        self.rows = [self.rows[r] for r in keep]
        self.inner.drop(keep)


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_rows_that_copy_keep_drafting_what_they_draft_alone(
    random_target, examples, kind_drafter, monkeypatch, kind
):
    """A row whose proposal another drafter made (a copy: no context for this session, then
    that tree at accept) drafts on afterwards exactly as it does decoded alone (there through
    the session's one-row DraftSession)."""
    drafter = kind_drafter(kind)
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
        assert isinstance(inner, SESSION[kind])
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


@pytest.mark.parametrize("kind", ["eagle3", "dflash"])
def test_prefill_drop_memory_and_a_session_told_nothing(random_target, kind_drafter, kind):
    """The first proposal is empty (no features yet); after the prompts' forward each row holds
    its own prompt's state (DFlash: the memory of the rows decoded alone), a dropped row takes
    its own with it, and a session told nothing of a verification says so, naming the row."""
    drafter = kind_drafter(kind)
    session = batch_session(drafter, random_target, 2)
    prompts = [[5, 17, 42], [9, 3, 8]]
    contexts = [DraftContext(torch.tensor([p]), max_depth=4) for p in prompts]
    assert all(len(tree) == 0 for tree in session.propose(contexts))
    hidden = [
        random_target.forward(torch.tensor([p]), capture_layers=session.capture_layers)
        for p in prompts
    ]
    session.accept([DraftTree.empty()] * 2, [[], []], [h.hidden_states for h in hidden])
    decode = drafter.decode_settings(None)
    alone = drafter.new_session(random_target, sampling=SamplingSettings(), decode=decode)
    alone.accept(DraftTree.empty(), [], hidden[1].hidden_states)
    if kind == "dflash":
        assert session.extra_memory_bytes() == 2 * alone.extra_memory_bytes() > 0
    session.drop([1])
    after = DraftContext(torch.tensor([[*prompts[1], 7]]), max_depth=4)
    drafted = session.propose([after])[0].tokens.tolist()
    assert drafted == alone.propose(after).tokens.tolist() and len(drafted[0]) > 0
    longer = [DraftContext(torch.tensor([[*prompts[1], 99, 7]]), max_depth=4)]
    with pytest.raises(RuntimeError, match=r"features of 3 positions of row 0.*has 5"):
        session.propose(longer)


def _drafter(kind: str, target):
    torch.manual_seed(6)
    if kind == "peagle":
        return PEagleDrafter.build(PEagleConfig(num_depths=2), target).eval()
    if kind == "dflash":
        return DFlashDrafter.build(DFlashConfig(block_size=3), target).eval()
    return EagleDrafter.build(EagleConfig(), target).eval()


@pytest.mark.parametrize(
    ("kind", "options"),
    [("eagle3", dict(stop_below=0.3)), ("peagle", dict()), ("dflash", dict(stop_below=0.3))],
    ids=["eagle3-stopping", "peagle", "dflash-stopping"],
)
def test_sampled_rows_follow_the_target(kind, options):
    """Chi-square on the joint of the first two tokens of five rows with one prompt, batched
    with a row of another length, through the kind's session (q recorded per row and depth)."""
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    head = _drafter(kind, target)
    with torch.no_grad():
        perturb(head.parameters(), 0.5)  # an untrained drafter that still drafts varied tokens
    assert isinstance(batch_session(head, target, 4, **options), SESSION[kind])
    sampled_rows_follow_the_target(target, head, **options)


@pytest.mark.parametrize("kind", ["eagle3", "dflash", "distill"])
def test_a_session_of_several_rows_refuses_trees(random_target, kind):
    """Trees of a batch draft row by row (new_batch_session hands out RowSessions): the kind's
    session built for several rows directly says so."""
    if kind == "distill":
        drafter = DistillDrafter(perturbed(random_target.model, scale=0.05, seed=1))
    else:
        drafter = _drafter(kind, random_target)
    decode = drafter.decode_settings(None, tree_top_k=2)
    with pytest.raises(ValueError, match="drafts trees for one row, got 2"):
        drafter.session_class(drafter, random_target, 2, sampling=SamplingSettings(), decode=decode)
    rows = drafter.new_batch_session(random_target, 2, sampling=SamplingSettings(), decode=decode)
    assert isinstance(rows, RowSessions)
