"""The small types every drafter kind shares with the inference loop.

A drafter is an `nn.Module` holding weights only. Generation state lives in a per-call session
(`Drafter.new_session`), which the loop drives with two calls per step:

    tree = session.propose(context)   # draft a tree after the context's last token
    session.accept(path)              # the tree nodes the target accepted, root to leaf

`accept` lets a session keep its own KV cache on the accepted path without recomputing it. A chain
is a tree with one child per node, so both go through the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch
from torch import nn


@dataclass
class DraftTree:
    """Draft tokens hanging below the root (the context's last token, not part of the tree).

    Nodes are in topological order (a parent comes before its children) and children of one parent
    are tried in their node order during sampling.
    """

    tokens: torch.Tensor  # (batch, n) draft token ids
    parents: list[int]  # (n,) index of each node's parent node, -1 for children of the root
    depths: list[int]  # (n,) 1 for children of the root, 2 for their children, ...
    # (batch, n, vocab): the draft distribution node i was sampled from, needed for lossless
    # sampling; None when every node was chosen deterministically (a point mass on its token).
    q: torch.Tensor | None = None

    def __len__(self) -> int:
        return len(self.parents)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    @property
    def is_chain(self) -> bool:
        """True when node i's parent is node i - 1: plain causal attention verifies it."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @classmethod
    def empty(cls, batch: int = 1, device: torch.device | str | None = None) -> DraftTree:
        return cls(torch.empty(batch, 0, dtype=torch.long, device=device), [], [])

    @classmethod
    def chain(cls, tokens: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
        """A chain from (batch, n) tokens; q, if given, is (batch, n, vocab)."""
        n = tokens.shape[-1]
        return cls(tokens, list(range(-1, n - 1)), list(range(1, n + 1)), q)

    def check(self) -> None:
        """Raise if the structure is inconsistent (a drafter bug, caught before verification)."""
        n = len(self.parents)
        if self.tokens.shape[-1] != n or len(self.depths) != n:
            raise ValueError(
                f"DraftTree has {self.tokens.shape[-1]} tokens, {n} parents, {len(self.depths)} depths"
            )
        for i, (p, d) in enumerate(zip(self.parents, self.depths, strict=True)):
            if not -1 <= p < i or d != (1 if p < 0 else self.depths[p] + 1):
                raise ValueError(f"DraftTree node {i}: parent {p} / depth {d} are not topological")
        if self.q is not None and self.q.shape[:2] != self.tokens.shape:
            raise ValueError(
                f"DraftTree q has shape {tuple(self.q.shape)}, tokens {self.tokens.shape}"
            )


@dataclass
class DraftContext:
    """What a session sees before proposing."""

    tokens: torch.Tensor  # (batch, seq): prompt plus every token emitted so far
    max_depth: int  # draft at most this deep: more could never be emitted (max_new_tokens)


@dataclass
class SamplingSettings:
    """How the target's logits become the distribution p that output follows (verify.process)."""

    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@runtime_checkable
class DraftSession(Protocol):
    """Per-call drafting state (caches, adaptive gamma); built by `Drafter.new_session`."""

    def propose(self, context: DraftContext) -> DraftTree: ...

    def accept(self, path: list[int]) -> None:
        """`path`: the accepted node indices of the last proposed tree, root to leaf (maybe []).

        Called once after every verification forward that followed a `propose`, also when the
        tree was empty. A session with a non-empty `capture_layers` attribute (a drafter fed by
        the target's features, like EAGLE) gets `accept(path, hidden_states)` instead: the
        verification forward's hidden states at those layers, each (batch, pending + n, hidden)
        with the pending tokens first and then the tree nodes in node order.
        """
        ...

    def extra_memory_bytes(self) -> int:
        """Bytes of drafting state beyond the weights (the drafter's KV cache), now."""
        ...


class Drafter(nn.Module):
    """Base of every trained drafter kind: weights on the module, state in sessions."""

    kind: str = ""

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings,
        generator: torch.Generator | None = None,
        **options,
    ) -> DraftSession:
        raise NotImplementedError

    def num_extra_parameters(self, target) -> int:
        """Parameters this drafter adds on top of the target (shared tensors not counted)."""
        target_params = {p.data_ptr() for p in target.model.parameters()}
        return sum(p.numel() for p in self.parameters() if p.data_ptr() not in target_params)


def vocab_mismatch_error(what: str, drafter_vocab: int, target) -> ValueError:
    return ValueError(
        f"{what} has a vocabulary of {drafter_vocab} tokens but the target {target.name!r} has "
        f"{target.vocab_size}: speculative decoding needs the draft to share the target's "
        "tokenizer. Use a draft trained with this target's tokenizer (e.g. one distilled from it)."
    )
