"""P-EAGLE (parallel EAGLE): an EAGLE-3 head that drafts K tokens in one forward pass.

The head is EAGLE-3's (kinds/eagle/eagle.py: low/mid/high target features fused by fc, one Llama
decoder layer reading cat(embedding, feature), a reduced draft vocabulary), and so are its
weights' names and its context KV cache. What P-EAGLE adds is K - 1 "parallel" slots after the
usual step. Drafting after the context x_0 .. x_{L-1}:

    slot 0        (f_{L-2}, x_{L-1}) at position L - 2, as EAGLE-3       -> predicts x_L
    slot d >= 1   (fc(mask_hidden), x_mask) at position L - 2 + d         -> predicts x_{L+d}

A parallel slot does not know its feature yet (the target has not run there) nor its token (it
has not been drafted), so it reads a learned placeholder, `mask_hidden` (1, 1, 3 hidden: the
raw low/mid/high width, fused by the head's own fc as real features are), and the embedding of
`mask_token_id`. Slots attend causally to the context and to the earlier slots of their group;
they are never kept in the head's cache (the session's proposal drops them once drafted).

Training (conditional drop-token sampling, COD): at anchor t (the pair (f_t, x_{t+1})) depth 0
is the ordinary step, scored against the target's distribution at t + 1; depth d is slot d of
the group anchored at t, scored at t + 1 + d. Depth 0 keeps every position; depth d keeps about
n * max(r^d, r_min) of the anchors kept at depth d - 1 (n: the anchors scored at depth 0), so a
sequence costs ~n (1 + r + r^2 ...) slots instead of K n. Each kept slot's loss is the KL from
the target's distribution (restricted to the draft vocabulary and renormalised, as EAGLE-3) to
the head's. The draws are per sample, from a generator seeded by the step and the sample's index
in the training set (`prepare_batch`), so a resumed run and a two-process run draw what one does.
In a packed row (data.pack) each conversation is such a sample: COD draws its slots from its own
index and scored tokens, and a slot attends to its own document only, so it trains exactly as
in a row of its own.

The embedding is the target's, frozen (as our EAGLE heads; speculators trains a copy for
P-EAGLE, `embed_requires_grad`): a V x H trainable copy and its optimizer state would be the
largest thing in the head, and the slots already have a learned input (`mask_hidden`).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from specdraft.attention import document_seeds, document_spans
from specdraft.config import choice
from specdraft.core import DecodeConfig, DraftContext, DraftTree, float_mask
from specdraft.drafters.base import Metrics, sum_and_count
from specdraft.drafters.position_tree import slot_drafts, tree_reach
from specdraft.drafters.served import alpha_agreement, depth_sums, one_later
from specdraft.kinds.dflash.dflash import default_mask_token
from specdraft.kinds.eagle.eagle import (
    EagleDrafter,
    check_feature_layers,
    resolve_eagle3,
    scored,
    target_at,
)
from specdraft.kinds.eagle.eagle_session import EagleSession
from specdraft.losses import token_losses

# --- config ------------------------------------------------------------------------------------


@dataclass
class PEagleConfig:
    # K: the tokens one forward drafts (the EAGLE-3 step and K - 1 parallel slots); speculators'
    # num_depths. Chains served are min(decode.gamma, K) long.
    num_depths: int = 4
    # The target hidden-state ids fused into the feature (as EAGLE-3's feature_layers); None:
    # EAGLE-3's low/mid/high choice for the target.
    feature_layers: list[int] | None = None
    # Size of the draft vocabulary (the most frequent target tokens of the training data, EOS
    # always in); 0: the target's whole vocabulary.
    draft_vocab_size: int = 0
    # The residual around the layer's attention is hidden_norm(feature) (True) or the feature.
    norm_before_residual: bool = False
    # COD sampling: depth d keeps about n * max(down_sample_ratio^d, down_sample_ratio_min) of
    # the n scored positions; 1 keeps every one (K n slots per sequence).
    down_sample_ratio: float = 0.7
    down_sample_ratio_min: float = 0.2
    # The token whose embedding the parallel slots read; None: the tokenizer's mask, pad or unk
    # token, else the last id. Resolved when the head is built and saved with it.
    mask_token_id: int | None = None
    # The loss against the target's distribution: fkl (KL(p || q), speculators') | lk |
    # lk_hybrid (the LK losses: specdraft/losses.py) | soft_ce | tvd | rkl | jsd.
    divergence: str = choice("fkl", "lk", "lk_hybrid", "soft_ce", "tvd", "rkl", "jsd")

    # What EagleDrafter reads of its config: P-EAGLE's head is always EAGLE-3's reference layer.
    version: ClassVar[str] = "eagle3"

    def __post_init__(self) -> None:
        if isinstance(self.num_depths, bool) or self.num_depths < 2:
            raise ValueError(
                f"drafter.num_depths must be >= 2 (K: the EAGLE-3 step and at least one "
                f"parallel slot); got {self.num_depths}"
            )
        if not 0 < self.down_sample_ratio <= 1:
            raise ValueError(
                f"drafter.down_sample_ratio must be in (0, 1]; got {self.down_sample_ratio}"
            )
        if not 0 <= self.down_sample_ratio_min <= 1:
            raise ValueError(
                f"drafter.down_sample_ratio_min must be in [0, 1]; got {self.down_sample_ratio_min}"
            )
        if self.draft_vocab_size < 0:
            raise ValueError(f"drafter.draft_vocab_size must be >= 0; got {self.draft_vocab_size}")
        check_feature_layers(self.feature_layers)
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"drafter.mask_token_id must be >= 0; got {self.mask_token_id}")

    def keep_ratio(self, depth: int) -> float:
        """The share of the scored positions COD keeps at `depth` (1 at depth 0)."""
        return max(self.down_sample_ratio**depth, self.down_sample_ratio_min) if depth else 1.0


def resolve_config(config: PEagleConfig, target) -> PEagleConfig:
    """A copy of `config` with the feature layers and the mask token filled in for `target`, or a
    clear error."""
    config = copy.deepcopy(config)
    resolve_eagle3(config, target)
    wanted, V = config.mask_token_id, target.vocab_size
    if wanted is not None and not 0 <= wanted < V:
        raise ValueError(
            f"drafter.mask_token_id={wanted} is not a token of the target {target.name!r} "
            f"(ids 0..{V - 1}); pick one of its ids, or null for its mask/pad/unk token"
        )
    config.mask_token_id = default_mask_token(target) if wanted is None else int(wanted)
    return config


# --- COD sampling ------------------------------------------------------------------------------


def cod_keep(valid: torch.Tensor, config: PEagleConfig, generator: torch.Generator) -> torch.Tensor:
    """(depths, S) bool: the slots one sequence trains, from its `valid` (depths, S) (`scored`).

    1. Depth 0 keeps every anchor (they are the context every slot attends to).
    2. Depth d draws, without replacement, int(n * keep_ratio(d)) of the anchors kept at depth
       d - 1 whose depth-d token is scored (all of them when fewer), n = the depth-0 scored
       count: a slot needs its group's earlier slots, which it attends to.
    """
    keep = torch.zeros_like(valid)
    keep[0] = True
    n = int(valid[0].sum())
    for d in range(1, valid.shape[0]):
        candidates = (keep[d - 1] & valid[d]).nonzero().flatten()
        size = min(len(candidates), int(n * config.keep_ratio(d)))
        if size <= 0:
            break
        order = torch.randperm(len(candidates), generator=generator)[:size]
        keep[d, candidates[order.to(candidates.device)]] = True
    return keep


def document_keep(
    batch: Mapping[str, torch.Tensor], config: PEagleConfig, seeds: list[list[int]]
) -> torch.Tensor:
    """(batch, K, S) bool: COD's draws for every document of the batch (a row, or each of a
    packed row's: `document_spans`), each from a generator of its seed and its own `scored`
    slots, so a document draws the same in a row of its own or packed; depth 0 keeps every
    anchor, the padding's too."""
    valid = scored(batch["loss_mask"], config.num_depths, batch.get("document_ids")).cpu()
    keep = torch.zeros_like(valid)
    keep[:, 0] = True
    for row, (docs, doc_seeds) in enumerate(zip(document_spans(batch), seeds, strict=True)):
        for (start, n), seed in zip(docs, doc_seeds, strict=True):
            part = valid[row, :, start : start + n]  # the document's anchors
            generator = torch.Generator().manual_seed(seed)
            keep[row, :, start : start + n] = cod_keep(part, config, generator)
    return keep.to(batch["input_ids"].device)


def row_seed(tokens: torch.Tensor) -> int:
    """A seed from a document's token ids (Python hashes int tuples the same in every
    process)."""
    return hash(tuple(tokens.tolist())) % (2**63 - 1)


# --- module ------------------------------------------------------------------------------------


class PEagleDrafter(EagleDrafter):
    """EAGLE-3's head (kinds/eagle/eagle.py) with the parallel slots' learned feature."""

    kind = "peagle"
    title = "P-EAGLE"
    config_class = PEagleConfig
    resolve = staticmethod(resolve_config)

    def __init__(self, config: PEagleConfig, target, d2t: torch.Tensor | None = None) -> None:
        super().__init__(config, target, d2t)
        H = target.hidden_size
        # the parallel slots' feature before fc, at the width of the fused target states
        self.mask_hidden = nn.Parameter(torch.randn(1, 1, 3 * H))

    def mask_feature(self) -> torch.Tensor:
        """(1, 1, hidden): the parallel slots' feature, fc(mask_hidden)."""
        return self.fc_fuse(self.mask_hidden.to(self.fc_fuse.weight.dtype))

    # --- training ---------------------------------------------------------------------------

    def prepare_batch(self, batch: dict, target, generator, shared: torch.Generator) -> dict:
        """COD's draws for each sample (batch["cod_keep"], (batch, K, S) bool), from a generator
        seeded by the step's seed (the same on every process) and the sample's index in the
        training set (a packed row's documents: their own, `document_seeds`): independent of
        how the global batch is split, and of packing."""
        if "example_index" in batch:
            seeds = document_seeds(batch, shared.initial_seed())
            batch["cod_keep"] = document_keep(batch, self.config, seeds)
        return batch

    def _keep(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The batch's COD draws; outside training (evaluation, no prepare_batch) drawn from each
        document's own tokens, so a held-out conversation is scored the same in every
        evaluation, however it is batched or packed."""
        if "cod_keep" in batch:
            return batch["cod_keep"]
        ids = batch["input_ids"].cpu()
        seeds = [
            [row_seed(ids[r, s : s + n]) for s, n in docs]
            for r, docs in enumerate(document_spans(batch))
        ]
        return document_keep(batch, self.config, seeds)

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The kept slots whose token carries loss (a slot whose target argmax is outside the draft
        vocabulary adds 0 to the sum)."""
        valid = scored(batch["loss_mask"], self.config.num_depths, batch.get("document_ids"))
        return (self._keep(batch) & valid).sum().float()

    def slots(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        keep: torch.Tensor,
        logits: bool = True,
    ) -> dict[str, torch.Tensor]:
        """Run the head over every kept slot of the batch at once, each row's slots flattened
        depth by depth (padded to the longest row) with the attention P-EAGLE's drafting has:
        a slot (anchor a, depth d) sees depth 0 at anchors <= a and its own group's depths <= d
        (in a packed row, anchors of a's document only, at the document's positions).

        Returns, per flattened slot (batch, N): h (hidden), logits (draft vocab; logits=False:
        left out, for the loss, which makes them a chunk at a time), p_at (the position
        a + 1 + d of the target's distribution it learns), depth, and valid (kept, real, its
        token scored).
        """
        input_ids = batch["input_ids"]
        B, T = input_ids.shape
        K = keep.shape[1]
        device = input_ids.device
        valid = scored(batch["loss_mask"], K, batch.get("document_ids")) & keep
        per_row = [keep[b].nonzero() for b in range(B)]  # (n_b, 2): (depth, anchor), depth-major
        N = max(len(r) for r in per_row)
        depth = torch.zeros(B, N, dtype=torch.long, device=device)
        anchor = torch.zeros(B, N, dtype=torch.long, device=device)
        real = torch.zeros(B, N, dtype=torch.bool, device=device)
        for b, r in enumerate(per_row):
            depth[b, : len(r)], anchor[b, : len(r)], real[b, : len(r)] = r[:, 0], r[:, 1], True
        zero = depth == 0
        features = self.fuse(target_out.hidden_states)  # (B, T, hidden)
        feat = features.gather(1, anchor[..., None].expand(-1, -1, features.shape[-1]))
        feat = torch.where(zero[..., None], feat, self.mask_feature().to(feat.dtype))
        tokens = input_ids.gather(1, (anchor + 1).clamp(max=T - 1))
        tokens = tokens.where(zero, self.config.mask_token_id)
        a_q, a_k = anchor[:, :, None], anchor[:, None, :]
        d_q, d_k = depth[:, :, None], depth[:, None, :]
        allowed = ((d_k == 0) & (a_k <= a_q)) | ((a_k == a_q) & (d_k <= d_q))
        positions = anchor + depth
        documents = batch.get("document_ids")
        if documents is not None:  # a packed row: the anchor's own document, its positions
            own = documents.gather(1, anchor)  # (B, N)
            allowed = allowed & (own[:, :, None] == own[:, None, :])
            positions = batch["position_ids"].gather(1, anchor) + depth
        allowed = (allowed & real[:, None, :]) | torch.eye(N, dtype=torch.bool, device=device)
        mask = float_mask(allowed, feat.dtype)[:, None]  # (B, 1, N, N)
        h = self.step(tokens, feat, positions, mask, None)  # (B, N, hidden)
        p_at = (anchor + 1 + depth).clamp(max=T - 1)  # (B, N)
        ok = valid[torch.arange(B, device=device)[:, None], depth, anchor] & real
        out = {"h": h, "p_at": p_at, "depth": depth, "valid": ok}
        if logits:
            out["logits"] = self.draft_logits(h)
        return out

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """Sum over the kept slots of KL(p || q) (or drafter.divergence): p the target's distribution at the slot's token,
        restricted (and renormalised) to the draft vocabulary, q the head's; a slot whose target
        argmax is outside the draft vocabulary adds 0. Over `loss_tokens(batch)` slots."""
        s = self.slots(batch, target_out, self._keep(batch), logits=False)
        rows, slot = s["valid"].nonzero(as_tuple=True)  # the scored slots, (n,) each
        target, target_head = target_at(self, target_out, rows, s["p_at"][rows, slot])
        losses = token_losses(
            s["h"][rows, slot], self.draft_logits, target=target, target_head=target_head,
            target_rows=self.d2t if self.reduced_vocab else None, divergence=self.config.divergence,
            top_k=1, chunk_tokens=self.loss_chunk_tokens,
        )  # fmt: skip
        valid = losses.target_token >= 0  # (n,): the target's argmax is draftable
        kl, depth = losses.divergence, s["depth"][rows, slot]
        metrics: Metrics = {}
        for d in range(self.config.num_depths):
            at = valid & (depth == d)
            metrics[f"loss_{d}"] = sum_and_count(kl, at)
            metrics[f"top1_{d}"] = sum_and_count(losses.hits[:, 0], at)
        return kl.where(valid, 0).sum(), metrics

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha summed, greedy agreement summed, count) per draft depth 1..min(gamma, K), with
        every anchor's group drafted (no COD): alpha = sum_x min(p(x), q(x)), p the target's
        softmax over the full vocabulary, q the head's mapped to it (0 outside the draft
        vocabulary); greedy agreement: the head's argmax is the target's."""
        depths = min(decode.gamma, self.config.num_depths)
        S = batch["input_ids"].shape[1] - 1
        keep = torch.ones(batch["input_ids"].shape[0], depths, S, dtype=torch.bool)
        s = self.slots(batch, target_out, keep.to(batch["input_ids"].device))
        p_logits = target_out.logits.gather(
            1, s["p_at"][..., None].expand(-1, -1, target_out.logits.shape[-1])
        )  # (B, N, vocab)
        alpha, agree = alpha_agreement(p_logits, s["logits"], self.d2t)  # (B, N) each
        return depth_sums((alpha, agree, s["valid"] & (s["depth"] == d)) for d in range(depths))

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """The chain's logits after every position from one head pass: after a context ending
        at c, the slots at anchor c - 1, depth 0 fed the true pair and the rest the mask (they
        do not read the drafts, so a tree's nodes take theirs from the same slots)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        depths, S = min(decode.gamma, self.config.num_depths), T - 1
        keep = torch.ones(B, depths, S, dtype=torch.bool, device=ids.device)
        logits = self.slots(batch, target_out, keep)["logits"]  # (B, depths * S), depth-major
        logits = logits.view(B, depths, S, -1).transpose(1, 2)  # (B, S, depths, Vd)
        return one_later(logits, 0.0)  # nothing is drafted after the first token alone

    def sampled_tree_reach(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig,
        temperature: float,
    ) -> torch.Tensor:  # fmt: skip
        """The tree the session samples from its slots' own confidences (position_tree.tree_reach)."""
        return tree_reach(self, batch, target_out, decode, temperature=temperature)

    # --- decoding ---------------------------------------------------------------------------

    def depth_cap(self) -> tuple[int, str]:
        K = self.config.num_depths
        return K, f"one forward drafts {K} tokens (drafter.num_depths)"


class PEagleSession(EagleSession):
    """EAGLE-3's session (kinds/eagle/eagle_session.py: the head's context cache fed the target's
    true features, one cache for the rows), whose proposal is one head pass: each row's pending
    true pairs, then its depth - 1 parallel slots, which are never kept in the cache. Each row
    draws a chain from its own slots (drafting.draft_chains: its depth, its stop_below), or a
    session of one row with tree_top_k > 1 a tree of the slots' top candidates
    (drafters/position_tree.py)."""

    def __init__(self, drafter: PEagleDrafter, target, rows: int = 1, **kwargs) -> None:
        super().__init__(drafter, target, rows, **kwargs)
        with torch.no_grad():
            w = self.w  # the slots' feature, fused as true features are while drafting
            self.mask_feature = (
                drafter.mask_feature() if w.lean_layer is None else w.fuse(drafter.mask_hidden)
            )[0, 0].to(self.dtype)  # (hidden,)

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        K = self.head.config.num_depths
        depths, tokens, features = self._take_pending(contexts, min(self.decode.gamma, K))
        if max(depths, default=0) <= 0:
            return [DraftTree.empty(1, self.device) for _ in contexts]
        self._build(contexts, K)
        # 1. One pass: each row's pairs with true features not yet cached (the last holds its
        # root), then its depth - 1 slots; only the pairs stay in the cache.
        mask_id = self.head.config.mask_token_id
        slots = [max(d - 1, 0) for d in depths]
        h = self._feed(
            [torch.cat([t, t.new_full((s,), mask_id)]) for t, s in zip(tokens, slots, strict=True)],
            [
                torch.cat([f, self.mask_feature.to(f.dtype).expand(s, -1)])
                for f, s in zip(features, slots, strict=True)
            ],
            [len(t) for t in tokens],
        )  # (rows, P, hidden)
        # 2. Row r's slot d (its depth d + 1) sits at column P - depth_r + d; a slot does not
        # read the token drawn before it.
        P, deepest = h.shape[1], max(depths)
        d = torch.arange(deepest, device=self.device)
        depth = torch.tensor(depths, device=self.device).clamp(min=1)[:, None]
        columns = P - depth + torch.minimum(d[None], depth - 1)  # (rows, deepest)
        picked = h.gather(1, columns[..., None].expand(-1, -1, h.shape[-1]))
        logits = self._logits(picked)  # (rows, deepest, draft vocab)
        return slot_drafts(
            logits, depths, decode=self.decode, sampling=self.sampling,
            generator=self.generator, vocab=self.vocab, device=self.device,
        )  # fmt: skip


# the head's sessions are EAGLE's, drafting through the parallel slots (EagleDrafter.new_session)
PEagleDrafter.session_class = PEagleSession
