"""EAGLE's drafting (kinds/eagle/eagle.py holds the kind): the head's weights as drafting runs
them, and the one session the inference loop drives, for a prompt decoded alone (a batch of
one) and for the rows of a batch (their chains drafted together, one head pass per depth).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.batch import BatchCache
from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.drafters.base import warn_once
from specdraft.drafters.lean import (
    DraftLinear,
    LayerWeights,
    decode_layer,
    rms,
    use_int8,
)
from specdraft.drafters.sessions import BatchSession, check_features_known, check_trees_alone
from specdraft.drafting import draft_chains, draft_tree

if TYPE_CHECKING:
    from specdraft.kinds.eagle.eagle import EagleDrafter


# --- the head's weights as drafting runs them ---------------------------------------------------


class EagleDraftingWeights:
    """The head as drafting runs it: the layer's fused (and maybe int8) weights, and its input
    and output products with the RMSNorm weights before them folded in.

    fuse: the low/mid/high product (eagle3). input: the product before the layer (eagle1's fc),
    None where the layer reads cat(embedding, feature) itself (eagle3). out_eps: the final
    norm's before the LM head (eagle3)."""

    @torch.no_grad()
    def __init__(self, head: EagleDrafter, int8: bool) -> None:
        self.head = head
        self.int8 = int8
        self.layer = LayerWeights(head.layer, int8=int8)
        self.fuse = self.input = self.out_eps = None
        if head.config.version == "eagle1":  # the final feature is used as it is
            self.input = DraftLinear(head.fc.weight, head.fc.bias, int8=int8)
            lm = head.target.model.get_output_embeddings()
            self.output = DraftLinear(lm.weight, lm.bias, int8=int8)
            return
        self.fuse = DraftLinear(head.fc_fuse.weight, int8=int8)
        self.out_eps = head.final_norm.variance_epsilon
        self.output = DraftLinear(head.lm_head.weight, in_scale=head.final_norm.weight, int8=int8)

    def memory_bytes(self) -> int:
        """Bytes beyond the head's own parameters: the int8 copies (fp weights are shared, but
        the fused layer and folded products are copies too)."""
        linears = [lin for lin in (self.input, self.output, self.fuse) if lin is not None]
        return self.layer.memory_bytes() + sum(lin.memory_bytes() for lin in linears)

    # What a session calls, the same on EagleModuleWeights: the int8/lean choice is made once,
    # when the head's drafting_weights picks which of the two to hand the session.

    @property
    def lean_layer(self) -> LayerWeights:
        """The layer's weights for drafters/lean.py's LeanLayer (`decode_layer`)."""
        return self.layer

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(rows, n) tokens + (rows, n, hidden) features -> the layer's input."""
        emb = self.head.target.embed(tokens).to(features.dtype)
        x = torch.cat([emb, features], dim=-1)  # the eagle3 layer norms them itself
        return x if self.input is None else self.input(x)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) draft logits (the target's vocab for eagle1)."""
        return self.output(h if self.out_eps is None else rms(h, self.out_eps))

    def fused(
        self, hidden_states: Mapping[int, torch.Tensor], layers: Sequence[int]
    ) -> torch.Tensor:
        """The features of verified positions, from the target's hidden states there ((1, n,
        hidden) each) at `layers` (the session's capture_layers)."""
        if self.fuse is None:  # eagle1: the final feature as it is
            return self.head.fuse(hidden_states)
        dtype = self.layer.dtype
        low_mid_high = [hidden_states[i].to(dtype) for i in layers]
        return self.fuse(self.head.fused_input(torch.cat(low_mid_high, dim=-1)))


class EagleModuleWeights:
    """EagleDraftingWeights' calls through the head's own modules: for a layer drafters/lean.py
    does not reproduce (LeanLayer runs the Llama layer only), which drafts with full weights."""

    int8 = False
    lean_layer = None  # decode_layer then runs the head's layer module

    def __init__(self, head: EagleDrafter) -> None:
        self.head = head

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        return self.head.layer_input(tokens, features)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.head.draft_logits(h)

    def fused(
        self, hidden_states: Mapping[int, torch.Tensor], layers: Sequence[int]
    ) -> torch.Tensor:
        return self.head.fuse(hidden_states)

    def memory_bytes(self) -> int:
        return 0  # the modules' weights are the head's parameters


def verified_states(
    session,
    trees: Sequence[DraftTree],
    paths: Sequence[list[int]],
    hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
) -> tuple[dict[int, torch.Tensor], list[int]]:
    """The verification forward's hidden states at the session's `capture_layers` of each row's
    verified tokens (its pending token(s), then the accepted nodes of its tree along its path),
    every row's joined: layer -> (1, verified tokens of every row, hidden), and each row's count.
    For a session whose drafter reads the target's features (EAGLE's, DFlash's) in `accept`."""
    name = type(session).__name__
    picked = []
    for tree, path, hidden in zip(trees, paths, hidden_states, strict=True):
        if hidden is None:
            raise ValueError(
                f"{name}.accept needs hidden_states: the verification forward's hidden states at "
                f"layers {session.capture_layers} (see the {name} docstring)"
            )
        positions = next(iter(hidden.values())).shape[1]
        pending = positions - len(tree)
        if pending < 1:
            raise ValueError(
                f"{name}.accept got hidden states for {positions} positions; expected the "
                f"pending token(s) then the {len(tree)} tree nodes"
            )
        picked.append(list(range(pending)) + [pending + i for i in path])
    rows = list(zip(hidden_states, picked, strict=True))
    joined = {
        layer: torch.cat([h[layer][:, at].to(session.device) for h, at in rows], dim=1)
        for layer in session.capture_layers
    }
    return joined, [len(at) for at in picked]


class EagleSession(BatchSession):
    """One generate call's drafting for its rows (one for a prompt decoded alone): the head's KV
    cache and, per row, the target features it needs.

    Contract with the inference loop (beyond `BatchSession`):

    - `capture_layers: list[int]`: the target hidden-state ids the session needs; every
      verification forward must capture them (`Target.forward(..., capture_layers=...)`).
    - `accept(trees, paths, hidden_states)` after EVERY verification forward, also for a row
      whose tree was empty (the first step, which verifies the prompt, and steps at the end of
      generation) or drafted by someone else (a copy). A row's `hidden_states[layer]` is (1,
      pending + n, hidden): every position of that forward in order, i.e. the pending tokens
      (the whole prompt at first, then the root = the context's last token), then the n tree
      nodes in tree order.
    - A row drafts nothing before its first features (the prompt's forward hands them over).

    State: the head's cache holds one entry per pair (f_t, x_{t+1}) for t < fed[r] of each row,
    built from the target's true features; the accepted tokens' pairs are fed with their true
    features at the next proposal, in the same head pass as the first draft level. Drafted
    levels, fed predicted features, are cropped once drafted.

    The head runs as drafters/lean.py's LeanLayer (fused products, norm weights folded in, int8
    copies with draft_weights=int8 on a CPU, an in-place KV cache) from weights the head builds
    once and shares across sessions, or as its own modules where lean does not reproduce its
    layer. The rows share one cache (specdraft/batch.py's BatchCache: a row's valid columns, its
    positions, masks that hide the rest), so rows of different lengths that accept different
    numbers of tokens stay exact; while no row has holes (one row always) every pass runs
    causally without a mask.

    Drafting (settings from `decode`): each row's chain (tree_top_k = 1, drafting.draft_chains:
    its depth, its stop_below, one head pass per depth for every row), or for a session of one
    row EAGLE-2's dynamic tree (drafting.draft_tree) whose levels are fed together, each node
    seeing the real prefix, its fed ancestors and itself (a batch drafts trees row by row:
    RowSessions).
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        target,
        rows: int = 1,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        check_trees_alone(self, rows, decode)
        self.head = drafter
        self.sampling, self.decode, self.generator = sampling, decode, generator
        int8 = use_int8(decode.draft_weights, target.device, "the head's full weights")
        self.vocab = drafter.draft_vocab()
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.w = drafter.drafting_weights(int8)  # lean's, or the head's modules
        if int8 and not self.w.int8:
            warn_once(
                f"draft_weights=int8 needs a layer drafters/lean.py runs ({type(drafter.layer)}"
                " is not one); drafting with the head's full weights"
            )
        weight = drafter.layer.post_attention_layernorm.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.layer = self.cache = None  # the head's layer and its columns, at the first draft
        self.fed = [0] * rows  # per row: pairs (f_t, x_{t+1}) in the head's cache, t < fed
        self.names_rows = rows > 1  # errors name the row of a batch
        # per row: (1, m, hidden) true features f_fed .. f_{fed+m-1}, None before the prompt's
        self.features: list[torch.Tensor | None] = [None] * rows

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        depths, tokens, features = self._take_pending(contexts, self.decode.gamma)
        if max(depths, default=0) <= 0:
            return [DraftTree.empty(1, self.device) for _ in contexts]
        self._build(contexts, max(depths))
        # 1. Feed each row's pending pairs; its last output (token = its root) drafts level 1.
        h = self._feed(tokens, features, [len(t) for t in tokens])[:, -1]  # (rows, hidden)
        # 2. Draft below the roots.
        if self.decode.chain:
            return self._chains(h, depths)
        return [self._tree(h, depths[0])]

    def _build(self, contexts: Sequence[DraftContext | None], depth: int) -> None:
        """The head's layer with its KV cache for this call (drafters/lean.py), from the head's
        shared drafting weights, with room for the whole call: prompt, new tokens, one more
        draft (a layer layout LeanLayer does not know runs as modules)."""
        if self.layer is not None:
            return
        room = max(c.tokens.shape[1] + c.max_depth for c in contexts if c is not None)
        rows = len(self.fed)
        self.layer = decode_layer(
            self.head.layer, self.head.rotary, room + depth + 1, weights=self.w.lean_layer,
            rows=rows,
        )  # fmt: skip
        self.cache = BatchCache(rows, self.device, store=self.layer)

    def _take_pending(
        self, contexts: Sequence[DraftContext | None], limit: int
    ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """Per row: its draft depth (at most `limit`; 0: none, before the prompt's features or
        where no token may follow), the tokens x_{fed+1} .. x_{length-1} of its pairs not yet
        in the head's cache (1-D, empty for a row that does not draft) and their true features
        (m, hidden). Those pairs count as fed from here."""
        depths, tokens, features = [], [], []
        hidden = self.head.target.hidden_size
        for r, context in enumerate(contexts):
            known = self.features[r]
            depth = 0 if context is None else min(limit, context.max_depth)
            if known is None or depth <= 0:
                depths.append(0)
                tokens.append(torch.empty(0, dtype=torch.long, device=self.device))
                features.append(torch.empty(0, hidden, dtype=self.dtype, device=self.device))
                continue
            seq = context.tokens[0]  # (length,)
            length = seq.shape[0]
            where = r if self.names_rows else None
            check_features_known(type(self).__name__, self.fed[r] + known.shape[1], length, where)
            n_new = length - 1 - self.fed[r]
            depths.append(depth)
            tokens.append(seq[self.fed[r] + 1 :].to(self.device))
            features.append(known[0, :n_new])
            self.fed[r], self.features[r] = length - 1, known[:, n_new:]
        return depths, tokens, features

    def _feed(
        self, tokens: list[torch.Tensor], features: list[torch.Tensor], kept: list[int]
    ) -> torch.Tensor:
        """One head pass over each row's tokens (1-D, maybe none) with their features (m,
        hidden), at the row's next positions, each seeing its own cached pairs and its new
        entries causally: (rows, P, hidden) h, row r's last output at column P - 1 (shorter rows
        are padded on the left). The cache keeps each row's first kept[r] new entries."""
        cache, rows = self.cache, len(tokens)
        counts = {len(t) for t in tokens}
        if len(counts) == 1 and len(set(kept)) == 1 and cache.dense:  # alike: no mask
            start = cache.columns  # every row's length
            h = self._step(torch.stack(tokens), torch.stack(features).to(self.dtype), start)
            self.layer.crop(start + kept[0])
            cache.append_tokens(kept[0])
            return h
        no_tree = [DraftTree.empty(1, self.device)] * rows
        ids, mask, positions, P, _ = cache.verification_inputs(
            tokens, no_tree, self.dtype, None, pad_id=0
        )
        x = torch.zeros(rows, P, self.head.target.hidden_size, dtype=self.dtype, device=self.device)
        for r, f in enumerate(features):
            if len(f):
                x[r, P - len(f) :] = f
        h = self._step(ids, x, positions, mask)  # (rows, P, hidden)
        cache.keep(
            [list(range(P - len(t), P - len(t) + k)) for t, k in zip(tokens, kept, strict=True)]
        )
        return h

    def _step(self, tokens, features, positions, visible=None) -> torch.Tensor:
        """One head pass: (rows, n) tokens + (rows, n, hidden) features -> (rows, n, hidden) h,
        the keys appended to the head's cache. positions and visible as `LeanLayer.__call__`
        takes them."""
        return self.layer(self.w.layer_input(tokens, features), positions, visible)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) draft logits (the target's vocab for eagle1)."""
        return self.w.draft_logits(h)

    def _chains(self, h: torch.Tensor, depths: list[int]) -> list[DraftTree]:
        """Each row's chain, its drafted tokens fed back with the head's own h as their feature,
        every row at once: level i + 1 of row r at the row's position lengths[r] + i, seeing the
        row's cache and the levels before it."""
        cache = self.cache
        pairs = cache.columns
        dense = cache.dense
        lengths = cache.lengths[:, None]  # (rows, 1)

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal h
            if dense:  # every row at the same position, seeing every column
                positions, visible = pairs + i, None
            else:
                own = torch.ones(len(depths), i + 1, dtype=torch.bool, device=self.device)
                positions, visible = lengths + i, torch.cat([cache.valid, own], 1)[:, None]
            h = self._step(token.to(self.device), self.head.feedback(h[:, None]), positions,
                           visible)[:, -1]  # fmt: skip
            return self._logits(h)

        chains = draft_chains(
            self._logits(h),
            step,
            depths=depths,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
            vocab=self.vocab,
        )
        self.layer.crop(pairs)  # the levels were fed predicted features
        return chains

    def _tree(self, h: torch.Tensor, depth: int) -> DraftTree:
        """EAGLE-2's dynamic tree (one row): a node's feature is its parent's h."""
        h_of: dict[int, torch.Tensor] = {-1: h[0]}  # node -> output h, for its children
        pairs, length = self.cache.columns, int(self.cache.lengths[0])

        def expand(nodes, tokens, parents, visible, level):
            # the real prefix is visible to all
            prefix = self.cache.valid.expand(len(nodes), -1)
            feats = self.head.feedback(torch.stack([h_of[p] for p in parents])[None])
            ids = torch.tensor([tokens], device=self.device)
            # level `level` sits at step level of the unroll from the last pair's position
            positions = torch.full((1, len(nodes)), length - 1 + level, device=self.device)
            out = self._step(ids, feats, positions, torch.cat([prefix, visible], 1))[0]
            for row, node in enumerate(nodes):
                h_of[node] = out[row]
            return self._logits(out)  # (f, draft vocab)

        tree, _ = draft_tree(
            self._logits(h[0]),
            expand,
            depth=depth,
            top_k=self.decode.tree_top_k,
            budget=self.decode.tree_budget,
            vocab=self.vocab,
        )
        self.layer.crop(pairs)  # the nodes were fed predicted features
        return tree

    @torch.no_grad()
    def accept(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
    ) -> None:
        """Take each row's true features of its verified tokens (its pending token(s), then its
        accepted nodes, of any drafter's tree), every row's fused in one call."""
        joined, counts = verified_states(self, trees, paths, hidden_states)
        new = self.w.fused(joined, self.capture_layers).split(counts, dim=1)
        for r, f in enumerate(new):
            known = self.features[r]
            self.features[r] = f if known is None else torch.cat([known, f], dim=1)

    def drop(self, keep: Sequence[int]) -> None:
        if self.cache is not None:
            self.cache.select_rows(keep)
        self.fed = [self.fed[r] for r in keep]
        self.features = [self.features[r] for r in keep]

    def extra_memory_bytes(self) -> int:
        """The head's KV cache, plus the drafting copies of its weights (fused, folded, int8),
        which exist from the session's start even if every draft was copied."""
        return self.w.memory_bytes() + (0 if self.layer is None else self.layer.memory_bytes())
