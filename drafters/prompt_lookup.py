"""Prompt lookup: the training-free n-gram drafter (Saxena 2023), always available as a baseline.

The draft is what followed an earlier occurrence of the context's last n tokens (n from
`max_ngram` down to `min_ngram`), up to gamma tokens: the latest occurrence followed by gamma
tokens, else the earliest (inside a repeating run, the latest is followed by almost nothing).
It needs no weights and no cache, and its tokens are deterministic (point masses), so
verification stays lossless when sampling.
"""

from __future__ import annotations

import torch

from specdraft.drafters.base import DraftContext, Drafter, DraftTree, SamplingSettings


class PromptLookupDrafter(Drafter):
    kind = "prompt_lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__()
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings | None = None,
        generator: torch.Generator | None = None,
        gamma: int = 5,
        **_ignored,
    ) -> PromptLookupSession:
        return PromptLookupSession(self.max_ngram, self.min_ngram, gamma)


class PromptLookupSession:
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

    def accept(self, path: list[int]) -> None:
        pass  # no state to keep

    def extra_memory_bytes(self) -> int:
        return 0
