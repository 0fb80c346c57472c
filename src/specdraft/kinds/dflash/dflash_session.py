"""DFlash's sessions: drafting one sequence (DFlashSession) or every row of a batch in one block
pass (DFlashBatchSession), on the keys and values of the context's target features; the
drafter is kinds/dflash/dflash.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.position_tree import position_tree
from specdraft.drafters.sessions import BatchSession, DraftSession, check_features_known
from specdraft.drafting import draft_chains
from specdraft.kinds.eagle.eagle_session import verified_rows

if TYPE_CHECKING:
    from specdraft.kinds.dflash.dflash import DFlashDrafter

# Per layer, the keys and values the block attends to besides its own: (batch, kv_heads, n, dim).
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


# --- session (inference) -----------------------------------------------------------------------


class DFlashSession(DraftSession):
    """One generate call's drafting state: per layer, the keys and values of the context's
    features (positions 0 .. known - 1, from the target's hidden states as they arrive).

    `accept` gets the verification forward's hidden states at `capture_layers`, (batch, pending
    + n, hidden): the pending tokens, then the tree's n nodes; it keeps the pending rows and the
    accepted path's (what the target verified, in order) and appends their keys and values.
    Every position of the context but its last token (the anchor, pending) is then known.
    `propose` runs the block after the anchor once and drafts a chain of the slots' draws, or
    with tree_top_k > 1 a tree of their top candidates (drafters/position_tree.py); the first
    proposal (before the prompt's forward) is empty, as is one after a one-token prompt (no
    context to draft from).
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        self.drafter = drafter
        self.sampling = sampling
        self.decode = decode
        self.generator = generator
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.context: ContextKV | None = None
        self.known = 0  # context positions whose keys and values are in `context`

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        seq = context.tokens  # (batch, length)
        length = seq.shape[1]
        depth = min(self.decode.gamma, self.drafter.drafts_per_block, context.max_depth)
        if self.context is None or self.known == 0 or depth <= 0:
            return DraftTree.empty(seq.shape[0], seq.device)
        check_features_known("DFlashSession", self.known, length)
        d = self.drafter
        device = d.fc.weight.device
        tokens = d.block_tokens(seq[:, -1].to(device))  # (batch, B)
        positions = (length - 1 + torch.arange(d.block_size, device=device))[None]
        h = d.block_states(tokens, positions.expand(tokens.shape[0], -1), self.context)
        first = d.first_slot
        return self.draft(h[:, first : first + depth], seq)

    def draft(self, h: torch.Tensor, seq: torch.Tensor) -> DraftTree:
        """The draft from (1, depth, hidden) states of the block's drafting slots, after the
        context `seq` (1, length): a chain of the slots' draws (ended early by stop_below), or
        a tree of their top candidates, as P-EAGLE's slots (drafters/position_tree.py)."""
        logits = self.drafter.draft_logits(h[0])  # (depth, vocab)
        return position_tree(
            logits, decode=self.decode, sampling=self.sampling, generator=self.generator,
            vocab=None, device=seq.device,
        )  # fmt: skip

    @torch.no_grad()
    def accept(
        self,
        tree: DraftTree,
        path: list[int],
        hidden_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        rows = verified_rows(self, tree, path, hidden_states)
        d = self.drafter
        device = d.fc.weight.device
        index = torch.tensor(rows, device=next(iter(hidden_states.values())).device)
        kept = {i: hidden_states[i].index_select(1, index).to(device) for i in self.capture_layers}
        at = self.known + torch.arange(len(rows), device=device)[None]  # (1, kept)
        new = d.context_kv(d.features(kept), at)
        if self.context is None:
            self.context = new
        else:
            self.context = [
                (torch.cat([k, k2], dim=2), torch.cat([v, v2], dim=2))
                for (k, v), (k2, v2) in zip(self.context, new, strict=True)
            ]
        self.known += len(rows)

    def extra_memory_bytes(self) -> int:
        """The context's keys and values."""
        if self.context is None:
            return 0
        return sum(t.numel() * t.element_size() for kv in self.context for t in kv)


class DFlashBatchSession(BatchSession):
    """DFlashSession for the rows of a batch: one block pass drafts every drafting row's chain.
    Each row drafts what DFlashSession drafts for it alone (its depth, its stop_below, the same
    tokens at T = 0 and the same q at T > 0: drafting.draft_chains cuts each row's chain where its
    own would end).

    State: per layer, one buffer of keys and one of values, (rows, kv_heads, capacity, dim),
    row r's context in columns 0 .. known[r] - 1 (its positions 0 .. known[r] - 1) and zeros
    after them (finite: a masked key's value still meets a zero weight). Rows know different
    counts, so the block's mask shows each row its own known columns, then its whole block.
    `accept` computes every row's new keys and values in one call and writes them after the
    row's known columns; the buffers grow by doubling.

    A row whose context is None drafts nothing; its accept (maybe of another drafter's tree, a
    copy) still appends the verified positions' keys and values, so its next block is exact.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        rows: int,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        self.drafter = drafter
        self.sampling, self.decode, self.generator = sampling, decode, generator
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.device = drafter.fc.weight.device
        self.context: ContextKV | None = None  # per layer (rows, kv_heads, capacity, head_dim)
        self.known = [0] * rows  # per row: context positions whose keys and values are held

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        d = self.drafter
        limit = min(self.decode.gamma, d.drafts_per_block)
        depths = []
        for r, context in enumerate(contexts):
            depth = 0 if context is None else min(limit, context.max_depth)
            if self.known[r] == 0 or depth <= 0:  # no features yet, or no token may follow
                depths.append(0)
                continue
            length = context.tokens.shape[1]
            check_features_known("DFlashBatchSession", self.known[r], length, row=r)
            depths.append(depth)
        drafting = [r for r, depth in enumerate(depths) if depth > 0]
        trees = [DraftTree.empty(1, self.device) for _ in contexts]
        if not drafting:
            return trees
        # 1. Each drafting row's block (its anchor, then mask tokens) at its own positions,
        # seeing its own known context columns and its whole block: one pass for all.
        known = torch.tensor([self.known[r] for r in drafting], device=self.device)  # (n,)
        columns = max(self.known[r] for r in drafting)
        context = [(k[:, :, :columns], v[:, :, :columns]) for k, v in self.context]
        if len(drafting) < len(contexts):  # rows that draft nothing stay out of the pass
            index = torch.tensor(drafting, device=self.device)
            context = [(k.index_select(0, index), v.index_select(0, index)) for k, v in context]
        anchors = torch.stack([contexts[r].tokens[0, -1] for r in drafting]).to(self.device)
        tokens = d.block_tokens(anchors)  # (n, B)
        positions = known[:, None] + torch.arange(d.block_size, device=self.device)  # (n, B)
        sees = torch.arange(columns, device=self.device)[None] < known[:, None]  # (n, columns)
        block = torch.ones(len(drafting), d.block_size, dtype=torch.bool, device=self.device)
        mask = torch.cat([sees, block], dim=1)[:, None, None].expand(-1, -1, d.block_size, -1)
        h = d.block_states(tokens, positions, context, mask)  # (n, B, hidden)
        deepest, first = max(depths), d.first_slot
        # 2. Each row's chain from its drafting slots' states
        chains = self.draft_rows(
            h[:, first : first + deepest], anchors, [depths[r] for r in drafting]
        )
        for r, chain in zip(drafting, chains, strict=True):
            trees[r] = chain
        return trees

    def draft_rows(
        self, h: torch.Tensor, anchors: torch.Tensor, depths: list[int]
    ) -> list[DraftTree]:
        """Each row's chain from (rows, deepest, hidden) states of its block's drafting slots
        (`anchors` (rows,) the tokens in slot 0), drawn slot by slot (q recorded when
        sampling); a slot does not read the token drawn before it, so the step only hands over
        the next slot's logits."""
        logits = self.drafter.draft_logits(h)  # (rows, deepest, vocab)
        return draft_chains(
            logits[:, 0],
            lambda token, i: logits[:, i + 1],
            depths=depths,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
        )

    @torch.no_grad()
    def accept(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
    ) -> None:
        """Append each row's verified positions (its pending token(s), then its accepted nodes,
        of any drafter's tree) to its context; every row's keys and values in one call."""
        d = self.drafter
        picked = [
            verified_rows(self, tree, path, hidden)
            for tree, path, hidden in zip(trees, paths, hidden_states, strict=True)
        ]
        verified = list(zip(hidden_states, picked, strict=True))
        joined = {
            layer: torch.cat([h[layer][0, rows].to(self.device) for h, rows in verified])[None]
            for layer in self.capture_layers
        }  # layer -> (1, verified positions of every row, hidden)
        counts = [len(rows) for rows in picked]
        grown = [k + n for k, n in zip(self.known, counts, strict=True)]
        row = torch.repeat_interleave(
            torch.arange(len(counts), device=self.device), torch.tensor(counts, device=self.device)
        )  # (total,) each verified position's row
        column = torch.cat(
            [torch.arange(k, g, device=self.device) for k, g in zip(self.known, grown, strict=True)]
        )  # (total,) its position: the row's next column
        new = d.context_kv(d.features(joined), column[None])  # per layer (1, kv, total, dim)
        self._make_room(max(grown), new)
        for (k, v), (k2, v2) in zip(self.context, new, strict=True):
            k[row, :, column] = k2[0].transpose(0, 1).to(k.dtype)  # (total, kv_heads, dim)
            v[row, :, column] = v2[0].transpose(0, 1).to(v.dtype)
        self.known = grown

    def _make_room(self, columns: int, like: ContextKV) -> None:
        """Grow the buffers (doubling, zero-filled) to hold `columns` per row; `like`: keys and
        values of this layout (1, kv_heads, n, head_dim) per layer."""
        held = 0 if self.context is None else self.context[0][0].shape[2]
        if columns <= held:
            return
        rows, capacity = len(self.known), max(columns, 2 * held)
        old = self.context
        self.context = [
            (
                k.new_zeros(rows, k.shape[1], capacity, k.shape[3]),
                v.new_zeros(rows, v.shape[1], capacity, v.shape[3]),
            )
            for k, v in like
        ]
        if old is not None:
            for (k, v), (k_old, v_old) in zip(self.context, old, strict=True):
                k[:, :, :held], v[:, :, :held] = k_old, v_old

    def drop(self, keep: Sequence[int]) -> None:
        self.known = [self.known[r] for r in keep]
        if self.context is not None:
            index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
            self.context = [
                (k.index_select(0, index), v.index_select(0, index)) for k, v in self.context
            ]

    def extra_memory_bytes(self) -> int:
        """The context's key and value buffers (their whole capacity: memory held)."""
        if self.context is None:
            return 0
        return sum(t.numel() * t.element_size() for kv in self.context for t in kv)
