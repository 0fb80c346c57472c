"""Keeping a KV cache on the accepted path after verification, without recomputing anything.

After a forward over `pending` tokens and a draft tree, the cache holds, past its first `keep`
entries, one entry per tree node in node order. Only the accepted path's entries stay, moved
into place right after `keep`. A chain's accepted path is a prefix, so that is a plain crop.
"""

from __future__ import annotations

import torch


def compact(cache, keep: int, slots: list[int]) -> None:
    """Keep entries [0, keep) and then the entries at keep + s for s in `slots` (ascending)."""
    length = cache.get_seq_length()
    m = len(slots)
    if slots != list(range(m)):
        index = torch.tensor([keep + s for s in slots], device=cache.layers[0].keys.device)
        for layer in cache.layers:
            for kv in (layer.keys, layer.values):  # (batch, kv_heads, seq, head_dim)
                # the right side is a fresh gathered tensor, so overlapping slots are safe
                kv[:, :, keep : keep + m] = kv.index_select(2, index)
    drop = length - keep - m
    if drop > 0:
        cache.crop(-drop)


def kv_bytes(cache) -> int:
    """Bytes held by a cache's keys and values now."""
    if cache is None:
        return 0
    total = 0
    for layer in getattr(cache, "layers", ()):
        for kv in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(kv, torch.Tensor):
                total += kv.numel() * kv.element_size()
    return total
