"""EAGLE's drafting (kinds/eagle/eagle.py holds the kind): the head's weights as drafting runs
them, the session the inference loop drives (a chain, or EAGLE-2's dynamic tree), and the
session that drafts the chains of a batch's rows together (EagleBatchSession).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.batch import BatchCache
from specdraft.core import (
    DecodeConfig,
    DraftContext,
    DraftTree,
    SamplingSettings,
    float_mask,
    kv_bytes,
)
from specdraft.drafters.base import warn_once
from specdraft.drafters.lean import (
    DraftLinear,
    LayerWeights,
    decode_layer,
    rms,
    use_int8,
)
from specdraft.drafters.sessions import BatchSession, DraftSession, check_features_known
from specdraft.drafting import DraftVocab, draft_chain, draft_chains, draft_tree

if TYPE_CHECKING:
    from specdraft.kinds.eagle.eagle import EagleDrafter


# --- session (inference): chain and EAGLE-2 dynamic tree ---------------------------------------


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
        """(1, n) tokens + (1, n, hidden) features -> the layer's input."""
        emb = self.head.target.embed(tokens).to(features.dtype)
        x = torch.cat([emb, features], dim=-1)  # the eagle3 layer norms them itself
        return x if self.input is None else self.input(x)

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) draft logits (the target's vocab for eagle1)."""
        return self.output(h if self.out_eps is None else rms(h, self.out_eps))

    def fused(
        self, hidden_states: Mapping[int, torch.Tensor], rows: list[int], layers: Sequence[int]
    ) -> torch.Tensor:
        """The features of the given positions (rows) of a verification forward, from its
        hidden states at `layers` (the session's capture_layers)."""
        if self.fuse is None:  # eagle1: the final feature as it is
            return self.head.fuse(hidden_states)[:, rows]
        dtype = self.layer.dtype
        low_mid_high = [hidden_states[i][:, rows].to(dtype) for i in layers]
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
        self, hidden_states: Mapping[int, torch.Tensor], rows: list[int], layers: Sequence[int]
    ) -> torch.Tensor:
        return self.head.fuse(hidden_states)[:, rows]

    def memory_bytes(self) -> int:
        return 0  # the modules' weights are the head's parameters


def verified_rows(
    session, tree: DraftTree, path: list[int], hidden_states: Mapping[int, torch.Tensor] | None
) -> list[int]:
    """The rows of the verification forward's `hidden_states` that hold verified tokens: the
    pending token(s), then the accepted nodes of `tree` along `path`. For a session whose
    drafter reads the target's features (EAGLE's, DFlash's), whose `accept` needs them."""
    name = type(session).__name__
    if hidden_states is None:
        raise ValueError(
            f"{name}.accept needs hidden_states: the verification forward's hidden states at "
            f"layers {session.capture_layers} (see the {name} docstring)"
        )
    positions = next(iter(hidden_states.values())).shape[1]
    pending = positions - len(tree)
    if pending < 1:
        raise ValueError(
            f"{name}.accept got hidden states for {positions} positions; expected the pending "
            f"token(s) then the {len(tree)} tree nodes"
        )
    return list(range(pending)) + [pending + i for i in path]


class EagleSession(DraftSession):
    """One generate call's drafting state: the head's KV cache and the target features it needs.

    Contract with the inference loop (beyond `DraftSession`):

    - `capture_layers: list[int]`: the target hidden-state ids the session needs; every
      verification forward must capture them (`Target.forward(..., capture_layers=...)`).
    - `accept(tree, path, hidden_states)` after EVERY verification forward, also when the tree
      was empty (the first step, which verifies the prompt, and steps at the end of generation)
      or drafted by someone else (a copy). `hidden_states[layer]` is (batch, pending + n,
      hidden): every position of that forward in order, i.e. the pending tokens (the whole
      prompt at first, then the root = the context's last token), then the n tree nodes in tree
      order.
    - The first `propose` returns an empty tree (no features yet); the loop's first forward is
      then a plain prefill whose hidden states go to `accept`.

    State: the head's cache holds one entry per pair (f_t, x_{t+1}) for t < `fed`, built from the
    target's true features; tree entries drafted from predicted features are cropped on accept
    and the accepted tokens are re-fed with their true features at the next proposal (in the same
    head call as the first draft level, so it costs no extra call).

    Running the head: through drafters/lean.py's LeanLayer (fused products, norm weights folded
    in, an in-place KV cache that a rejected draft leaves by moving a length) from weights the
    head builds once and shares across sessions; draft_weights=int8 makes them int8 copies (CPU).

    Drafting (settings from `decode`): a chain (tree_top_k = 1, drafting.draft_chain) or EAGLE-2's
    dynamic tree (drafting.draft_tree) whose levels are fed together, each node seeing the real
    prefix, its fed ancestors and itself.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        target,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        self.head = drafter
        self.sampling = sampling
        self.generator = generator
        self.decode = decode
        int8 = use_int8(decode.draft_weights, target.device, "the head's full weights")
        self.vocab = (
            DraftVocab(drafter.d2t, drafter.target.vocab_size)
            if drafter.config.version == "eagle3"
            else None
        )
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.w = drafter.drafting_weights(int8)  # lean's, or the head's modules
        if int8 and not self.w.int8:
            warn_once(
                f"draft_weights=int8 needs a layer drafters/lean.py runs ({type(drafter.layer)}"
                " is not one); drafting with the head's full weights"
            )
        self.layer = None  # the head's layer and KV cache, built at the first proposal
        self.fed = 0  # pairs (f_t, x_{t+1}) in the head's cache: t = 0 .. fed - 1
        self.features: torch.Tensor | None = None  # (batch, m, hidden): f_fed .. f_{fed+m-1}
        self._base = 0  # context length at the last proposal

    @property
    def _known(self) -> int:
        return self.fed + (0 if self.features is None else self.features.shape[1])

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        seq = context.tokens  # (batch, length)
        length = seq.shape[1]
        self._base = length
        depth = min(self.decode.gamma, context.max_depth)
        if self.features is None or depth <= 0:  # no features before the prompt's forward
            return DraftTree.empty(seq.shape[0], seq.device)
        check_features_known("EagleSession", self._known, length)
        if self.layer is None:  # room for the whole call: prompt, new tokens, one more draft
            self._build(capacity=length + context.max_depth + depth + 1)
        # 1. Feed the pairs with true features not yet in the head's cache (causally, at
        # positions fed .. length - 2); the last output (token = the root) drafts level 1.
        n_new = length - 1 - self.fed
        feats = self.features[:, :n_new]
        tokens = seq[:, self.fed + 1 : length].to(feats.device)
        h = self._step(tokens, feats, self.fed)[:, -1:]  # (batch, 1, hidden)
        self.fed, self.features = length - 1, self.features[:, n_new:]
        # 2. Draft below the root.
        if self.decode.chain:
            return self._chain(h, depth)
        return self._tree(h, depth)

    def _build(self, capacity: int) -> None:
        """The head's layer with an in-place KV cache for this call (drafters/lean.py), from the
        head's shared drafting weights; a layer layout LeanLayer does not know runs as modules."""
        self.layer = decode_layer(
            self.head.layer, self.head.rotary, capacity, weights=self.w.lean_layer
        )

    def _step(self, tokens, features, positions, visible=None) -> torch.Tensor:
        """One head pass: (1, n) tokens + (1, n, hidden) features -> (1, n, hidden) h, the keys
        appended to the head's cache. positions and visible as `LeanLayer.__call__` takes them."""
        return self.layer(self.w.layer_input(tokens, features), positions, visible)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) draft logits (the target's vocab for eagle1)."""
        return self.w.draft_logits(h)

    def _fuse(self, hidden_states: Mapping[int, torch.Tensor], rows: list[int]) -> torch.Tensor:
        """The features of the given positions (rows) of a verification forward."""
        return self.w.fused(hidden_states, rows, self.capture_layers)

    def _chain(self, h: torch.Tensor, depth: int) -> DraftTree:
        """Each drafted token is fed back with the head's own h as its feature."""
        pos = self._base - 1  # position id of level d is (length - 2) + d

        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal h  # level i + 1 sees the real prefix and the levels before it
            h = self._step(token, self.head.feedback(h[:, -1:]), pos + i)
            return self._logits(h[:, -1])

        return draft_chain(
            self._logits(h[:, -1]),
            step,
            depth=depth,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
            vocab=self.vocab,
        )

    def _tree(self, h: torch.Tensor, depth: int) -> DraftTree:
        """EAGLE-2's dynamic tree (batch 1): a node's feature is its parent's h."""
        h_of: dict[int, torch.Tensor] = {-1: h[0, -1]}  # node -> output h, for its children

        def expand(nodes, tokens, parents, visible, level):
            # the real prefix is visible to all
            prefix = torch.ones(len(nodes), self.fed, dtype=torch.bool)
            feats = self.head.feedback(torch.stack([h_of[p] for p in parents])[None])
            ids = torch.tensor([tokens], device=h.device)
            # level `level` sits at step level of the unroll from t = length - 2
            positions = [self._base - 2 + level] * len(nodes)
            out = self._step(ids, feats, positions, torch.cat([prefix, visible], 1))[0]
            for row, node in enumerate(nodes):
                h_of[node] = out[row]
            return self._logits(out)  # (f, draft vocab)

        tree, _ = draft_tree(
            self._logits(h[0, -1]),
            expand,
            depth=depth,
            top_k=self.decode.tree_top_k,
            budget=self.decode.tree_budget,
            vocab=self.vocab,
        )
        return tree

    @torch.no_grad()
    def accept(
        self,
        tree: DraftTree,
        path: list[int],
        hidden_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Take the true features of the verified tokens; drop the drafted entries of the cache.

        `path`: accepted node indices of `tree`, root to leaf. `hidden_states`: see the class
        docstring.
        """
        rows = verified_rows(self, tree, path, hidden_states)
        new = self._fuse(hidden_states, rows)  # (batch, pending + accepted, hidden)
        self.features = new if self.features is None else torch.cat([self.features, new], dim=1)
        if self.layer is not None:  # drafted entries were built from predicted features
            self.layer.crop(self.fed)

    def extra_memory_bytes(self) -> int:
        """The head's KV cache, plus the drafting copies of its weights (fused, folded, int8),
        which exist from the session's start even if every draft was copied."""
        return self.w.memory_bytes() + (0 if self.layer is None else self.layer.memory_bytes())


# --- batch session (inference): the chains of a batch's rows, one head pass per depth ----------


class EagleBatchSession(BatchSession):
    """The chains (tree_top_k = 1) of a batch's rows drafted together: one head pass feeds every
    row's pairs with true features not yet cached, then one pass per depth feeds every row's
    last drafted token. Each row drafts what `EagleSession` drafts for it alone (its depth, its
    stop_below, the same tokens at T = 0 and the same q at T > 0); rows are fed until the
    deepest is done, and a row's chain is cut where its own would end (drafting.draft_chains).

    The head's KV cache is one cache whose rows keep their own pairs at their own positions
    (specdraft/batch.py's BatchCache: a row's valid columns, its positions, masks that hide the
    rest), so rows of different lengths that accept different numbers of tokens stay exact. The
    drafted levels are held as the last columns of every row until `accept` crops them; the
    true pairs of the accepted tokens are fed at the next proposal, as EagleSession does.

    It runs the head's own modules: drafters/lean.py's layer and its int8 weights are one
    sequence's (an in-place cache), so draft_weights=int8 drafts a batch with full weights
    (Drafter.new_batch_session warns). EAGLE-2's trees are drafted row by row (RowSessions).
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        target,
        rows: int,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        self.head = drafter
        self.sampling, self.decode, self.generator = sampling, decode, generator
        self.vocab = (
            DraftVocab(drafter.d2t, drafter.target.vocab_size)
            if drafter.config.version == "eagle3"
            else None
        )
        self.capture_layers: list[int] = list(drafter.capture_layers)
        weight = drafter.layer.post_attention_layernorm.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.cache = BatchCache(rows, self.device)
        self.fed = [0] * rows  # per row: pairs (f_t, x_{t+1}) in the head's cache, t < fed
        # per row: (1, m, hidden) true features f_fed .. f_{fed+m-1}, None before the prompt's
        self.features: list[torch.Tensor | None] = [None] * rows
        self._pairs = 0  # the cache's columns of true pairs; drafted levels come after them

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        depths, tokens, features = self._take_pending(contexts, self.decode.gamma)
        if max(depths, default=0) <= 0:
            return [DraftTree.empty(1, self.device) for _ in contexts]
        # 1. Feed each row's pending pairs; its last output (token = its root) drafts level 1.
        h = self._feed(tokens, features, [len(t) for t in tokens])[:, -1]  # (rows, hidden)

        # 2. Each level is fed with the head's own h as its feature, every row at once.
        def step(token: torch.Tensor, i: int) -> torch.Tensor:
            nonlocal h
            h = self._feed_drafted(token, self.head.feedback(h))
            return self.head.draft_logits(h)

        return draft_chains(
            self.head.draft_logits(h),
            step,
            depths=depths,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
            vocab=self.vocab,
        )

    def _take_pending(
        self, contexts: Sequence[DraftContext | None], limit: int
    ) -> tuple[list[int], list[torch.Tensor], list[torch.Tensor]]:
        """Per row: its draft depth (at most `limit`; 0: none, as EagleSession drafts none
        before the prompt's features or where no token may follow), the tokens x_{fed+1} ..
        x_{length-1} of its pairs not yet in the head's cache (1-D, empty for a row that does
        not draft) and their true features (m, hidden). Those pairs count as fed from here."""
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
            check_features_known(type(self).__name__, self.fed[r] + known.shape[1], length, r)
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
        rows = len(tokens)
        no_tree = [DraftTree.empty(1, self.device)] * rows
        ids, mask, positions, P, _ = self.cache.verification_inputs(
            tokens, no_tree, self.dtype, None, pad_id=0
        )
        x = torch.zeros(rows, P, self.head.target.hidden_size, dtype=self.dtype, device=self.device)
        for r, f in enumerate(features):
            if len(f):
                x[r, P - len(f) :] = f
        h = self.head.step(ids, x, positions, mask, self.cache.cache)  # (rows, P, hidden)
        self.cache.keep(
            [list(range(P - len(t), P - len(t) + k)) for t, k in zip(tokens, kept, strict=True)]
        )
        self._pairs = self.cache.columns
        return h

    def _feed_drafted(self, token: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """Feed every row's drafted token (rows, 1) with its feature h (rows, hidden) at the
        row's next position, seeing the row's cache and itself: (rows, hidden) the next h. The
        entry is held as every row's last column until accept crops it (`_drop_drafted`)."""
        cache = self.cache
        rows = token.shape[0]
        own = torch.ones(rows, 1, dtype=torch.bool, device=self.device)
        allowed = torch.cat([cache.valid, own], dim=1)[:, None, None]  # (rows, 1, 1, C + 1)
        positions = cache.lengths[:, None]  # (rows, 1)
        out = self.head.step(
            token.to(self.device), h[:, None], positions, float_mask(allowed, self.dtype),
            cache.cache,
        )  # fmt: skip
        cache.append_tokens()
        return out[:, -1]

    def _drop_drafted(self) -> None:
        """Crop the drafted levels (every column after the true pairs): they were fed
        predicted features."""
        self.cache.crop(self._pairs)

    @torch.no_grad()
    def accept(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
    ) -> None:
        """Take each row's true features of its verified tokens (its pending token(s), then its
        accepted nodes, of any drafter's tree); drop the drafted entries of the cache. Every
        row's features are fused in one call."""
        picked = [
            verified_rows(self, tree, path, hidden)
            for tree, path, hidden in zip(trees, paths, hidden_states, strict=True)
        ]
        joined = {
            layer: torch.cat(
                [h[layer][:, rows] for h, rows in zip(hidden_states, picked, strict=True)], dim=1
            )
            for layer in self.capture_layers
        }  # layer -> (1, verified tokens of every row, hidden)
        new = self.head.fuse(joined).split([len(rows) for rows in picked], dim=1)
        for r, f in enumerate(new):
            known = self.features[r]
            self.features[r] = f if known is None else torch.cat([known, f], dim=1)
        self._drop_drafted()

    def drop(self, keep: Sequence[int]) -> None:
        self._drop_drafted()
        self.cache.select_rows(keep)
        self.fed = [self.fed[r] for r in keep]
        self.features = [self.features[r] for r in keep]

    def extra_memory_bytes(self) -> int:
        """The head's KV cache (the modules' weights are its parameters)."""
        return kv_bytes(self.cache.cache)
