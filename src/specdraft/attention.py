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

from collections.abc import Mapping, Sequence
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
        window applied by the positions (1-D, q and k long). For a batch whose rows differ,
        `allowed` is (batch, q, k) and the positions (batch, q) and (batch, k): (batch, 1, q, k)
        masks."""
        built = {}
        for kind in sorted(set(self.layer_types)):
            seen = allowed
            window = self.windows[kind]
            if window is not None:
                near = query_positions[..., :, None] - key_positions[..., None, :] < window
                seen = allowed & near.to(allowed.device)
            mask = float_mask(seen, dtype)
            built[kind] = mask[None, None] if mask.dim() == 2 else mask[:, None]
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


# --- packed rows ---------------------------------------------------------------------------------
#
# A packed row holds several documents end to end (data.pack; data/packing.py). Its batch carries
# document_ids and position_ids, both (batch, seq): each document attends only to itself, causally,
# with its positions starting at 0, so every token is computed exactly as in a row of its own.


def document_layout(
    lengths: Sequence[Sequence[int]], seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(document ids, position ids), each (batch, seq) long, for rows whose documents have
    `lengths`. A row's padding after its documents is one more document with positions from 0,
    so every query, padding included, has a key to attend to (itself)."""
    documents = torch.zeros(len(lengths), seq, dtype=torch.long)
    positions = torch.zeros(len(lengths), seq, dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        start = 0
        for doc, n in enumerate([*row_lengths, seq - sum(row_lengths)]):
            documents[row, start : start + n] = doc
            positions[row, start : start + n] = torch.arange(n)
            start += n
    return documents, positions


def document_spans(batch: Mapping[str, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Per row, (start, length) of each of its documents in order, the padding after them left
    out: one span, the row's tokens, for a row of one document. For kinds that draw per
    document what they draw per row (DFlash's anchors, P-EAGLE's slots)."""
    lengths = batch["attention_mask"].sum(1).tolist()
    documents = batch.get("document_ids")
    if documents is None:
        return [[(0, int(n))] for n in lengths]
    spans = []
    for row, n in zip(documents.cpu(), lengths, strict=True):
        _, counts = torch.unique_consecutive(row[: int(n)], return_counts=True)
        starts = [0, *counts.cumsum(0).tolist()[:-1]]
        spans.append(list(zip(starts, counts.tolist(), strict=True)))
    return spans


def document_seeds(batch: Mapping[str, torch.Tensor], step_seed: int) -> list[list[int]]:
    """Per row, the seed of each document's draws (document_spans' order) at a step whose
    shared seed is `step_seed`: from the row's index in the training set (batch["example_index"])
    for a row of one document, from each document's own index (batch["document_index"],
    pack_documents') for a packed row, so a conversation draws the same packed or not."""
    if "document_ids" not in batch:
        indices = [[int(i)] for i in batch["example_index"].tolist()]
    elif "document_index" in batch:
        indices = [[int(i) for i in row if i >= 0] for row in batch["document_index"].tolist()]
    else:
        raise ValueError(
            "packed rows without their documents' indices (Example.document_indices, which "
            "pack_documents records): a kind that draws per document seeds each with its index"
        )
    return [[(step_seed * 1_000_003 + i) % (2**63 - 1) for i in row] for row in indices]


def model_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The attention_mask and position_ids a Hugging Face model's forward takes for `batch`.

    Rows of one document: the (batch, seq) padding mask. Packed rows: no mask, and the position
    ids that restart at each document, from which transformers' packed-sequence path builds the
    block-diagonal causal mask (SDPA and eager attention, each layer's sliding window applied by
    position) or, for a model loaded with flash-attention, calls its varlen kernel. It does so
    only in a forward without a cache: pass use_cache=False (a model whose config says use_cache
    makes one otherwise, and its rows would attend across their documents)."""
    if "document_ids" in batch:
        return {"attention_mask": None, "position_ids": batch["position_ids"]}
    return {"attention_mask": batch.get("attention_mask"), "position_ids": None}


def target_inputs(batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor | None]:
    """The keyword arguments a target's forward (targets/target.py) takes for `batch`: its
    padding mask, and for packed rows their document and position ids."""
    return {
        "attention_mask": batch["attention_mask"],
        "position_ids": batch.get("position_ids"),
        "document_ids": batch.get("document_ids"),
    }


def loss_targets(batch: Mapping[str, torch.Tensor], offset: int) -> torch.Tensor:
    """(batch, seq - offset) bool: token t + offset carries loss and is predicted from position
    t of its own document. For rows of one document that is loss_mask[:, offset:]; in a packed
    row position t must also lie in that token's document, as it always does in a row of its
    own. (For offset 1 that holds already: no document's first token carries loss.)"""
    keep = batch["loss_mask"][:, offset:].bool()
    documents = batch.get("document_ids")
    if documents is not None and offset > 0:
        keep = keep & (documents[:, offset:] == documents[:, : max(0, documents.shape[1] - offset)])
    return keep


def flash_varlen(model, device: torch.device) -> bool:
    """Switch a Hugging Face model to flash-attention 2, whose varlen kernel runs packed rows
    without a mask, where that can run: a CUDA device, half-precision weights and the flash_attn
    package installed. Returns whether it did; elsewhere the model keeps its attention (SDPA with
    the block-diagonal mask). Not run on this project's CPU machines."""
    if torch.device(device).type != "cuda" or model.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        import flash_attn  # noqa: F401  (only whether it is installed)
    except ImportError:
        return False
    model.set_attn_implementation("flash_attention_2")
    return True
