"""The sessions the loop drives: a drafter's per-call drafting state.

A kind's `Drafter.new_session` builds a DraftSession for one sequence, driven with two calls per
step:

    tree = session.propose(context)        # draft a tree after the context's last token
    session.accept(tree, path, hidden)     # after the target's pass: the accepted nodes

`accept` lets a session keep its own KV cache on the accepted path without recomputing it. A chain
is a tree with one child per node, so both go through the same code. The loop drives every call
as a batch (inference/generate.py): a BatchSession takes one entry per active row, and a prompt
decoded alone is a batch of one (the kind's session of one row, or a RowSessions of its one
DraftSession).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specdraft.core import DecodeConfig, DraftContext, DraftTree


class DraftSession:
    """Per-call drafting state (caches, adaptive gamma); built by `Drafter.new_session`. Every
    method the loop calls is declared here with its default, so a kind overrides only what it
    uses."""

    # The target hidden-state ids `accept` needs (a drafter fed by the target's features, like
    # EAGLE); empty for the others. The loop captures them in every verification forward.
    capture_layers: Sequence[int] = ()
    # Verification passes of a tree copied from the context instead of drafted (copying).
    copied_passes: int = 0
    # True when verify_sampled keeps tokens the target would not have sampled: output drifts
    # from the target's distribution and the loop marks the run lossy.
    lossy: bool = False
    # True for a session that drafts on the target's own KV cache (bind_cache: LayerSkip), which
    # only the loop's target passes keep
    drafts_on_target_cache: bool = False

    def propose(self, context: DraftContext) -> DraftTree:
        raise NotImplementedError

    def accept(
        self,
        tree: DraftTree,
        path: list[int],
        hidden_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Called after EVERY verification forward: the first (the prompt, with no tree), the
        ones after this session's proposals, and the ones that verified a tree some other
        drafter proposed (the copying hybrid's), so `tree` may not be this session's own.
        `path`: the accepted node indices of `tree`, root to leaf (maybe []). `hidden_states`
        (only when capture_layers is not empty): that forward's hidden states at those layers,
        each (batch, pending + n, hidden), the pending tokens first, then the tree's n nodes in
        node order.
        """

    def bind_cache(self, cache) -> None:
        """Given the target's KV cache before the first step, for a session that drafts on it
        (LayerSkip); the others keep their own."""

    def verify(self, tree: DraftTree, logits_to_keep: int):
        """The verification forward of `tree`, for a session that verifies its own drafts more
        cheaply than the target's full forward (LayerSkip: the late layers only); None: the loop
        runs the full forward."""
        return None

    def verify_sampled(
        self, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """At temperature > 0, the accepted path and the token after it under this session's
        own rule (p: the target's processed distribution at the root, then at each node); None:
        the loop's lossless rejection sampling. A rule that keeps tokens the target would not
        have sampled sets `lossy` (Medusa's typical acceptance)."""
        return None

    def extra_memory_bytes(self) -> int:
        """Bytes of drafting state beyond the weights (the drafter's KV cache), now."""
        return 0


class BatchSession:
    """The drafting of the rows of one generate call, a prompt alone being one row
    (`Drafter.new_batch_session`): the loop's calls of a DraftSession, each taking one entry per
    active row, and `drop` when rows finish. Row r's context, tree, path and hidden states are
    batch-1 objects exactly as a DraftSession gets them, so a kind's single-sequence session
    serves a batch unchanged (`RowSessions`, the default); a kind that drafts the rows of a
    batch in one pass names one session for one row or many (`Drafter.session_class`, said in
    `batch_drafts`), whose one-row session it hands out as a DraftSession (`OneRow`)."""

    capture_layers: Sequence[int] = ()
    lossy: bool = False
    drafts_on_target_cache: bool = False  # DraftSession's, for a batch of one

    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        """One tree per active row; a row whose context is None drafts nothing (an empty tree),
        and its `accept` may then get a tree another drafter proposed (a copy: copying puts
        prompt lookup in front of any batch session, drafters/prompt_lookup.py's CopyingRows),
        which the row's next context includes as far as it was accepted."""
        raise NotImplementedError

    def accept(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
    ) -> None:
        """After every verification forward, per active row (DraftSession.accept's arguments)."""

    def bind_cache(self, cache) -> None:
        """DraftSession.bind_cache, for a batch of one (LayerSkip drafts on the target's cache)."""

    def verify(self, trees: Sequence[DraftTree], logits_to_keep: int):
        """DraftSession.verify, for a batch of one; None: the loop's full forward."""
        return None

    def verify_sampled(
        self, row: int, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """Row `row`'s DraftSession.verify_sampled."""
        return None

    def drop(self, keep: Sequence[int]) -> None:
        """Keep only the active rows `keep` (ascending indices into the rows active until now)."""

    def row_copied_passes(self, row: int) -> int:
        """Passes of active row `row` whose draft was copied from its context (copying)."""
        return 0

    def extra_memory_bytes(self) -> int:
        return 0


class RowSessions(BatchSession):
    """A batch drafted row by row: one DraftSession per row, each seeing only its own row. Exact
    for every kind whose session keeps its own state; drafting costs one drafter pass per row
    where a batch-native session would run one for the batch."""

    def __init__(self, sessions: Sequence[DraftSession]) -> None:
        self.sessions = list(sessions)
        self.capture_layers = list(self.sessions[0].capture_layers)
        self.lossy = self.sessions[0].lossy
        self.drafts_on_target_cache = self.sessions[0].drafts_on_target_cache
        self.finished_copies = 0  # copied passes of rows already dropped
        self.alone = False  # bound to the target's cache as a prompt decoded alone

    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        return [
            DraftTree.empty() if context is None else session.propose(context)
            for session, context in zip(self.sessions, contexts, strict=True)
        ]

    def accept(self, trees, paths, hidden_states) -> None:
        for session, tree, path, hidden in zip(
            self.sessions, trees, paths, hidden_states, strict=True
        ):
            session.accept(tree, path, hidden)

    def bind_cache(self, cache) -> None:
        """A prompt decoded alone: its session may draft on the target's cache (and `verify` its
        own drafts there). A batch's rows never share it, even once one row is left."""
        self.alone = len(self.sessions) == 1
        if self.alone:
            self.sessions[0].bind_cache(cache)

    def verify(self, trees, logits_to_keep):
        if self.alone:
            return self.sessions[0].verify(trees[0], logits_to_keep)
        return None

    def verify_sampled(self, row, tree, p, generator):
        return self.sessions[row].verify_sampled(tree, p, generator)

    def drop(self, keep: Sequence[int]) -> None:
        self.sessions = [self.sessions[r] for r in keep]

    def row_copied_passes(self, row: int) -> int:
        return self.sessions[row].copied_passes

    def extra_memory_bytes(self) -> int:
        return sum(session.extra_memory_bytes() for session in self.sessions)


class OneRow(DraftSession):
    """A BatchSession of one row driven as a DraftSession: how a kind whose one session drafts
    the rows of a batch together (EAGLE's) hands out a single sequence's session (RowSessions'
    rows, code that walks one sequence's steps itself)."""

    def __init__(self, rows: BatchSession) -> None:
        self.rows = rows
        self.capture_layers = rows.capture_layers
        self.lossy = rows.lossy

    def propose(self, context: DraftContext) -> DraftTree:
        return self.rows.propose([context])[0]

    def accept(
        self,
        tree: DraftTree,
        path: list[int],
        hidden_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        self.rows.accept([tree], [path], [hidden_states])

    def verify_sampled(self, tree: DraftTree, p: torch.Tensor, generator):
        return self.rows.verify_sampled(0, tree, p, generator)

    def extra_memory_bytes(self) -> int:
        return self.rows.extra_memory_bytes()


def check_trees_alone(
    session: BatchSession, rows: int, decode: DecodeConfig, drafts_trees: bool = True
) -> None:
    """A session drafts a tree (tree_top_k > 1, for a kind that `drafts_trees`) for one row
    only: ValueError for a session of several, whose trees the batch drafts row by row."""
    if drafts_trees and not decode.chain and rows != 1:
        raise ValueError(
            f"{type(session).__name__} drafts trees for one row, got {rows}: a batch drafts "
            "trees row by row (Drafter.new_batch_session)"
        )


def check_features_known(session: str, known: int, length: int, row: int | None = None) -> None:
    """The contract of a session drafting from the target's features: it has them for every
    position of the context but the last (whose features come with the next verification).
    RuntimeError naming the loop's duty where it does not."""
    if known != length - 1:
        where, calls = (
            (f" of row {row}", "accept(trees, paths, hidden_states)")
            if row is not None
            else ("", "accept(tree, path, hidden_states)")
        )
        raise RuntimeError(
            f"{session} has the target's features of {known} positions{where} but the context "
            f"has {length}: the loop must call {calls} after every verification forward, and "
            "pass the context that forward extended"
        )
