"""DFlash: a few decoder layers that draft a whole block of tokens in one non-causal pass.

DFlash (block diffusion drafting, as vllm-project/speculators 0.9.0 trains it and vLLM serves it):
the target's hidden states at a few layers (`aux_layers`, EAGLE-3's low/mid/high by default) are
concatenated, projected (`fc`, no bias) and normed (`hidden_norm`): the context's features. A
block of `block_size` B positions holds the anchor token in slot 0 (the context's last token,
whose hidden state the target has not computed yet) and `mask_token_id` in slots 1..B-1, embedded
by the target's own (shared, frozen) embedding at positions anchor + 0..B-1. Each of `num_layers`
Qwen3-style layers (q/k/v/o, per-head q_norm/k_norm, SiLU MLP, pre-norms) lets the block's
queries attend to the context's features, projected by that layer's k_proj/v_proj as keys and
values, and to the whole block (not causally). After the final `norm`, the target's (shared,
frozen) LM head gives slot i's distribution over the token at anchor + i: one pass drafts B - 1
tokens.

Training: anchors are drawn per sequence among positions with room for a whole block (`anchors`
of them per sequence per step, from a generator seeded by the step and the example's index:
`prepare_batch`). In a packed row (data.pack) each conversation is such a sequence: its anchors
are drawn from its own index, its blocks stay inside it and see only its context, so it trains
exactly as in a row of its own. Slot i learns the target's own distribution at anchor + i - 1
(KL), weighted by exp(-(i - 1) / position_decay). The loss sum is over the anchors' scored slots,
which the batch alone counts (`loss_tokens`).

Decoding (DFlashSession, for one row or a batch's rows, one block pass for all): the
context's keys and values per layer are computed once, from the verification forward's hidden
states of the accepted positions (`accept`); `propose` runs the block once and returns a chain of
min(gamma, B - 1) tokens: each slot's argmax, or at temperature > 0 a draw from each slot's own
processed distribution q_i, recorded for lossless verification (the slots are drawn
independently, a valid proposal distribution for the chain). With tree_top_k > 1 it returns a
tree of the slots' top candidates instead (drafters/position_tree.py), drafted row by row in a
batch.

Read top to bottom: the config, the module (features, context keys, the block; its layers are
kinds/dflash/dflash_layers.py), the loss and acceptance; the session (one row or a batch's) is
kinds/dflash/dflash_session.py. Weight names are speculators' (kinds/dflash/dflash_export.py).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from specdraft.attention import document_seeds, document_spans
from specdraft.config import choice
from specdraft.core import (
    DecodeConfig,
)
from specdraft.drafters.base import Drafter, Metrics, sum_and_count
from specdraft.drafters.position_tree import tree_reach
from specdraft.drafters.served import alpha_agreement, depth_sums
from specdraft.kinds.dflash.dflash_layers import DFlashLayer
from specdraft.kinds.dflash.dflash_session import ContextKV, DFlashSession
from specdraft.kinds.eagle.eagle import (
    default_feature_layers,
    target_at,
)
from specdraft.kinds.eagle.eagle_layers import head_layer_config
from specdraft.losses import token_losses

# --- config ------------------------------------------------------------------------------------


@dataclass
class DFlashConfig:
    # Decoder layers of the drafter (Qwen3-style, in the target's shape).
    num_layers: int = 1
    # Positions B of a block: slot 0 holds the anchor, slots 1..B-1 the mask token; one pass
    # drafts B - 1 tokens. At least 2.
    block_size: int = 8
    # The target hidden-state ids whose concatenation is the context's feature (0 = embeddings,
    # i = output of decoder layer i, L = final normed state). None: EAGLE-3's low/mid/high choice
    # for the target (kinds/eagle/eagle.py default_feature_layers).
    aux_layers: list[int] | None = None
    # The token id in slots 1..B-1 (its embedding is the target's). None: the tokenizer's mask
    # token, else its pad, else its unk, else the last id; the resolved id is saved.
    mask_token_id: int | None = None
    # Anchors drawn per sequence per training step (fewer where a sequence has fewer positions
    # with room for a whole block). Each costs B drafter positions.
    anchors: int = 16
    # Slot i's loss is weighted exp(-(i - 1) / position_decay) (speculators' default 4: early
    # slots matter most, since a chain stops at its first rejection); 0: every slot alike.
    position_decay: float = 4.0
    # random: layers as nn.Linear initialises them. target: copy the target's last num_layers
    # decoder layers' matching weights (projections, MLP, norms) and its final norm.
    init: str = choice("random", "target")
    # The loss against the target's distribution: fkl (KL(p || q), speculators') | lk |
    # lk_hybrid (the LK losses, which train for the acceptance rate: specdraft/losses.py) |
    # soft_ce | tvd | rkl | jsd.
    divergence: str = choice("fkl", "lk", "lk_hybrid", "soft_ce", "tvd", "rkl", "jsd")

    def __post_init__(self) -> None:
        for key, low in (("num_layers", 1), ("block_size", 2), ("anchors", 1)):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                why = " (slot 0 holds the anchor, so a block drafts block_size - 1 tokens)"
                raise ValueError(
                    f"drafter.{key} must be an integer >= {low}"
                    f"{why if key == 'block_size' else ''}; got {value!r}"
                )
        if not self.position_decay >= 0:
            raise ValueError(
                f"drafter.position_decay must be >= 0 (0: every slot weighted alike); got "
                f"{self.position_decay}"
            )
        if self.aux_layers is not None and not self.aux_layers:
            raise ValueError("drafter.aux_layers is empty: name target layers, or null")


def resolve_config(config: DFlashConfig, target) -> DFlashConfig:
    """A copy of `config` with the target-dependent defaults filled in (aux layers, mask id),
    or a clear error for values the target cannot have."""
    config = copy.deepcopy(config)
    layers = config.aux_layers or default_feature_layers(target.num_layers)
    config.aux_layers = target.check_layer_ids(layers)
    if config.mask_token_id is None:
        config.mask_token_id = default_mask_token(target)
    mask = config.mask_token_id
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < target.vocab_size:
        raise ValueError(
            f"drafter.mask_token_id={mask!r} is outside the target {target.name!r}'s vocabulary "
            f"(0..{target.vocab_size - 1}); use a token id it has, or null to pick one"
        )
    return config


def default_mask_token(target) -> int:
    """The target tokenizer's mask token, else pad, else unk, else the vocabulary's last id (the
    mask token of DFlash's blocks and P-EAGLE's parallel slots)."""
    tokenizer, V = getattr(target, "tokenizer", None), target.vocab_size
    for name in ("mask_token_id", "pad_token_id", "unk_token_id"):
        value = getattr(tokenizer, name, None)
        if isinstance(value, int) and 0 <= value < V:
            return value
    return V - 1


def layer_config(target_config, num_layers: int) -> Qwen3Config:
    """The drafter's layers as a Qwen3Config in the target's shape (what speculators'
    transformer_layer_config holds), with num_hidden_layers the drafter's layer count."""
    return head_layer_config(Qwen3Config, target_config, num_layers)


# --- module ------------------------------------------------------------------------------------


class DFlashDrafter(Drafter):
    """The DFlash drafter. The target's embedding and LM head are used, not owned: `self.target`
    is a plain attribute, so they are neither trained nor saved."""

    kind = "dflash"
    drafts_after_prefill = True  # the block reads the target's features of the context
    title = "DFlash"
    batch_drafts = "chains"  # every row's block in one pass; trees row by row
    config_class = DFlashConfig
    # the loss makes the target's logits from its final state (it holds the target's LM head)
    reads_target_logits = False
    # (a kind built on this drafter, DSpark, names its own)
    session_class: ClassVar[type[DFlashSession]] = DFlashSession

    def __init__(self, config: DFlashConfig, target, *, init: bool = True) -> None:
        super().__init__()
        config = resolve_config(config, target)
        self.config = config
        self.target = target  # not an nn.Module: not registered, not saved
        H = target.hidden_size
        self.capture_layers: list[int] = list(config.aux_layers)
        self.layer_config = layer_config(target.config, config.num_layers)
        eps = self.layer_config.rms_norm_eps
        self.layers = nn.ModuleList(
            DFlashLayer(self.layer_config) for _ in range(config.num_layers)
        )
        self.fc = nn.Linear(len(config.aux_layers) * H, H, bias=False)
        self.hidden_norm = Qwen3RMSNorm(H, eps=eps)
        self.norm = Qwen3RMSNorm(H, eps=eps)
        self.rotary = Qwen3RotaryEmbedding(config=self.layer_config)
        self._inv_freq = self.rotary.inv_freq.detach().float().cpu().clone()  # see _apply
        if init and config.init == "target":
            self._copy_target_layers()

    @classmethod
    def build(cls, config: DFlashConfig, target) -> DFlashDrafter:
        return cls(config, target)

    @classmethod
    def from_checkpoint(cls, config: DFlashConfig, target, hf_model) -> DFlashDrafter:
        return cls(config, target, init=False)  # load_drafter loads the weights

    @torch.no_grad()
    def _copy_target_layers(self) -> None:
        """Start from the target's last num_layers layers: every tensor whose name and shape
        match (a Llama target has no q_norm/k_norm; they stay ones), and its final norm."""
        if not self.target.complete:
            raise ValueError(
                f"drafter.init=target copies the target's decoder layers, and this copy of "
                f"{self.target.name!r} holds only its embedding and LM head (offline or sharded "
                "training): use drafter.init=random"
            )
        top = list(self.target.layers)[-len(self.layers) :]
        for ours, theirs in zip(self.layers, top, strict=True):
            source = theirs.state_dict()
            for name, tensor in ours.state_dict().items():
                if name in source and source[name].shape == tensor.shape:
                    tensor.copy_(source[name])
        self.norm.weight.copy_(self.target.norm.weight)

    def _apply(self, fn, recurse: bool = True):
        """Casts and moves, with the rotary frequencies kept in float32 (as the target keeps its
        own), as EagleDrafter does."""
        out = super()._apply(fn, recurse)
        if self.rotary.inv_freq.dtype != torch.float32:
            self.rotary.inv_freq = self._inv_freq.to(self.rotary.inv_freq.device)
        return out

    @property
    def block_size(self) -> int:
        return self.config.block_size

    # The block's first drafting slot: 1, slot 0 holding the anchor (the bonus token the target
    # just emitted), so a block drafts B - 1 tokens; a kind whose anchor slot drafts too (DSpark's
    # sample_from_anchor, kinds/dspark/dspark.py) says 0. Slot first_slot + j drafts the token at
    # anchor + 1 + j, learning the target's distribution at anchor + j.
    first_slot: int = 1

    @property
    def drafts_per_block(self) -> int:
        return self.block_size - self.first_slot

    # The pieces training, acceptance and drafting are built from.

    def features(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states at `capture_layers` -> (batch, seq, hidden) features."""
        dtype = self.fc.weight.dtype
        aux = torch.cat([hidden_states[i].to(dtype) for i in self.capture_layers], dim=-1)
        return self.hidden_norm(self.fc(aux))  # (batch, seq, hidden)

    def context_kv(self, features: torch.Tensor, positions: torch.Tensor) -> ContextKV:
        """Each layer's keys and values of (batch, n, hidden) features at (batch, n) positions."""
        cos, sin = self.rotary(features, positions)
        return [layer.self_attn.keys_values(features, cos, sin) for layer in self.layers]

    def block_states(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        context: ContextKV,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(batch, n) block tokens at (batch, n) positions, attending to `context` and to the
        block (mask None: everything; else bool (batch, 1, n, context + n)) -> (batch, n,
        hidden) final-normed states."""
        x = self.target.embed(tokens).to(self.fc.weight.dtype)  # (batch, n, hidden)
        cos, sin = self.rotary(x, positions)
        for layer, kv in zip(self.layers, context, strict=True):
            x = layer(x, kv, cos, sin, mask)
        return self.norm(x)

    def block_tokens(self, anchors: torch.Tensor) -> torch.Tensor:
        """(...,) anchor tokens -> (..., B) blocks: the anchor, then the mask token."""
        block = anchors.new_full((*anchors.shape, self.block_size), self.config.mask_token_id)
        block[..., 0] = anchors
        return block

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., vocab) logits through the target's LM head."""
        return self.target.lm_head(h.to(self.target.dtype)).to(h.dtype)

    # --- training -------------------------------------------------------------------------------

    def prepare_batch(self, batch: dict, target, generator, shared: torch.Generator) -> dict:
        """Each document's anchors (batch["anchors"], (batch, anchors x most documents in a
        row), -1 where a row has fewer), drawn from a generator seeded by the step's shared seed
        and the document's index in the training set (a packed row's documents: their own,
        `document_seeds`): the same whatever the split into processes and micro-batches, on
        resume, and packed or not."""
        batch["anchors"] = self.choose_anchors(batch, document_seeds(batch, shared.initial_seed()))
        return batch

    def choose_anchors(
        self, batch: Mapping[str, torch.Tensor], seeds: list[list[int]]
    ) -> torch.Tensor:
        """(batch, anchors x most documents in a row) anchor positions, ascending, -1 padded:
        per document (a row, or each of a packed row's), up to `anchors` positions a >= 1 of it
        whose block fits in it (its last drafted token, a + D, D = drafts_per_block, inside it) and whose first drafted token (a + 1)
        is scored, drawn without replacement from a generator of the document's seed."""
        scored = batch["loss_mask"].bool().cpu()
        N, D = self.config.anchors, self.drafts_per_block
        spans = document_spans(batch)
        width = N * max(len(docs) for docs in spans)
        rows = []
        for row, (docs, doc_seeds) in enumerate(zip(spans, seeds, strict=True)):
            chosen = [torch.empty(0, dtype=torch.long)]
            for (start, n), seed in zip(docs, doc_seeds, strict=True):
                a = torch.arange(1, max(1, n - D))  # a + D <= n - 1
                a = a[scored[row, start + a + 1]]
                pick = torch.randperm(len(a), generator=torch.Generator().manual_seed(seed))[:N]
                chosen.append(start + a[pick].sort().values)
            picked = torch.cat(chosen)
            rows.append(torch.cat([picked, picked.new_full((width - len(picked),), -1)]))
        return torch.stack(rows).to(batch["input_ids"].device)

    def anchors_of(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The batch's anchors: prepare_batch's, or (held-out batches, which it never sees) a
        draw seeded by each row's own tokens, so evaluation picks the same anchors however the
        rows are batched."""
        if "anchors" in batch:
            return batch["anchors"]
        ids = batch["input_ids"].cpu()
        seeds = [
            [int((ids[r, s : s + n] * torch.arange(1, n + 1)).sum()) % (2**63 - 1) for s, n in docs]
            for r, docs in enumerate(document_spans(batch))
        ]
        return self.choose_anchors(batch, seeds)

    def slot_valid(self, batch: Mapping[str, torch.Tensor], anchors: torch.Tensor) -> torch.Tensor:
        """(batch, anchors, D) bool: drafting slot j of an anchor's block (D = drafts_per_block)
        predicts a scored token (at a + 1 + j) of the anchor's own document."""
        T = batch["input_ids"].shape[1]
        slots = torch.arange(1, self.drafts_per_block + 1, device=anchors.device)
        at = anchors[..., None] + slots  # (batch, anchors, D) predicted token positions
        inside = (anchors[..., None] >= 0) & (at < T)
        flat = at.clamp(0, T - 1).flatten(1)
        scored = batch["loss_mask"].bool().gather(1, flat).view_as(at)
        documents = batch.get("document_ids")
        if documents is not None:  # served_drafts' anchors reach the end of their document
            own = documents.gather(1, anchors.clamp(min=0))[..., None]
            scored = scored & (documents.gather(1, flat).view_as(at) == own)
        return inside & scored

    def slots(
        self, batch: Mapping[str, torch.Tensor], target_out, logits: bool = True
    ) -> dict[str, torch.Tensor]:
        """Every anchor's block in one pass: x (batch, anchors, D, ...) the drafting slots'
        `head_inputs` (their states, teacher-forced), at (batch, anchors, D) the position a + j
        of the target's distribution drafting slot j learns, valid (batch, anchors, D); with
        `logits`, also the slots' logits (batch, anchors, D, vocab) and the target's there,
        p_logits (the loss leaves both out and makes them a chunk at a time, specdraft/losses.py).

        The blocks of a row are laid side by side as queries; keys are the row's context
        features then every block. Block j's positions see the context before its anchor
        (inside the row, and in a packed row inside the anchor's document, at the document's
        positions) and the whole of block j: the mask that makes each block see exactly what it
        sees while drafting after that anchor."""
        ids = batch["input_ids"]
        Bt, T = ids.shape
        Bs = self.block_size
        anchors = self.anchors_of(batch)  # (batch, anchors)
        N = anchors.shape[1]
        device = ids.device
        start = anchors.clamp(min=0)  # an absent anchor computes a block that scores nothing
        documents = batch.get("document_ids")
        row_positions = batch.get("position_ids")  # restarting at each document of a packed row
        if row_positions is None:
            row_positions = torch.arange(T, device=device)[None].expand(Bt, T)
        features = self.features(target_out.hidden_states)  # (batch, T, hidden)
        context = self.context_kv(features, row_positions)
        tokens = self.block_tokens(ids.gather(1, start)).flatten(1)  # (batch, N * B)
        offsets = torch.arange(Bs, device=device)
        positions = (row_positions.gather(1, start)[..., None] + offsets).flatten(1)  # (batch, NB)
        # who sees whom: (batch, N * B, T) context part, (N * B, N * B) block-diagonal part
        anchor_of = start.repeat_interleave(Bs, dim=1)  # (batch, N * B)
        before = torch.arange(T, device=device)[None, None, :] < anchor_of[..., None]
        sees_context = before & batch["attention_mask"].bool()[:, None, :]
        if documents is not None:  # the context of the anchor's own document only
            own = documents.gather(1, anchor_of)  # (batch, N * B)
            sees_context = sees_context & (documents[:, None, :] == own[..., None])
        block_of = torch.arange(N * Bs, device=device) // Bs
        same_block = (block_of[:, None] == block_of[None, :]).expand(Bt, -1, -1)
        mask = torch.cat([sees_context, same_block], dim=2)[:, None]  # (batch, 1, NB, T + NB)
        h = self.block_states(tokens, positions, context, mask)  # (batch, N * B, hidden)
        h = h.view(Bt, N, Bs, -1)[:, :, self.first_slot :]  # the drafting slots
        at = (start[..., None] + offsets[: self.drafts_per_block]).clamp(max=T - 1)  # a + j
        # teacher-forced: the token before each drafted one is the data's
        x = self.head_inputs(h, ids.gather(1, at.flatten(1)).view_as(at))
        out = {"x": x, "at": at, "valid": self.slot_valid(batch, anchors)}
        if logits:
            rows = torch.arange(Bt, device=device)[:, None, None]
            out["logits"] = self.logits_of(x)
            out["p_logits"] = target_out.logits[rows, at]
        return out

    def head_inputs(self, h: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
        """(..., hidden) drafting slots' states and (...) the tokens before their drafted ones ->
        what the slots' logits are made from (`logits_of`): the states (DSpark adds to them)."""
        return h

    def logits_of(self, x: torch.Tensor) -> torch.Tensor:
        """`head_inputs` -> (..., vocab) the slots' logits."""
        return self.draft_logits(x)

    def slot_weights(self, device) -> torch.Tensor:
        """(D,) the loss weight of the drafting slots: exp(-j / position_decay) for the j-th."""
        decay = self.config.position_decay
        i = torch.arange(self.drafts_per_block, device=device, dtype=torch.float32)
        return torch.exp(-i / decay) if decay > 0 else torch.ones_like(i)

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """Sum over every anchor's scored slots of w_i * KL(p || q_i) (or drafter.divergence), p
        the target's distribution at a + i - 1 and q_i slot i's; over `loss_tokens(batch)` slots.
        Both sides' logits are made inside specdraft/losses.py, `loss_chunk_tokens` slots at a
        time: the target's from its final states where the forward captured them (the trainer
        does, as `reads_target_logits` is False), else taken from its logits."""
        return self.slot_losses(batch, target_out)[:2]

    def slot_losses(self, batch: Mapping[str, torch.Tensor], target_out, overlap: bool = False):
        """`loss`'s (sum, metrics), then what a kind adds to it builds on: token_losses' result
        (with `overlap`, each slot's alpha), the scored slots' head inputs x (n, ...) and their
        weights (n,)."""
        s = self.slots(batch, target_out, logits=False)
        valid = s["valid"]  # (batch, N, D)
        rows, _, slot = valid.nonzero(as_tuple=True)  # the scored slots, (n,) each
        target, target_head = target_at(self, target_out, rows, s["at"][valid])
        x = s["x"][valid]
        scored = token_losses(
            x, self.logits_of, target=target, target_head=target_head,
            divergence=self.config.divergence, top_k=1, chunk_tokens=self.loss_chunk_tokens,
            overlap=overlap,
        )  # fmt: skip
        kl = scored.divergence  # (n,)
        weight = self.slot_weights(kl.device)[slot]
        metrics: Metrics = {}
        for i in range(self.drafts_per_block):
            here = slot == i
            metrics[f"loss_{i + 1}"] = sum_and_count(kl, here)
            metrics[f"top1_{i + 1}"] = sum_and_count(scored.hits[:, 0], here)
        return (kl * weight).sum(), metrics, scored, x, weight

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """The scored slots of the batch's anchors (from the batch alone: the anchors are
        prepare_batch's, or drawn from each row's tokens)."""
        return self.slot_valid(batch, self.anchors_of(batch)).sum().float()

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha summed, greedy agreement summed, count) per draft depth 1..gamma.

        A chain from one block is accepted to depth d only if every slot before d was, and the
        slots do not see each other's drafts: so depth d counts the anchors whose slots 1..d-1
        all agree with the target's argmax (greedy agreement, the accepted prefix), and of
        those, how many agree at slot d and their alpha_d = sum_x min(p(x), q_d(x)). Depths
        beyond D (drafts_per_block) are never drafted (0 of 0)."""
        s = self.slots(batch, target_out)
        alpha, agree = alpha_agreement(s["p_logits"], s["logits"])  # (batch, N, D) each
        prefix = (s["valid"] & agree).long().cumprod(-1).bool()  # slots 1..d scored and agreed
        counted = s["valid"].clone()
        counted[..., 1:] &= prefix[..., :-1]
        at = [slice(d, d + 1) for d in range(decode.gamma)]  # past the block: empty, 0 of 0
        return depth_sums((alpha[..., d], agree[..., d], counted[..., d]) for d in at)

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """The chain's logits after every position: every position is an anchor, and the block
        after anchor c drafts depth i from its slot i (the slots do not read the drafts, so a
        tree's nodes take theirs from the same slots)."""
        ids = batch["input_ids"]
        B, T = ids.shape
        anchors = torch.arange(T, device=ids.device)[None].expand(B, T)
        logits = self.slots({**batch, "anchors": anchors}, target_out)["logits"]
        return logits[:, :, : min(decode.gamma, self.drafts_per_block)]  # (B, T, depth, V)

    def sampled_tree_reach(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig,
        temperature: float,
    ) -> torch.Tensor:  # fmt: skip
        """The tree the session samples from each block's slots' own confidences (position_tree.tree_reach)."""
        return tree_reach(self, batch, target_out, decode, temperature=temperature)

    # --- decoding -------------------------------------------------------------------------------

    def depth_cap(self) -> tuple[int, str]:
        less = "" if self.first_slot == 0 else " - 1"  # DSpark's anchor slot drafts too
        return self.drafts_per_block, f"a block of {self.block_size} drafts block_size{less} tokens"

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        ignored = super().ignored_settings(decode)
        if decode.draft_weights == "int8":
            ignored.append(
                "draft_weights=int8 is ignored by DFlash: it drafts with its full weights"
            )
        return ignored
