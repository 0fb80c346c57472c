"""EAGLE heads: a one-layer draft model that runs on the target's own hidden states.

EAGLE-1/2 (Li et al. 2024): the feature f_t (the target's final normed hidden state at t) and the
embedding of the next token x_{t+1} are projected to one vector (fc), pass one decoder layer, and
the output h_t predicts the next feature f_{t+1}; the target's frozen LM head turns h_t into the
draft distribution over x_{t+2}. EAGLE-3 (Li et al. 2025) fuses a low, a middle and a high layer of
the target into the feature (fc_fuse), drops the feature regression, trains with a training-time
test (the head unrolled K steps on its own outputs) and drafts from its own LM head over a reduced
draft vocabulary (the most frequent target tokens).

The head's layer is the reference architecture the engines compute (kinds/eagle/eagle_export.py
writes it for vLLM, SGLang and SafeAILab/EAGLE): a Llama decoder layer in the target's shape
whatever the target's family; EAGLE-3's (Eagle3Layer) reads cat(embedding, feature) 2H wide,
norming each half, with the feature as its residual; EAGLE-1's has no input norm after fc.

Read top to bottom: the config (the reference layers and the training-time test's attention are
kinds/eagle/eagle_layers.py), the module (its draft vocabulary comes from
drafting.build_draft_vocab), the loss (training-time test) and acceptance, and the drafting session
(chain and EAGLE-2 dynamic tree) the inference loop drives.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import (
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from specdraft.attention import loss_targets
from specdraft.config import choice, follows
from specdraft.core import (
    DecodeConfig,
    float_mask,
)
from specdraft.drafters.base import Drafter, Metrics, sum_and_count
from specdraft.drafters.lean import (
    SharedWeights,
    lean_supported,
)
from specdraft.drafters.served import alpha_agreement, depth_sums, one_later
from specdraft.drafting import DraftVocab
from specdraft.kinds.eagle.eagle_layers import (
    Eagle3Layer,
    eagle1_reference_layer,
    llama_layer_config,
)
from specdraft.kinds.eagle.eagle_session import (
    EagleDraftingWeights,
    EagleModuleWeights,
    EagleSession,
)
from specdraft.losses import token_losses

# --- config ------------------------------------------------------------------------------------


@dataclass
class EagleConfig:
    # eagle3: fused low/mid/high features, training-time test, reduced draft vocabulary |
    # eagle1: the final feature, feature regression + cross-entropy, the target's LM head.
    version: str = choice("eagle3", "eagle1")
    # eagle3: the target hidden-state ids fused into the feature (0 = embeddings, i = output of
    # decoder layer i, L = final normed state); None: EAGLE-3's low/mid/high choice for the target.
    feature_layers: list[int] | None = follows("version")
    # eagle3: size of the draft vocabulary (the most frequent target tokens in the training
    # data, EOS always in); 0: the target's whole vocabulary.
    draft_vocab_size: int = follows("version", 0)
    # Training-time test depth K: the head is unrolled K steps on its own outputs.
    # None: 7 for eagle3, 1 for eagle1 (the EAGLE-1 paper trains one step with feature noise).
    # A file's value for one version does not carry into another set after it (command line).
    ttt_steps: int | None = follows("version")
    # Step k of the unroll is weighted ttt_decay ** k.
    ttt_decay: float = 0.8
    # Half-width a of the uniform noise U(-a, a) added to the input features while training
    # (EAGLE-1's remedy for the error that accumulates in drafted features). None: 0.1 for
    # eagle1, as the EAGLE paper trains; 0 for eagle3, whose training-time test feeds the head
    # its own drifted features instead.
    feature_noise: float | None = follows("version")
    # eagle1: weight of the smooth-L1 regression of h_t onto the next target feature.
    reg_weight: float = 1.0
    # eagle1: weight of the cross-entropy against the target's distribution (eagle3 has only it).
    cls_weight: float = 0.1
    # eagle3 reference: the residual around attention is hidden_norm(feature) (True) or the
    # feature itself (False, as SafeAILab/EAGLE and vLLM by default). Exports always write it.
    norm_before_residual: bool = follows("version", False)
    # eagle1: fc has a bias (SafeAILab/EAGLE's default; its config.json says `bias`).
    fc_bias: bool = True
    # The loss against the target's distribution p (eagle1: its cls term): soft_ce (-sum p log q,
    # EAGLE's) | fkl (KL(p || q), the same gradient) | lk | lk_hybrid (the LK losses, which train
    # for the acceptance rate: specdraft/losses.py) | tvd | rkl | jsd.
    divergence: str = choice("soft_ce", "fkl", "lk", "lk_hybrid", "tvd", "rkl", "jsd")
    # EAGLE-3.1 (speculators' names; both on make the 3.1 head, against the drift of the
    # features' magnitude over drafting depth): norm_before_fc, an RMSNorm over the fused
    # low/mid/high features before fc; norm_output, each step fed the previous step's output
    # after the final norm (the state the LM head reads) instead of the raw one. eagle3 only.
    norm_before_fc: bool = False
    norm_output: bool = False

    def __post_init__(self) -> None:
        # ttt_steps and feature_noise stay None here and resolve with the version (resolve_config):
        # a config object is built before a file or the command line sets its version.
        for key, low in (("ttt_steps", 1), ("draft_vocab_size", 0)):
            value = getattr(self, key)
            if value is not None and value < low:
                raise ValueError(f"drafter.{key} must be >= {low}; got {value}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"drafter.ttt_decay must be in (0, 1]; got {self.ttt_decay}")
        if (self.feature_noise or 0) < 0 or self.reg_weight < 0 or self.cls_weight < 0:
            raise ValueError("drafter.feature_noise, reg_weight and cls_weight must be >= 0")
        if self.version == "eagle1" and self.reg_weight == 0 and self.cls_weight == 0:
            raise ValueError("drafter.reg_weight and cls_weight are both 0: eagle1 trains nothing")
        check_feature_layers(self.feature_layers)


def check_feature_layers(layers: list[int] | None) -> None:
    """An EAGLE-3 head's (EAGLE's or P-EAGLE's) drafter.feature_layers: None or 3 layers."""
    if layers is not None and len(layers) != 3:
        raise ValueError(
            f"drafter.feature_layers must name 3 target layers (low, mid, high); got {layers}"
        )


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high choice: outputs of layers 2, L // 2 and L - 3; spread over what
    exists when the target is too shallow for that (L < 8)."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    return [1, max(1, num_layers // 2), max(1, num_layers - 1)]


def resolve_config(config: EagleConfig, target) -> EagleConfig:
    """A copy of `config` with the defaults that depend on the version and the target filled in,
    or a clear error."""
    config = copy.deepcopy(config)
    if config.ttt_steps is None:
        config.ttt_steps = 7 if config.version == "eagle3" else 1
    if config.feature_noise is None:
        config.feature_noise = 0.0 if config.version == "eagle3" else 0.1
    if config.version == "eagle3":
        resolve_eagle3(config, target)
    else:
        if getattr(config, "norm_before_fc", False) or getattr(config, "norm_output", False):
            raise ValueError(
                "drafter.norm_before_fc and norm_output are EAGLE-3.1's, an EAGLE-3 head's "
                "settings: use drafter.version=eagle3, or turn them off"
            )
        config.feature_layers = None
        config.draft_vocab_size = 0  # eagle1 drafts through the target's own LM head
        config.norm_before_residual = False  # EAGLE-3's layer only
    return config


def resolve_eagle3(config, target) -> None:
    """Fill in an EAGLE-3 head's feature layers for `target` (EAGLE's or P-EAGLE's config) and
    check its draft vocabulary fits the target's."""
    layers = config.feature_layers or default_feature_layers(target.num_layers)
    config.feature_layers = target.check_layer_ids(layers)
    if config.draft_vocab_size > target.vocab_size:
        raise ValueError(
            f"drafter.draft_vocab_size={config.draft_vocab_size} is larger than the target "
            f"{target.name!r}'s vocabulary ({target.vocab_size} tokens); use at most "
            f"{target.vocab_size}, or 0 for the whole vocabulary"
        )


def scored(
    loss_mask: torch.Tensor, depths: int, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """(batch, depths, S) bool, S = seq - 1 positions: step (or P-EAGLE's depth) d at position t
    predicts token t + 2 + d, which must exist, carry loss and, in packed rows (`documents`, the
    batch's document_ids), lie in position t's document."""
    S = loss_mask.shape[1] - 1
    rows = {"loss_mask": loss_mask, "document_ids": documents}
    steps = [loss_targets(rows, 2 + d) for d in range(depths)]  # (batch, max(0, S - 1 - d)) each
    return torch.stack([F.pad(step, (0, S - step.shape[1])) for step in steps], dim=1)


def target_at(drafter: Drafter, target_out, rows: torch.Tensor, at: torch.Tensor):
    """(the target's final states at batch rows `rows`, positions `at`, the function that makes
    its logits), or its logits there and None where the forward brought no final state or the
    drafter's copy of the target has no LM head (its `reads_target_logits`)."""
    target = drafter.target
    final = target_out.hidden_states.get(target.num_layers)
    if final is None or drafter.reads_target_logits:
        return target_out.logits[rows, at], None
    return final[rows, at], lambda h: target.lm_head(h.to(target.dtype))


# --- module ------------------------------------------------------------------------------------


class EagleDrafter(Drafter):
    """The EAGLE head. The target's embedding (and, for eagle1, LM head) are used, not owned:
    `self.target` is a plain attribute, so they are neither trained nor saved."""

    kind = "eagle"
    title = "EAGLE"
    # chains of a batch drafted together; EAGLE-2's trees row by row
    batch_drafts = "chains"
    session_class: ClassVar[type[EagleSession]] = EagleSession
    config_class = EagleConfig
    drafts_after_prefill = True  # the head reads the target's features of the context
    # The config with the defaults that depend on the target filled in (a kind built on this
    # head with a config of its own, P-EAGLE, resolves its own).
    resolve = staticmethod(resolve_config)

    def __init__(self, config: EagleConfig, target, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        config = self.resolve(config, target)
        self.config = config
        self.target = target  # not an nn.Module: not registered, not saved
        self._drafting = SharedWeights()  # drafting_weights' cache
        H, V = target.hidden_size, target.vocab_size
        self.capture_layers: list[int] = self.capture_layers_for(config, target)

        # the layer's attention is the training-time test's (ttt_attention); with a mask it is
        # transformers' SDPA attention
        eps = getattr(target.config, "rms_norm_eps", 1e-6)
        layer_config = llama_layer_config(target.config)
        self.rotary = LlamaRotaryEmbedding(config=layer_config)
        if config.version == "eagle1":
            self.layer = eagle1_reference_layer(layer_config)
        else:
            self.layer = Eagle3Layer(layer_config, config.norm_before_residual)
        self._inv_freq = self.rotary.inv_freq.detach().float().cpu().clone()  # see _apply
        if config.version == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=config.fc_bias)
        else:
            self.fc_fuse = nn.Linear(3 * H, H, bias=False)
            if getattr(config, "norm_before_fc", False):  # EAGLE-3.1
                self.input_norm = LlamaRMSNorm(3 * H, eps=eps)
            self.final_norm = LlamaRMSNorm(H, eps=eps)
            Vd = config.draft_vocab_size or V
            if d2t is None:
                d2t = torch.arange(Vd)
            if d2t.shape != (Vd,):
                raise ValueError(f"d2t has shape {tuple(d2t.shape)}; the config says ({Vd},)")
            self.lm_head = nn.Linear(H, Vd, bias=False)
            t2d = torch.full((V,), -1, dtype=torch.long)
            t2d[d2t] = torch.arange(Vd)
            # draft id -> target id, and target id -> draft id (-1: not in the draft vocabulary)
            self.register_buffer("d2t", d2t.long().clone())
            self.register_buffer("t2d", t2d)
            with torch.no_grad():  # start from the target's LM head rows: training starts close
                self.lm_head.weight.copy_(target.model.get_output_embeddings().weight[d2t].float())

    @staticmethod
    def capture_layers_for(config: EagleConfig, target) -> list[int]:
        """The target hidden states a head of (resolved) `config` reads: eagle1 the final normed
        feature, eagle3 the three fused layers."""
        if config.version == "eagle3":
            return list(config.feature_layers)
        return [target.num_layers]

    @classmethod
    def build(cls, config: EagleConfig, target, d2t: torch.Tensor | None = None) -> EagleDrafter:
        return cls(config, target, d2t)

    @classmethod
    def from_checkpoint(cls, config: EagleConfig, target, hf_model) -> EagleDrafter:
        # d2t/t2d are placeholders here; load_drafter fills them from model.safetensors.
        return cls(config, target)

    @property
    def draft_vocab_size(self) -> int:
        return (
            self.lm_head.out_features if self.config.version == "eagle3" else self.target.vocab_size
        )

    def drafting_weights(self, int8: bool) -> EagleDraftingWeights | EagleModuleWeights:
        """The head's weights as drafting runs them (drafters/lean.py), or where its layer is not
        one LeanLayer reproduces, the same calls through its modules (full weights). Built once and shared
        by sessions until a parameter changes: the key holds the parameters themselves with
        their storage and version, and switching train/eval mode drops it (writes through
        `.data` or fused optimizers do not bump versions; the trainer switches modes)."""
        if not lean_supported(self.layer, self.rotary):
            return EagleModuleWeights(self)
        params = [*self.parameters(), self.target.model.get_output_embeddings().weight]
        return self._drafting.get(params, int8, lambda: EagleDraftingWeights(self, int8))

    def _apply(self, fn, recurse: bool = True):
        """Casts and moves, with the rotary frequencies kept in float32 (as the target keeps its
        own): a bf16 inv_freq turns position 500's angles ~0.5 rad away from training's and the
        engines'."""
        out = super()._apply(fn, recurse)
        inv = self.rotary.inv_freq
        if inv.dtype != torch.float32:
            self.rotary.inv_freq = self._inv_freq.to(inv.device)
        return out

    def train(self, mode: bool = True) -> EagleDrafter:
        self._drafting.clear()  # training changes the weights; drafting rebuilds them
        return super().train(mode)

    # The three pieces every use (training, acceptance, drafting) is built from.

    def fuse(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states at `capture_layers` -> (batch, seq, hidden) features."""
        dtype = self.layer.post_attention_layernorm.weight.dtype
        if self.config.version == "eagle1":
            return hidden_states[self.capture_layers[0]].to(dtype)
        low_mid_high = [hidden_states[i].to(dtype) for i in self.capture_layers]
        return self.fc_fuse(self.fused_input(torch.cat(low_mid_high, dim=-1)))

    def fused_input(self, x: torch.Tensor) -> torch.Tensor:
        """(..., 3 hidden) concatenated low/mid/high states -> fc's input: normed first with
        EAGLE-3.1's norm_before_fc."""
        norm = getattr(self, "input_norm", None)
        return x if norm is None else norm(x)

    def feedback(self, h: torch.Tensor) -> torch.Tensor:
        """A step's output h as the next step's feature: h itself, or with EAGLE-3.1's
        norm_output h through the final norm (what the LM head reads)."""
        return self.final_norm(h) if getattr(self.config, "norm_output", False) else h

    def step(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One head pass: (batch, n) next tokens + (batch, n, hidden) features of the positions
        before them -> (batch, n, hidden) h, the predicted next features. `attention_mask` is a
        float 4D mask (batch, 1, n, cached + n); the keys are appended to `cache`. `documents`
        (batch, n): the unrolled training's packed rows, for `ttt_attention` without a mask."""
        x = self.layer_input(tokens, features)
        cos_sin = self.rotary(x, positions)
        extra = {} if documents is None else {"documents": documents}
        out = self.layer(
            x, attention_mask=attention_mask, position_ids=positions, cache=cache,
            use_cache=cache is not None, position_embeddings=cos_sin, **extra,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(batch, n) tokens + (batch, n, hidden) features -> the layer's input: (batch, n,
        hidden), or cat(embedding, feature) (batch, n, 2 hidden) for EAGLE-3's reference layer."""
        emb = self.target.embed(tokens).to(features.dtype)  # (batch, n, hidden)
        if self.config.version == "eagle1":
            return self.fc(torch.cat([emb, features], dim=-1))
        return torch.cat([emb, features], dim=-1)  # the layer norms each half itself

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) logits (the target's vocab for eagle1)."""
        if self.config.version == "eagle1":
            return self.target.lm_head(h.to(self.target.dtype)).to(h.dtype)
        return self.lm_head(self.final_norm(h))

    # --- loss: training-time test ----------------------------------------------------------------

    def unroll(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        steps: int,
        *,
        dense: bool = False,
        logits: bool = True,
    ) -> list[dict[str, torch.Tensor]]:
        """Run the head `steps` steps on its own outputs, all positions at once.

        Step k at position t (t < S = seq - 1) takes token x_{t+1+k} and, as feature, the target's
        f_t for k = 0, else the head's own h from step k - 1 at t; it attends to step 0's keys at
        positions <= t and to steps 1..k at t only (exactly what the head's KV cache holds while
        drafting), at position id t + k. Its target is the target's distribution at t + 1 + k.
        In packed rows (data.pack) t counts from its document's start and the keys are its
        document's only; a position whose target lies in the next document is not valid.
        Returns per step: h (batch, S, hidden), logits (batch, S, draft vocab; logits=False:
        left out, for the loss, which makes them a chunk at a time), p_at (S,) the position of
        the target's distribution each position learns, valid (batch, S) bool, and the next
        true feature (batch, S, hidden).

        Step k's attention runs through `ttt_attention`, which knows this structure (causal over
        step 0, one key per earlier step at t itself) and never builds the (S, (k + 1) S) mask;
        dense=True passes that dense float mask to the layer's own attention instead, the
        reference the lean path is tested and measured against (BENCHMARKS.md, "EAGLE").
        """
        input_ids = batch["input_ids"]
        B, T = input_ids.shape
        S = T - 1
        features = self.fuse(target_out.hidden_states)  # (batch, T, hidden)
        feature = features[:, :S]
        if self.training and self.config.feature_noise > 0:
            a = self.config.feature_noise
            feature = feature + (torch.rand_like(feature) * 2 - 1) * a
        device, dtype = feature.device, feature.dtype
        t = torch.arange(S, device=device)
        # Packed rows (data.pack): positions restart at each document, and step 0's keys are
        # those of the query's own document; a later step's key at t is the query's own.
        documents = batch.get("document_ids")
        valid = scored(batch["loss_mask"], steps, documents)  # (B, steps, S)
        start = t[None].expand(B, S) if documents is None else batch["position_ids"][:, :S]
        if documents is not None:
            documents = documents[:, :S]
        if dense:
            causal = (t[None, :] <= t[:, None])[None]  # (1 or B, S, S)
            if documents is not None:
                causal = causal & (documents[:, :, None] == documents[:, None, :])
            eye = torch.eye(S, dtype=torch.bool, device=device).expand(causal.shape[0], S, S)
        cache = DynamicCache()
        out = []
        for k in range(steps):
            idx = (t + 1 + k).clamp(max=T - 1)  # (S,) token / target position; clamped = invalid
            mask = None  # ttt_attention: the structure, without a mask
            if dense:
                allowed = torch.cat([causal] + [eye] * k, dim=2)  # (1 or B, S, (k + 1) S)
                mask = float_mask(allowed, dtype)[:, None].expand(B, 1, -1, -1)
            positions = start + k
            h = self.step(input_ids[:, idx], feature, positions, mask, cache, documents)
            step = {"h": h, "p_at": idx, "valid": valid[:, k], "next_feature": features[:, idx]}
            if logits:
                step["logits"] = self.draft_logits(h)
            out.append(step)
            feature = self.feedback(h)
        return out

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """Sum over positions t of sum_k ttt_decay^k * (step k's loss at t, where valid): each
        scored token's loss, over `loss_tokens(batch)` tokens (step 0 scores token t + 2 from
        position t; a later step's last positions and invalid tokens add 0).

        eagle3: `divergence` (soft cross-entropy by default) to the target distribution
        restricted (and renormalised) to the draft vocabulary; positions whose target argmax is
        outside it add 0. eagle1: reg_weight * smooth-L1(h, next feature) + cls_weight *
        `divergence` to p.
        The head's logits and the target's (from its final states and LM head) are made inside
        specdraft/losses.py, `loss_chunk_tokens` positions of a step at a time.
        """
        cfg = self.config
        total = None
        metrics: Metrics = {}
        for k, s in enumerate(self.unroll(batch, target_out, cfg.ttt_steps, logits=False)):
            valid = s["valid"]  # (B, S)
            rows, at = valid.nonzero(as_tuple=True)  # the scored positions, (n,) each
            target, target_head = target_at(self, target_out, rows, s["p_at"][at])
            losses = token_losses(
                s["h"][valid], self.draft_logits, target=target, target_head=target_head,
                target_rows=self.d2t if self.reduced_vocab else None,
                divergence=cfg.divergence, top_k=1, chunk_tokens=self.loss_chunk_tokens,
            )  # fmt: skip
            # eagle3: the target's argmax must be draftable, else the restricted target is
            # meaningless
            keep = losses.target_token >= 0
            per_token = losses.divergence  # (n,)
            if cfg.version == "eagle1":
                reg = F.smooth_l1_loss(
                    s["h"][valid].float(), s["next_feature"][valid].float(), reduction="none"
                ).mean(-1)
                per_token = cfg.reg_weight * reg + cfg.cls_weight * per_token
            step_sum = per_token.where(keep, 0).sum() * cfg.ttt_decay**k
            total = step_sum if total is None else total + step_sum
            metrics[f"loss_{k}"] = sum_and_count(per_token, keep)
            metrics[f"top1_{k}"] = sum_and_count(losses.hits[:, 0], keep)
        return total, metrics

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Step 0 scores token t + 2 from position t: the loss tokens from the third on."""
        return loss_targets(batch, 2).sum().float()

    @property
    def reduced_vocab(self) -> bool:
        """An EAGLE-3 head whose draft vocabulary is part of the target's."""
        return self.config.version == "eagle3" and len(self.d2t) < self.target.vocab_size

    @property
    def reads_target_logits(self) -> bool:
        """The loss makes the target's logits from its final state with the LM head of the
        head's copy of the target, unless that copy let its LM head go (a ZeRO-3 EAGLE-3 run,
        train/eagle.py: the sharded forward gives the logits)."""
        return self.target.model.get_output_embeddings().weight.is_meta

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha summed, greedy agreement summed, count) per draft depth 1..gamma (the depth the
        head is served with, `decode.gamma`), unrolled on the head's own outputs.

        alpha = sum_x min(p(x), q(x)), the chance a sampled draft token is accepted, with p the
        target softmax over the full vocabulary and q the draft softmax mapped to it through d2t
        (tokens outside the draft vocabulary get 0); greedy agreement: the head's argmax is the
        target's, what greedy verification accepts.
        """
        d2t = self.d2t if self.config.version == "eagle3" else None
        return depth_sums(
            (*alpha_agreement(target_out.logits[:, s["p_at"]], s["logits"], d2t), s["valid"])
            for s in self.unroll(batch, target_out, decode.gamma)
        )

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """The chain's logits after every position, from the training-time test's unroll: after
        a context ending at c, step k at t = c - 1 drafts depth k + 1 (its cache holds the true
        features of positions < c - 1, as the session's does). EAGLE-2's dynamic tree has
        none (served.served_drafts asks it only for chains)."""
        logits = torch.stack(
            [s["logits"] for s in self.unroll(batch, target_out, decode.gamma)], dim=2
        )  # (batch, seq - 1, gamma, draft vocab)
        return one_later(logits, 0.0)  # nothing is drafted after the first token alone

    def draft_vocab(self) -> DraftVocab | None:
        if self.config.version != "eagle3":  # EAGLE-1 drafts through the target's LM head
            return None
        return DraftVocab(self.d2t, self.target.vocab_size, self.t2d)
