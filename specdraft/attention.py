"""Which keys each layer of a target attends to: full causal attention or a sliding window.

Mistral and Phi-3 slide every layer over `sliding_window` keys; Gemma-2, Gemma-3 and Qwen2/Qwen3
with `use_sliding_window` mix sliding and full layers (`config.layer_types`) and take one mask per
kind of layer, as a dict keyed by layer type. The loop keeps every key in the target's cache (a
full-length cache, whatever the layer type, so it can be cropped and compacted to an accepted
path), and the masks it builds apply each layer's window by position: a query at position q sees
a key at position k only where q - k < window, as the model's own masks do (transformers'
sliding_window_overlay). A model's own forward builds the same masks for a chain, which needs no
mask from us; a tree, and a drafter that runs the target's layers one by one (LayerSkip), need
them from here.

The price of keeping every key: a sliding layer's cache grows with the context instead of
stopping at its window (memory, not time: the window's mask hides the rest).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from specdraft.core import float_mask

FULL, SLIDING = "full_attention", "sliding_attention"

Mask = torch.Tensor | Mapping[str, torch.Tensor | None] | None


class AttentionError(ValueError):
    """A target whose attention pattern the loop cannot reproduce."""


@dataclass(frozen=True)
class AttentionLayout:
    """Each layer's attention type and each type's window (None: full attention).

    `per_type`: the model takes a dict of masks keyed by layer type (layers of more than one
    type); otherwise one mask for every layer."""

    layer_types: tuple[str, ...]
    windows: Mapping[str, int | None]
    per_type: bool

    @classmethod
    def of(cls, config) -> AttentionLayout:
        """The layout of a HF model config; an AttentionError for a layer type other than full
        or sliding attention (chunked attention, say), naming it."""
        n = int(config.num_hidden_layers)
        window = getattr(config, "sliding_window", None)
        types = getattr(config, "layer_types", None)
        if types is None:  # one kind of layer: sliding where the config sets a window
            types = [SLIDING if window else FULL] * n
        types = tuple(str(t) for t in types)
        unknown = sorted(set(types) - {FULL, SLIDING})
        if unknown:
            raise AttentionError(
                f"{type(config).__name__} has layers of attention type {unknown}; the loop "
                f"reproduces {FULL!r} and {SLIDING!r} layers only"
            )
        if SLIDING in types and not window:
            raise AttentionError(
                f"{type(config).__name__} has sliding-window layers but no sliding_window size"
            )
        windows = {FULL: None, SLIDING: int(window) if window else None}
        return cls(types, windows, per_type=len(set(types)) > 1)

    @property
    def slides(self) -> bool:
        """True when some layer attends over a window only."""
        return SLIDING in self.layer_types

    def masks(
        self,
        allowed: torch.Tensor,
        query_positions: torch.Tensor,
        key_positions: torch.Tensor,
        dtype: torch.dtype,
    ) -> Mask:
        """What the model's forward takes as attention_mask for a (queries, keys) bool pattern
        `allowed` (1, 1, q, k float masks): one mask, or a dict per layer type, each layer's
        window applied by the positions (1-D, q and k long)."""
        built = {}
        for kind in sorted(set(self.layer_types)):
            seen = allowed
            window = self.windows[kind]
            if window is not None:
                near = query_positions[:, None] - key_positions[None, :] < window
                seen = allowed & near.to(allowed.device)
            built[kind] = float_mask(seen, dtype)[None, None]
        if self.per_type:
            return built
        return built[self.layer_types[0]]

    def layer_mask(self, masks: Mask, index: int) -> torch.Tensor | None:
        """The mask layer `index` sees, from what `masks` returned (or a model's own dict)."""
        if isinstance(masks, Mapping):
            return masks[self.layer_types[index]]
        return masks


def causal_masks(layout: AttentionLayout, past: int, new: int, dtype: torch.dtype, device) -> Mask:
    """The masks of `new` tokens at positions past.. after `past` cached ones, each seeing the
    past and the new ones up to itself, within its layer's window. None for a single token that
    no window limits (it sees everything)."""
    if new == 1 and not layout.slides:
        return None
    allowed = torch.ones(new, past + new, dtype=torch.bool, device=device)
    allowed[:, past:] = torch.ones(new, new, dtype=torch.bool, device=device).tril()
    queries = torch.arange(past, past + new, device=device)
    keys = torch.arange(past + new, device=device)
    return layout.masks(allowed, queries, keys, dtype)
