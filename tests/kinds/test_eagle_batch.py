"""EAGLE's session (EagleSession; P-EAGLE's PEagleSession) serving a batch: the chains of the
rows drafted together, one head pass per depth for every row, each row drafting exactly what it
drafts decoded alone (a session of one row) (fp32: the same tokens, so the same per-step statistics),
with prompts of different lengths, per-row stop_below, rows that draft nothing or accept a tree
another drafter proposed, and sampled rows that follow the target's distribution."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import V, make_target, ragged, sampled_rows_follow_the_target, tiny_llama
from testkit import perturb

from specdraft.core import DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.sessions import BatchSession, DraftSession, RowSessions
from specdraft.inference import generate
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_session import EagleSession
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, PEagleSession

pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]

NEW = 16
GAMMA = 3
KINDS = ["eagle1", "eagle3", "peagle"]


def batch_session(drafter, target, rows: int, **settings) -> BatchSession:
    decode = drafter.decode_settings(None, **settings)
    return drafter.new_batch_session(target, rows, sampling=SamplingSettings(), decode=decode)


def step_stats(stats) -> tuple:
    """What a row drafted and accepted, step by step."""
    return stats.drafted, stats.reached_at, stats.accepted_at, stats.emitted_per_pass


@pytest.fixture
def drafts(monkeypatch) -> dict[tuple, list[int]]:
    """Every draft an EAGLE or P-EAGLE session made, for a batch or one row, by the context it
    drafted after and its max depth (a row's contexts differ at every step)."""
    made = {}
    for cls in (EagleSession, PEagleSession):
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
def head_passes(monkeypatch) -> list[int]:
    """The rows of every head pass of a session."""
    passes = []
    step = EagleSession._step

    def counting(self, tokens, *args, **kwargs):
        passes.append(tokens.shape[0])
        return step(self, tokens, *args, **kwargs)

    monkeypatch.setattr(EagleSession, "_step", counting)
    return passes


@pytest.mark.parametrize("stop_below", [0.0, 0.4], ids=["gamma", "stop_below"])
@pytest.mark.parametrize("kind", KINDS)
def test_batched_rows_draft_what_each_row_drafts_alone(
    random_target, examples, kind_drafter, drafts, head_passes, kind, stop_below
):
    drafter = kind_drafter(kind)
    native = PEagleSession if kind == "peagle" else EagleSession
    assert type(batch_session(drafter, random_target, 3, stop_below=stop_below)) is native
    options = dict(max_new_tokens=NEW, gamma=GAMMA, stop_below=stop_below)
    for size in (16, 3):
        prompts = ragged(examples, size)
        head_passes.clear()
        drafts.clear()
        out = generate(random_target, prompts, drafter, **options)
        passes, batched = list(head_passes), dict(drafts)
        drafts.clear()
        alone = [generate(random_target, p, drafter, **options) for p in prompts]
        assert out.rows() == [a.tokens[0].tolist() for a in alone]
        assert batched == drafts  # every step's draft, token for token
        assert [step_stats(s) for s in out.row_stats] == [step_stats(a.stats) for a in alone]
        assert out.stats.drafted > 0 and out.stats.accepted > 0
        # every row at once: at most gamma passes per step (P-EAGLE: one), never one per row
        steps = max(s.target_passes for s in out.row_stats)
        per_step = 1 if kind == "peagle" else GAMMA
        assert 0 < len(passes) <= steps * per_step and passes[0] == size
    if stop_below:  # the rule ended some chains, each row's where its own would end
        full = generate(random_target, prompts, drafter, max_new_tokens=NEW, gamma=GAMMA)
        assert out.stats.drafted < full.stats.drafted


def test_trees_draft_row_by_row(random_target, kind_drafter):
    decode = dict(tree_top_k=2)
    assert isinstance(
        batch_session(kind_drafter("eagle3"), random_target, 3, **decode), RowSessions
    )


def test_prompt_lookup_in_front_of_the_batch_session(random_target, examples, kind_drafter, drafts):
    """Copying (CopyingRows) drafts the rows whose context repeats; the session drafts the
    others, each as it drafts the row decoded alone."""
    drafter = kind_drafter("eagle3")
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


def test_rows_that_copy_keep_drafting_what_they_draft_alone(
    random_target, examples, kind_drafter, monkeypatch
):
    """A row whose proposal another drafter made (a copy: no context for this session, then
    that tree at accept) drafts on afterwards exactly as it does decoded alone."""
    drafter = kind_drafter("eagle3")
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
        assert isinstance(inner, EagleSession)
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


def test_a_session_told_nothing_of_a_verification_says_so(random_target, kind_drafter):
    session = batch_session(kind_drafter("eagle3"), random_target, 2)
    contexts = [DraftContext(torch.tensor([[5, 17, 42]]), max_depth=4)] * 2
    assert all(len(tree) == 0 for tree in session.propose(contexts))  # no features yet
    hidden = random_target.forward(
        torch.tensor([[5, 17, 42]]), capture_layers=session.capture_layers
    )
    session.accept([DraftTree.empty()] * 2, [[], []], [hidden.hidden_states] * 2)
    longer = [DraftContext(torch.tensor([[5, 17, 42, 99, 7]]), max_depth=4)] * 2
    with pytest.raises(RuntimeError, match=r"features of 3 positions of row 0.*has 5"):
        session.propose(longer)


@pytest.mark.parametrize(
    ("kind", "options"),
    [("eagle3", dict(stop_below=0.3)), ("peagle", dict())],
    ids=["eagle3-stopping", "peagle"],
)
def test_sampled_rows_follow_the_target(kind, options):
    """Chi-square on the joint of the first two tokens of five rows with one prompt, batched
    with a row of another length, through the batch session (q recorded per row and depth)."""
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    torch.manual_seed(6)
    if kind == "peagle":
        head = PEagleDrafter.build(PEagleConfig(num_depths=2), target).eval()
    else:
        head = EagleDrafter.build(EagleConfig(), target).eval()
    with torch.no_grad():
        perturb(head.parameters(), 0.5)  # an untrained head that still drafts varied tokens
    assert isinstance(batch_session(head, target, 4, **options), EagleSession)
    sampled_rows_follow_the_target(target, head, **options)
