"""DFlash's session: drafting for a prompt decoded alone (a batch of one) or for every row of a
batch in one block pass, on the keys and values of the context's target features; the drafter
is kinds/dflash/dflash.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.position_tree import slot_drafts
from specdraft.drafters.sessions import BatchSession, check_features_known, check_trees_alone
from specdraft.kinds.eagle.eagle_session import verified_states

if TYPE_CHECKING:
    from specdraft.kinds.dflash.dflash import DFlashDrafter

# Per layer, the keys and values the block attends to besides its own: (batch, kv_heads, n, dim).
ContextKV = list[tuple[torch.Tensor, torch.Tensor]]


class DFlashSession(BatchSession):
    """One generate call's drafting for its rows (one for a prompt decoded alone): per layer,
    the keys and values of each row's context features (positions 0 .. known - 1, from the
    target's hidden states as they arrive). One block pass, after each drafting row's anchor
    (its context's last token, pending), drafts every row's chain of its slots' draws
    (drafting.draft_chains: its depth, its stop_below), or for a session of one row with
    tree_top_k > 1 a tree of their top candidates (drafters/position_tree.py; a batch drafts
    trees row by row). A row drafts nothing before the prompt's forward hands it the context's
    features.

    State: per layer, one buffer of keys and one of values, (rows, kv_heads, capacity, dim),
    row r's context in columns 0 .. known[r] - 1 (its positions 0 .. known[r] - 1) and zeros
    after them (finite: a masked key's value still meets a zero weight). Where rows know
    different counts, the block's mask shows each row its own known columns, then its whole
    block; where they know the same (one row always), the block runs without a mask.

    `accept` gets each row's verification forward's hidden states at `capture_layers`, (1,
    pending + n, hidden): the pending tokens, then the tree's n nodes; it keeps the pending rows
    and the accepted path's (what the target verified, in order) and writes their keys and
    values, every row's in one call, after the row's known columns; the buffers grow by
    doubling. A row whose context is None drafts nothing; its accept (maybe of another
    drafter's tree, a copy) still appends the verified positions' keys and values, so its next
    block is exact.
    """

    def __init__(
        self,
        drafter: DFlashDrafter,
        target,
        rows: int = 1,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        check_trees_alone(self, rows, decode, drafter.drafts_trees)
        self.drafter = drafter
        self.sampling, self.decode, self.generator = sampling, decode, generator
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.device = drafter.fc.weight.device
        self.context: ContextKV | None = None  # per layer (rows, kv_heads, capacity, head_dim)
        self.known = [0] * rows  # per row: context positions whose keys and values are held
        self.names_rows = rows > 1  # errors name the row of a batch

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
            where = r if self.names_rows else None
            check_features_known(type(self).__name__, self.known[r], length, where)
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
        mask = None  # rows that know the same count see all: no mask
        if len({self.known[r] for r in drafting}) > 1:
            sees = torch.arange(columns, device=self.device)[None] < known[:, None]  # (n, cols)
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
        """Each row's draft from (rows, deepest, hidden) states of its block's drafting slots,
        as P-EAGLE's slots (position_tree.slot_drafts); `anchors` (rows,), the tokens in slot 0,
        are for a kind whose slots read the token before them (DSpark)."""
        return slot_drafts(
            self.drafter.draft_logits(h), depths, decode=self.decode, sampling=self.sampling,
            generator=self.generator, vocab=None, device=self.device,
        )  # fmt: skip

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
        joined, counts = verified_states(self, trees, paths, hidden_states)
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
