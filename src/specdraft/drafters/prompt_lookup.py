"""Prompt lookup: the training-free n-gram drafter (Saxena 2023), and copying before any drafter.

The draft is what followed an earlier occurrence of the context's last n tokens (n from
`max_ngram` down to `min_ngram`), up to gamma tokens: the latest occurrence followed by gamma
tokens, else the earliest (inside a repeating run, the latest is followed by almost nothing).
It needs no weights and no cache, and its tokens are deterministic (point masses), so
verification stays lossless when sampling.

`CopyingRows` puts it in front of any drafter's session (`DecodeConfig.lookup_ngram`): where a
row's context repeats itself the draft is copied for free, elsewhere the drafter drafts. The
same split as suffix decoding beside a model drafter in Arctic Inference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.base import Drafter
from specdraft.drafters.sessions import BatchSession, DraftSession


class PromptLookupDrafter(Drafter):
    kind = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        default = DecodeConfig(gamma=decode.gamma)
        changed = [k for k in ("tree_top_k", "stop_below", "draft_weights", "lookup_ngram",
                               "lookup_gamma") if getattr(decode, k) != getattr(default, k)]  # fmt: skip
        if not changed:
            return []
        return [f"prompt lookup drafts a chain of up to gamma copied tokens; {', '.join(changed)} "
                "ignored"]  # fmt: skip

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings | None = None,
        decode: DecodeConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> PromptLookupSession:
        gamma = (decode or DecodeConfig()).gamma
        return PromptLookupSession(self.max_ngram, self.min_ngram, gamma)


class PromptLookupSession(DraftSession):
    def __init__(self, max_ngram: int, min_ngram: int, gamma: int) -> None:
        self.max_ngram, self.min_ngram, self.gamma = max_ngram, min_ngram, gamma

    def propose(self, context: DraftContext) -> DraftTree:
        seq = context.tokens[0]  # (seq,)
        length = seq.shape[0]
        depth = min(self.gamma, context.max_depth)
        for n in range(min(self.max_ngram, length - 1), self.min_ngram - 1, -1):
            # windows starting before the trailing n-gram itself, so a hit has a continuation
            windows = seq[: length - 1].unfold(0, n, 1)  # (length - n, n)
            hits = (windows == seq[length - n :]).all(dim=1).nonzero().flatten().tolist()
            if hits:
                # the latest match with a full continuation; failing that, the earliest (longest)
                full = [h for h in hits if h + n + depth <= length]
                start = (full[-1] if full else hits[0]) + n
                draft = seq[start : start + depth]
                return DraftTree.chain(draft[None].clone())
        return DraftTree.empty(1, seq.device)


class CopyingRows(BatchSession):
    """Any drafter's session with prompt lookup in front, for the rows of a generate call (one
    for a prompt alone): where a row's context repeats itself its draft is copied from what
    followed the repeat (no drafter pass), up to `gamma` tokens (the loop passes
    DecodeConfig.lookup_gamma, else the drafter's gamma); `inner` drafts the other rows. The
    inner session gets None for a copied row, then that row's copied tree at `accept`, so a
    drafter fed by the target's features (EAGLE) gets the verified tokens' features, and one
    with a KV cache feeds them at its next proposal. A session that drafts on the target's
    cache (LayerSkip, a prompt alone) keeps it: `bind_cache` and `verify` pass through, and its
    `verify` of a copy is the loop's full forward."""

    def __init__(self, inner: BatchSession, rows: int, ngram: int, gamma: int) -> None:
        self.inner = inner
        self.lookups = [PromptLookupSession(max(3, ngram), ngram, gamma) for _ in range(rows)]
        self.copied = [0] * rows  # proposals copied rather than drafted, per row
        self.capture_layers = inner.capture_layers
        self.lossy = inner.lossy  # the inner session's acceptance rule verifies copies too
        self.drafts_on_target_cache = inner.drafts_on_target_cache

    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        copies = [
            None if context is None else lookup.propose(context)
            for lookup, context in zip(self.lookups, contexts, strict=True)
        ]
        copying = [copy is not None and len(copy) > 0 for copy in copies]
        drafted = self.inner.propose(
            [None if c else context for c, context in zip(copying, contexts, strict=True)]
        )
        for r, c in enumerate(copying):
            self.copied[r] += c
        return [copy if c else tree for copy, c, tree in zip(copies, copying, drafted, strict=True)]

    def accept(self, trees, paths, hidden_states) -> None:
        self.inner.accept(trees, paths, hidden_states)

    def bind_cache(self, cache) -> None:
        self.inner.bind_cache(cache)

    def verify(self, trees, logits_to_keep):
        return self.inner.verify(trees, logits_to_keep)

    def verify_sampled(self, row, tree, p, generator):
        return self.inner.verify_sampled(row, tree, p, generator)

    def drop(self, keep: Sequence[int]) -> None:
        self.lookups = [self.lookups[r] for r in keep]
        self.copied = [self.copied[r] for r in keep]
        self.inner.drop(keep)

    def row_copied_passes(self, row: int) -> int:
        return self.copied[row]

    def extra_memory_bytes(self) -> int:
        return self.inner.extra_memory_bytes()
