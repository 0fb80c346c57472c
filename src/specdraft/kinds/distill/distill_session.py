"""The two-model drafter's sessions: drafting one sequence (DistillSession) or the chains of a
batch together (DistillBatchSession) with the student's own KV cache; the drafter is
kinds/distill/distill.py."""

from __future__ import annotations

import torch
from transformers import DynamicCache

from specdraft.attention import AttentionLayout
from specdraft.batch import BatchCache
from specdraft.core import (
    DecodeConfig,
    DraftContext,
    DraftTree,
    SamplingSettings,
    compact,
    float_mask,
    kv_bytes,
)
from specdraft.drafters.lean import (
    LeanModel,
    ModelWeights,
)
from specdraft.drafters.sessions import BatchSession, DraftSession
from specdraft.drafting import draft_chain, draft_chains, draft_tree

# --- propose / session (inference) -------------------------------------------------------------


# dynamic_gamma grows gamma up to this (or the configured gamma, if larger)
DYNAMIC_GAMMA_CEILING = 16


class DistillSession(DraftSession):
    """One generate call's drafting state: the draft model's KV cache and the current gamma.

    Drafting runs the small model autoregressively with its own KV cache, as
    - a chain of gamma tokens (drafting.draft_chain: argmax if greedy, else sampled from q, which is
      recorded for lossless verification; stop_below ends it early), through drafters/lean.py's
      LeanModel (maybe int8) where the student's layout allows,
    - or EAGLE-2's dynamic tree (drafting.draft_tree), its levels fed with a tree mask,
    - with dynamic_gamma, a gamma that grows after a fully accepted draft and shrinks otherwise.
    The cache holds the first `cached` tokens of the context; a proposal first feeds the rest, so
    a tree this session did not draft (a copy) needs nothing but to be left alone.
    """

    capture_layers: tuple[int, ...] = ()

    def __init__(
        self,
        model,
        decode: DecodeConfig,
        sampling: SamplingSettings,
        generator,
        weights: ModelWeights | None = None,
    ):
        self.model = model
        self.weights = weights  # chains through drafters/lean.py's LeanModel when given
        self.lean: LeanModel | None = None
        self.decode = decode
        self.sampling = sampling
        self.generator = generator
        self.gamma = decode.gamma
        self.max_gamma = max(DYNAMIC_GAMMA_CEILING, decode.gamma)
        # every layer keeps every key, so a rejected draft crops away whatever the layer type;
        # a sliding student drafts its tree levels without its window (a draft: the target's
        # verification keeps the output exact either way)
        self.cache = DynamicCache()
        self.cached = 0
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._base = 0  # context length at the last proposal
        self._depth = 0  # the depth it was asked to draft
        self._tree: DraftTree | None = None  # the last proposal
        self._fed_slots: list[int] = []  # per node of the last tree: its cache slot, or -1

    def propose(self, context: DraftContext) -> DraftTree:
        seq = context.tokens.to(self.model.device)  # (batch, seq)
        length = seq.shape[-1]
        depth = min(self.gamma, context.max_depth)
        if self.max_positions is not None:  # a draft may have fewer positions than the target
            depth = min(depth, self.max_positions - length)
        self._base, self._depth = length, max(depth, 0)
        pending = seq[:, self.cached :]
        if depth <= 0:
            tree, self._fed_slots = DraftTree.empty(seq.shape[0], seq.device), []
        elif self.decode.chain:
            if self.weights is not None and self.lean is None:  # room for the whole call
                self.lean = LeanModel(self.weights, capacity=length + context.max_depth + 1)
            tree = self._chain(pending, depth)
            self._fed_slots = [*range(len(tree) - 1), -1]  # the last token is never fed
        else:
            tree, self._fed_slots = self._tree_draft(pending, depth)
        self._tree = tree
        return tree

    def _logits(self, ids, mask=None, positions=None) -> torch.Tensor:
        """Feed ids (batch, n) to the student's cache: (batch, n, vocab) logits (last only
        without a mask)."""
        if self.lean is not None:
            return self.lean(ids)[:, None]
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if mask is None else 0,
        )
        return out.logits

    def _chain(self, pending: torch.Tensor, depth: int) -> DraftTree:
        return draft_chain(
            self._logits(pending)[:, -1],
            lambda token, _: self._logits(token)[:, -1],
            depth=depth,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
        )

    def _tree_draft(self, pending: torch.Tensor, depth: int) -> tuple[DraftTree, list[int]]:
        """Feed the pending tokens, then grow the tree; each level is fed with a mask that lets
        every node see the context, its fed ancestors and itself (batch 1)."""
        base, device, dtype = self._base, pending.device, self.model.dtype

        def expand(nodes, tokens, parents, visible, level):
            allowed = torch.cat([torch.ones(len(nodes), base, dtype=torch.bool), visible], dim=1)
            mask = float_mask(allowed, dtype)
            positions = torch.full((1, len(nodes)), base - 1 + level, device=device)
            ids = torch.tensor([tokens], device=device)
            return self._logits(ids, mask[None, None].to(device), positions)[0]

        return draft_tree(
            self._logits(pending)[0, -1],
            expand,
            depth=depth,
            top_k=self.decode.tree_top_k,
            budget=self.decode.tree_budget,
        )

    def accept(self, tree: DraftTree, path: list[int], hidden_states=None) -> None:
        """Keep the cache entries of the accepted nodes that were fed; adapt gamma. A tree this
        session did not propose leaves the cache as it is (its tokens are fed next time)."""
        if tree is not self._tree or not len(tree):
            return
        self._tree = None
        slots = [self._fed_slots[i] for i in path if self._fed_slots[i] >= 0]
        if self.lean is not None:  # a chain: the accepted fed nodes are the first slots
            self.lean.crop(self._base + len(slots))
        else:
            compact(self.cache, self._base, slots)
        self.cached = self._base + len(slots)
        if self.decode.dynamic_gamma:
            # grow after a draft accepted to the depth asked for, shrink after a rejection
            if len(path) == self._depth:
                self.gamma = min(self.gamma + 2, self.max_gamma)
            else:
                self.gamma = max(1, self.gamma - 1)

    def extra_memory_bytes(self) -> int:
        """The student's KV cache, plus the lean drafting copies of its weights if any."""
        if self.weights is None:
            return kv_bytes(self.cache)
        lean = 0 if self.lean is None else self.lean.memory_bytes()
        return lean + self.weights.memory_bytes()


class DistillBatchSession(BatchSession):
    """The chains of a batch's rows drafted together: one student forward feeds every row's
    pending tokens, then one per depth feeds every row's last drafted token, on one KV cache
    whose rows keep their own tokens (specdraft/batch.py). Each row drafts what DistillSession
    drafts for it alone (its gamma, dynamic or not, its max depth, its stop_below); rows are fed
    until the deepest is done, and a row's chain is cut where its own would end. The student
    runs its own modules (drafters/lean.py's model is one sequence's)."""

    capture_layers: tuple[int, ...] = ()

    def __init__(self, model, rows: int, decode: DecodeConfig, sampling, generator) -> None:
        self.model, self.decode = model, decode
        self.sampling, self.generator = sampling, generator
        self.layout = AttentionLayout.of(model.config)
        self.cache = BatchCache(rows, model.device)
        self.gamma = [decode.gamma] * rows
        self.max_gamma = max(DYNAMIC_GAMMA_CEILING, decode.gamma)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._base: list[int] = [0] * rows  # each row's context length at the last proposal
        self._depth: list[int] = [0] * rows
        self._drafted: list[bool] = [False] * rows  # the row drafted at the last proposal
        self._fed = 0  # drafted tokens fed to every row at the last proposal

    def _feed(self, pending: list[torch.Tensor]) -> torch.Tensor:
        """Feed each row's tokens (1-D, maybe none): (rows, vocab) logits after each row's last."""
        no_tree = [DraftTree.empty(1, self.model.device)] * len(pending)
        ids, mask, positions, P, _ = self.cache.verification_inputs(
            pending, no_tree, self.model.dtype, self.layout, pad_id=0
        )
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=self.cache.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache.keep([list(range(P - len(p), P)) for p in pending])
        return out.logits[:, -1]

    def propose(self, contexts: list[DraftContext | None]) -> list[DraftTree]:
        device = self.model.device
        depths, pending = [], []
        for r, context in enumerate(contexts):
            if context is None:  # nothing to draft: its cache stays as it is
                depths.append(0)
                pending.append(torch.empty(0, dtype=torch.long, device=device))
                self._base[r] = int(self.cache.lengths[r])
                continue
            seq = context.tokens[0].to(device)
            depth = min(self.gamma[r], context.max_depth)
            if self.max_positions is not None:
                depth = min(depth, self.max_positions - len(seq))
            depths.append(max(depth, 0))
            pending.append(seq[int(self.cache.lengths[r]) :])
            self._base[r] = len(seq)
        self._depth = depths
        self._drafted = [d > 0 for d in depths]
        if max(depths) <= 0:
            self._fed = 0
            return [DraftTree.empty(1, device) for _ in contexts]
        logits = self._feed(pending)
        self._fed = 0

        def step(token: torch.Tensor, _: int) -> torch.Tensor:
            self._fed += 1
            return self._feed(list(token))

        return draft_chains(
            logits,
            step,
            depths=depths,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
        )

    def accept(self, trees, paths, hidden_states) -> None:
        """Keep each row's context and its accepted drafted tokens that were fed; adapt gamma."""
        lengths = []
        for r, path in enumerate(paths):
            if not self._drafted[r]:  # no draft, or another drafter's (a copy): nothing fed
                lengths.append(self._base[r])
                continue
            lengths.append(self._base[r] + min(len(path), self._fed))
            if self.decode.dynamic_gamma:  # as DistillSession adapts it
                if len(path) == self._depth[r]:
                    self.gamma[r] = min(self.gamma[r] + 2, self.max_gamma)
                else:
                    self.gamma[r] = max(1, self.gamma[r] - 1)
        self.cache.truncate(lengths)
        self._fed = 0

    def drop(self, keep) -> None:
        self.cache.select_rows(keep)
        for name in ("gamma", "_base", "_depth", "_drafted"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in keep])

    def extra_memory_bytes(self) -> int:
        return kv_bytes(self.cache.cache)
