"""The loop's state for a batch of sequences: one KV cache whose rows hold different tokens.

Rows of a batch accept different numbers of tokens each step, so after a step their caches hold
different lengths. `BatchCache` keeps one HF cache of C columns for every row and, per row,
which columns hold one of its tokens (`valid`) and at which position (`positions`); a column
that holds nothing for a row (padding of a shorter prompt, a node its verification rejected, a
longer row's accepted node) is a hole that row's attention mask hides. Each verification appends
the same columns to every row; `keep` then gathers each row's kept entries to the front of the
step's columns and crops the rest, so the cache grows by the longest row's accepted tokens, and
`compact` squeezes the holes out of every row once they are most of the cache. Finished rows
leave the batch (`select_rows`).

What a row computes is what it computes alone: each of its queries attends to exactly its own
tokens (its valid columns, its pending tokens, its tree ancestors, within each layer's window)
at exactly its own positions. Batched arithmetic can still differ from a batch of one in the last
bits (matrix products of other shapes sum in another order): in fp32 greedy output is the same;
in bf16 a near-tie between two tokens can go either way, as between any two kernels.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdraft.attention import AttentionLayout, Mask
from specdraft.core import DraftTree, ancestors, float_mask, kv_bytes

# squeeze the holes out when the cache's columns exceed the longest row by this factor
COMPACT_FACTOR = 2


class CacheColumns:
    """A DynamicCache's keys and values as columns shared by the rows of a batch: what
    BatchCache moves when rows keep different tokens or leave. A drafter's drafters/lean.py
    layer moves its own buffers with the same three calls."""

    def __init__(self, cache: DynamicCache) -> None:
        self.cache = cache

    @property
    def length(self) -> int:
        """The columns held."""
        return self.cache.get_seq_length()

    def memory_bytes(self) -> int:
        return kv_bytes(self.cache)

    def crop(self, columns: int) -> None:
        """Keep the first `columns` columns."""
        drop = self.cache.get_seq_length() - columns
        if drop > 0:
            self.cache.crop(-drop)  # a negative crop drops the last ones

    def gather(self, index: torch.Tensor, start: int) -> None:
        """Every layer's keys and values: columns [start, ...) replaced by, for each row r, the
        columns start + index[r] (index (rows, w))."""
        for layer in self.cache.layers:
            for name in ("keys", "values"):
                kv = getattr(layer, name)  # (rows, heads, columns, head_dim)
                a, h, _, d = kv.shape
                picked = kv[:, :, start:].gather(
                    2, index[:, None, :, None].expand(a, h, index.shape[1], d)
                )
                setattr(layer, name, torch.cat([kv[:, :, :start], picked], dim=2))

    def select_rows(self, index: torch.Tensor) -> None:
        """Only the rows `index` stay."""
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)


class BatchCache:
    """A KV cache shared by the active rows, with each row's valid columns and positions: the
    target's DynamicCache (`cache`), or the buffers of a drafter's layer (`store`: anything with
    CacheColumns' crop, gather and select_rows)."""

    def __init__(self, rows: int, device: torch.device, store=None) -> None:
        self.cache = DynamicCache() if store is None else None
        self.store = CacheColumns(self.cache) if store is None else store
        self.device = device
        self.valid = torch.zeros(rows, 0, dtype=torch.bool, device=device)  # (A, C)
        self.positions = torch.zeros(rows, 0, dtype=torch.long, device=device)  # (A, C)
        self.lengths = torch.zeros(rows, dtype=torch.long, device=device)  # tokens of each row

    @property
    def columns(self) -> int:
        return self.valid.shape[1]

    def verification_inputs(
        self,
        pending: Sequence[torch.Tensor],
        trees: Sequence[DraftTree],
        dtype: torch.dtype,
        layout: AttentionLayout | None,
        pad_id: int,
    ) -> tuple[torch.Tensor, Mask, torch.Tensor, int, int]:
        """The input ids (A, P + N), attention mask(s) (A, 1, P + N, C + P + N) and position ids
        (A, P + N) of one verification forward, and P and N. Row r's pending tokens (1-D) end at
        column P - 1, so every row's root is there, and its tree's nodes follow from column P;
        shorter rows are padded on the left of their pending tokens and after their nodes, and
        a padding query sees only itself (its output and its cache entry are never used)."""
        rows, past, device = len(pending), self.columns, self.device
        counts = torch.tensor([len(p) for p in pending], dtype=torch.long, device=device)
        sizes = torch.tensor([len(t) for t in trees], dtype=torch.long, device=device)
        P, N = int(counts.max()), int(sizes.max())
        width = P + N
        column = torch.arange(width, device=device)[None]  # (1, W) a step column's index
        first = (P - counts)[:, None]  # (A, 1) the column of each row's first pending token
        pending_real = (column >= first) & (column < P)  # (A, W)
        node = column - P  # a node column's node index
        node_real = (node >= 0) & (node < sizes[:, None])
        real = pending_real | node_real
        # the ids: pending tokens padded on the left, nodes on the right
        ids = torch.full((rows, width), pad_id, dtype=torch.long, device=device)
        # (reversed, padded on the right, reversed back: padding_side="left" needs torch 2.6)
        reversed_ = [p.to(device).flip(0) for p in pending]
        left = torch.nn.utils.rnn.pad_sequence(reversed_, batch_first=True, padding_value=pad_id)
        ids[:, :P] = left.flip(1)
        depths = torch.zeros(rows, max(N, 1), dtype=torch.long, device=device)
        if N:
            for r, tree in enumerate(trees):  # small: each row's tokens and depths
                if len(tree):
                    ids[r, P : P + len(tree)] = tree.tokens[0].to(device)
                    depths[r, : len(tree)] = torch.tensor(tree.depths, device=device)
        # positions: a pending token's is its row's length plus its rank, a node's the root's
        # plus its depth; a padding query's its row's length (never used)
        start = self.lengths[:, None]
        positions = torch.where(pending_real, start + column - first, start)
        if N:
            at_node = start + counts[:, None] - 1 + depths[:, :N]
            positions[:, P:] = torch.where(node_real[:, P:], at_node, start)
        # who sees whom: the row's valid cache columns; pending tokens causally among themselves;
        # nodes all of the row's pending tokens and their own ancestors (a chain's: those before)
        allowed = torch.zeros(rows, width, past + width, dtype=torch.bool, device=device)
        allowed[:, :, :past] = self.valid[:, None, :]
        new = allowed[:, :, past:]  # a view: (A, W, W) the step's own columns
        new[:, :P, :P] = (
            pending_real[:, None, :P] & torch.ones(P, P, dtype=torch.bool, device=device).tril()
        )
        if N:
            new[:, P:, :P] = pending_real[:, None, :P]
            new[:, P:, P:] = torch.ones(N, N, dtype=torch.bool, device=device).tril()
            for r, tree in enumerate(trees):  # a tree's own ancestors, where not a chain
                if len(tree) and not tree.is_chain:
                    n = len(tree)
                    new[r, P : P + n, P : P + n] = ancestors(tree.parents).to(device)
            new[:, :, P:] &= node_real[:, None, P:]
        allowed &= real[:, :, None]
        # a padding query sees itself alone (no row of -inf)
        new |= torch.diag_embed(~real)
        keys = torch.cat([self.positions, positions], dim=1)
        if layout is not None and layout.slides:
            mask = layout.masks(allowed, positions, keys, dtype)
        else:
            mask = float_mask(allowed, dtype)[:, None]
        return ids, mask, positions, P, N

    def keep(self, columns: Sequence[list[int]]) -> None:
        """After a verification forward of width W appended to every row: keep row r's entries
        at the step's local columns `columns[r]` (ascending: its pending tokens and accepted
        nodes), gathered to the front of the step's columns; the rest become holes or go."""
        rows, past = len(columns), self.columns
        counts = torch.tensor([len(c) for c in columns], dtype=torch.long, device=self.device)
        width = int(counts.max()) if rows else 0
        padded = [list(cols) + [0] * (width - len(cols)) for cols in columns]
        index = torch.tensor(padded, dtype=torch.long, device=self.device).reshape(rows, width)
        self.store.gather(index, past)
        valid = torch.arange(width, device=self.device)[None] < counts[:, None]
        positions = self.lengths[:, None] + torch.arange(width, device=self.device)[None]
        self.valid = torch.cat([self.valid, valid], dim=1)
        self.positions = torch.cat([self.positions, positions], dim=1)
        self.lengths = self.lengths + counts
        if self.columns > COMPACT_FACTOR * max(int(self.lengths.max()), 1):
            self.compact()

    def append_tokens(self, n: int = 1) -> None:
        """After a forward that appended n columns for every row: each row's next n tokens (a
        drafter's drafted level, or pairs fed alike to rows without holes), at the row's next
        positions."""
        rows = self.valid.shape[0]
        self.valid = torch.cat(
            [self.valid, torch.ones(rows, n, dtype=torch.bool, device=self.device)], dim=1
        )
        step = torch.arange(n, device=self.device)[None]
        self.positions = torch.cat([self.positions, self.lengths[:, None] + step], dim=1)
        self.lengths = self.lengths + n

    @property
    def dense(self) -> bool:
        """Whether every row holds a token in every column (no holes; rows of equal length)."""
        return bool(self.valid.all())

    def crop(self, columns: int) -> None:
        """Drop every column from `columns` on (what was appended since the cache had that many
        columns: a drafter's drafted levels)."""
        if self.columns > columns:
            self.store.crop(columns)
            self.valid = self.valid[:, :columns]
            self.positions = self.positions[:, :columns]
            self.lengths = self.valid.sum(1)

    def truncate(self, lengths: Sequence[int]) -> None:
        """Row r keeps its first lengths[r] tokens (no more than it holds): the entries of later
        positions become holes (a drafter's cache after its rejected drafts), and the last
        columns, where no row holds one, go (so rows that keep alike stay without holes)."""
        keep = torch.minimum(
            torch.as_tensor(list(lengths), dtype=torch.long, device=self.device), self.lengths
        )
        self.valid = self.valid & (self.positions < keep[:, None])
        self.lengths = keep
        held = self.valid.any(0).nonzero()  # columns no row holds any more go at the end
        self.crop(int(held.max()) + 1 if len(held) else 0)
        if self.columns > COMPACT_FACTOR * max(int(self.lengths.max()), 1):
            self.compact()

    def compact(self) -> None:
        """Squeeze every row's holes out: its tokens move to the first columns, in order."""
        longest = int(self.lengths.max())
        # a stable sort puts each row's valid columns first, in their order
        order = torch.sort((~self.valid).to(torch.uint8), dim=1, stable=True).indices
        index = order[:, :longest]
        self.store.gather(index, 0)
        self.valid = torch.gather(self.valid, 1, index)
        self.positions = torch.gather(self.positions, 1, index)

    def select_rows(self, keep: Sequence[int]) -> None:
        """Only the rows `keep` (indices into the active rows) stay."""
        index = torch.tensor(list(keep), dtype=torch.long, device=self.device)
        self.store.select_rows(index)
        self.valid = self.valid.index_select(0, index)
        self.positions = self.positions.index_select(0, index)
        self.lengths = self.lengths.index_select(0, index)
