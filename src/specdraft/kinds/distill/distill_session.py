"""The two-model drafter's session: drafting for a prompt decoded alone (a batch of one) or the
chains of a batch's rows together, on the student's own KV cache; the drafter is
kinds/distill/distill.py."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from specdraft.attention import AttentionLayout
from specdraft.batch import BatchCache
from specdraft.core import (
    DecodeConfig,
    DraftContext,
    DraftTree,
    SamplingSettings,
    float_mask,
)
from specdraft.drafters.base import vocab_mismatch_error, warn_once
from specdraft.drafters.lean import use_int8
from specdraft.drafters.sessions import BatchSession, check_trees_alone
from specdraft.drafting import draft_chains, draft_tree
from specdraft.kinds.distill.distill_layers import LeanModel, ModelWeights, ModuleModel

if TYPE_CHECKING:
    from specdraft.kinds.distill.distill import DistillDrafter

# dynamic_gamma grows gamma up to this (or the configured gamma, if larger)
DYNAMIC_GAMMA_CEILING = 16


class DistillSession(BatchSession):
    """One generate call's drafting for its rows (one for a prompt decoded alone): the student's
    KV cache, one for the rows (specdraft/batch.py's BatchCache: a row's valid columns, its
    positions, masks that hide the rest), and each row's gamma.

    Drafting runs the student autoregressively:
    - chains: one pass feeds every row's pending tokens, then one per depth every row's last
      drafted token (drafting.draft_chains: each row's gamma, max depth and stop_below; argmax
      if greedy, else sampled from q, which is recorded for lossless verification), through
      distill_layers.py's LeanModel (maybe int8) where the student's layout allows (`weights`),
      else through its modules; while no row has holes (one row always) every pass runs
      causally without a mask;
    - for a session of one row, EAGLE-2's dynamic tree (drafting.draft_tree) through the
      modules, its levels fed with a tree mask (a batch drafts trees row by row);
    - with dynamic_gamma, a row's gamma grows after a fully accepted draft and shrinks otherwise.
    A row's cache holds the first tokens of its context; a proposal first feeds the rest, so a
    tree this session did not draft (a copy) needs nothing but to be left alone.
    """

    def __init__(
        self,
        drafter: DistillDrafter,
        target,
        rows: int = 1,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        if drafter.vocab_size != target.vocab_size:
            raise vocab_mismatch_error("the draft model", drafter.vocab_size, target)
        decode = drafter.decode_settings(decode)  # the kind's own class, whatever was passed
        check_trees_alone(self, rows, decode)
        model = drafter.hf_model
        self.model, self.decode = model, decode
        self.sampling, self.generator = sampling, generator
        # chains draft through distill_layers.py's LeanModel where the student's layout allows
        self.weights: ModelWeights | None = None
        if decode.chain:
            int8 = use_int8(decode.draft_weights, model.device, "the student's full weights")
            self.weights = drafter.drafting_weights(int8)
            if self.weights is None and int8:
                warn_once(
                    f"draft_weights=int8 needs a student drafters/lean.py runs "
                    f"({type(model).__name__} is not one); drafting with its full weights"
                )
        self.student: LeanModel | ModuleModel | None = None  # built at the first proposal
        # every layer keeps every key, so a rejected draft crops away whatever the layer type;
        # a sliding student drafts its tree levels without its window (a draft: the target's
        # verification keeps the output exact either way)
        self.layout = AttentionLayout.of(model.config)
        self.cache: BatchCache | None = None  # built at the first proposal
        self.gamma = [decode.gamma] * rows
        self.max_gamma = max(DYNAMIC_GAMMA_CEILING, decode.gamma)
        self.max_positions = getattr(model.config, "max_position_embeddings", None)
        self._base: list[int] = [0] * rows  # each row's context length at the last proposal
        self._depth: list[int] = [0] * rows
        self._drafted: list[bool] = [False] * rows  # the row drafted at the last proposal
        self._fed = 0  # drafted tokens fed to every row at the last proposal
        self._tree_slots: list[int] | None = None  # a tree's fed nodes' columns, in feed order
        self._trees: list[DraftTree] | None = None  # the last proposal's, until its accept

    def _build(self, contexts: Sequence[DraftContext | None]) -> None:
        """The student's cache, with room for the whole call (prompt, new tokens, a draft)."""
        if self.cache is not None:
            return
        rows = len(self.gamma)
        if self.weights is None:
            self.student = ModuleModel(self.model)
        else:
            room = max(
                (c.tokens.shape[1] + c.max_depth for c in contexts if c is not None), default=0
            )
            self.student = LeanModel(self.weights, capacity=room + 1, rows=rows)
        self.cache = BatchCache(rows, self.model.device, store=self.student)

    def _feed(self, pending: list[torch.Tensor]) -> torch.Tensor:
        """Feed each row's tokens (1-D, maybe none) at its next positions: (rows, vocab) logits
        after each row's last."""
        cache, device = self.cache, self.model.device
        if len({len(p) for p in pending}) == 1 and cache.dense:  # alike: causal, no mask
            ids = torch.stack(pending)
            logits = self.student(ids)
            cache.append_tokens(ids.shape[1])
            return logits
        no_tree = [DraftTree.empty(1, device)] * len(pending)
        ids, mask, positions, P, _ = cache.verification_inputs(
            pending, no_tree, self.model.dtype, self.layout, pad_id=0
        )
        logits = self.student(ids, positions, mask)
        cache.keep([list(range(P - len(p), P)) for p in pending])
        return logits

    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        device = self.model.device
        self._build(contexts)
        depths, pending = [], []
        for r, context in enumerate(contexts):
            held = int(self.cache.lengths[r])
            if context is None:  # nothing to draft: its cache stays as it is
                depths.append(0)
                pending.append(torch.empty(0, dtype=torch.long, device=device))
                self._base[r] = held
                continue
            seq = context.tokens[0].to(device)
            depth = min(self.gamma[r], context.max_depth)
            if self.max_positions is not None:  # a draft may have fewer positions than the target
                depth = min(depth, self.max_positions - len(seq))
            depths.append(max(depth, 0))
            pending.append(seq[held:])
            self._base[r] = len(seq)
        self._depth = depths
        self._drafted = [d > 0 for d in depths]
        self._fed, self._tree_slots = 0, None
        self._trees = self._draft(pending, depths)
        return self._trees

    def _draft(self, pending: list[torch.Tensor], depths: list[int]) -> list[DraftTree]:
        """Feed each row's pending tokens and draft below them."""
        if max(depths) <= 0:
            return [DraftTree.empty(1, self.model.device) for _ in depths]
        logits = self._feed(pending)
        if not self.decode.chain:
            return [self._tree_draft(logits[0], depths[0])]

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

    def _tree_draft(self, root_logits: torch.Tensor, depth: int) -> DraftTree:
        """Grow the tree below the fed context (one row); each level is fed with a mask that
        lets every node see the context, its fed ancestors and itself. Its nodes' entries stay
        after the context's columns until `accept` keeps the accepted ones."""
        device, dtype = self.model.device, self.model.dtype
        base, context = self._base[0], self.cache.valid[0]

        def expand(nodes, tokens, parents, visible, level):
            allowed = torch.cat([context.expand(len(nodes), -1), visible.to(device)], dim=1)
            positions = torch.full((1, len(nodes)), base - 1 + level, device=device)
            ids = torch.tensor([tokens], device=device)
            mask = float_mask(allowed, dtype)[None, None]
            return self.student(ids, positions, mask, every=True)[0]

        tree, self._tree_slots = draft_tree(
            root_logits, expand, depth=depth, top_k=self.decode.tree_top_k,
            budget=self.decode.tree_budget,
        )  # fmt: skip
        return tree

    def accept(self, trees, paths, hidden_states) -> None:
        """Keep each row's context and its accepted drafted tokens that were fed; adapt gamma.
        A row whose verified tree is not the one it proposed (another drafter's, a copy) keeps
        its context only; after a verification this session proposed nothing for (a copy
        driven through OneRow) the cache stays as it is. Either way the copy's tokens are fed at
        the next proposal."""
        if self._trees is None:
            return
        proposed, self._trees = self._trees, None
        ours = [
            drafted and tree is mine
            for drafted, tree, mine in zip(self._drafted, trees, proposed, strict=True)
        ]
        if self._tree_slots is not None:  # one row's tree: its accepted fed nodes
            path = paths[0] if ours[0] else []
            self.cache.keep([[self._tree_slots[i] for i in path if self._tree_slots[i] >= 0]])
        lengths = []
        for r, path in enumerate(paths):
            if not ours[r]:  # no draft, or another drafter's (a copy): no draft of it stays
                lengths.append(self._base[r])
                continue
            fed = len(path) if self._tree_slots is not None else min(len(path), self._fed)
            lengths.append(self._base[r] + fed)
            if self.decode.dynamic_gamma:  # grow after a draft accepted to the depth asked for
                if len(path) == self._depth[r]:
                    self.gamma[r] = min(self.gamma[r] + 2, self.max_gamma)
                else:
                    self.gamma[r] = max(1, self.gamma[r] - 1)
        self.cache.truncate(lengths)
        self._fed, self._tree_slots = 0, None

    def drop(self, keep) -> None:
        if self.cache is not None:
            self.cache.select_rows(keep)
        for name in ("gamma", "_base", "_depth", "_drafted"):
            values = getattr(self, name)
            setattr(self, name, [values[r] for r in keep])

    def extra_memory_bytes(self) -> int:
        """The student's KV cache, plus the lean drafting copies of its weights if any."""
        copies = 0 if self.weights is None else self.weights.memory_bytes()
        return copies + (0 if self.student is None else self.student.memory_bytes())
