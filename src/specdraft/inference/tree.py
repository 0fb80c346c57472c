"""Tree attention: the mask, positions and paths that let one forward pass verify a draft tree.

One verification forward feeds `pending` tokens (emitted but not yet in the KV cache; the whole
prompt on the first step, the last bonus token after that) followed by the tree's n nodes. The
pending tokens attend causally, as in plain decoding; each node attends to the cache, the pending
tokens, its ancestors and itself, at position `past + pending - 1 + depth`. Then every node sees
exactly the sequence it would see if its root-to-leaf path were decoded alone, which is what makes
tree verification exact. A chain's tree mask is the plain causal mask, so chains need neither.
`SequenceCache` is the target's cache of a prompt decoded alone (a plain cache, compacted to each
accepted path).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import DynamicCache

from specdraft.attention import AttentionLayout, Mask
from specdraft.core import DraftTree, ancestors, compact, float_mask


def tree_attention(
    tree: DraftTree,
    past: int,
    pending: int,
    dtype: torch.dtype,
    device: torch.device,
    layout: AttentionLayout | None = None,
) -> tuple[Mask, torch.Tensor | None]:
    """The 4D float mask (1, 1, pending + n, past + pending + n) and position ids
    (1, pending + n) for one verification forward; (None, None) when the tree is a chain, for
    which the model's own causal mask and positions are identical and cheaper. With the target's
    `layout` (specdraft/attention.py), sliding-window layers get their window applied by
    position, as a dict of masks per layer type where the model mixes types."""
    if tree.is_chain:
        return None, None
    n = len(tree)
    allowed = torch.ones(pending + n, past + pending + n, dtype=torch.bool)
    allowed[:, past:] = False
    allowed[:pending, past : past + pending] = torch.ones(pending, pending).tril().bool()
    allowed[pending:, past : past + pending] = True
    allowed[pending:, past + pending :] = ancestors(tree.parents)
    positions = list(range(past, past + pending)) + [past + pending - 1 + d for d in tree.depths]
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)
    if layout is not None and layout.slides:
        keys = torch.cat([torch.arange(past, device=device), position_ids[0]])
        return layout.masks(allowed.to(device), position_ids[0], keys, dtype), position_ids
    return float_mask(allowed, dtype)[None, None].to(device), position_ids


class SequenceCache:
    """The target's KV cache for a batch of one, with BatchCache's calls (specdraft/batch.py):
    one sequence needs no columns of holes, so it is a plain DynamicCache cropped or compacted
    to each accepted path, and a chain is verified with the model's own causal mask."""

    def __init__(self, device: torch.device) -> None:
        self.cache = DynamicCache()
        self.device = device
        self.length = 0  # tokens in the cache
        self.pending = 0  # pending tokens of the last verification

    def verification_inputs(
        self,
        pending: Sequence[torch.Tensor],
        trees: Sequence[DraftTree],
        dtype: torch.dtype,
        layout: AttentionLayout | None,
        pad_id: int,
    ) -> tuple[torch.Tensor, Mask, torch.Tensor | None, int, int]:
        """The input ids (1, P + N), mask and positions (`tree_attention`'s), P and N."""
        (tokens,), (tree,) = pending, trees
        self.pending = len(tokens)
        ids = tokens.to(self.device)[None]
        if len(tree):
            ids = torch.cat([ids, tree.tokens.to(self.device)], dim=1)
        mask, positions = tree_attention(
            tree, self.length, self.pending, dtype, self.device, layout
        )
        return ids, mask, positions, self.pending, len(tree)

    def keep(self, columns: Sequence[list[int]]) -> None:
        """Keep the pending tokens and the accepted nodes (BatchCache.keep's local columns)."""
        (kept,) = columns
        P = self.pending
        compact(self.cache, self.length + P, [c - P for c in kept if c >= P])
        self.length += len(kept)

    def select_rows(self, keep: Sequence[int]) -> None:
        if list(keep) != [0]:
            raise ValueError(f"a SequenceCache holds one row; asked to keep rows {list(keep)}")
