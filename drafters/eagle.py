"""EAGLE heads: a one-layer draft model that runs on the target's own hidden states.

EAGLE-1/2 (Li et al. 2024): the feature f_t (the target's final normed hidden state at t) and the
embedding of the next token x_{t+1} are projected to one vector (fc), pass one decoder layer, and
the output h_t predicts the next feature f_{t+1}; the target's frozen LM head turns h_t into the
draft distribution over x_{t+2}. EAGLE-3 (Li et al. 2025) fuses a low, a middle and a high layer of
the target into the feature (fc_fuse), drops the feature regression, trains with a training-time
test (the head unrolled K steps on its own outputs) and drafts from its own LM head over a reduced
draft vocabulary (the most frequent target tokens).

Read top to bottom: the config, the draft vocabulary, the module, the loss (training-time test)
and acceptance, and the drafting session (chain and EAGLE-2 dynamic tree) the inference loop
drives. The decoder layer and rotary embedding are the target's own classes, built from a copy of
its config, so every Llama-style family works without vendored modeling code.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdraft.data.config import choice
from specdraft.drafters.base import DraftContext, Drafter, DraftTree, SamplingSettings
from specdraft.drafters.lean import (
    DraftLinear,
    LayerWeights,
    SharedWeights,
    decode_layer,
    int8_supported,
    lean_supported,
    rms,
)
from specdraft.drafters.prompt_lookup import PromptLookupSession
from specdraft.inference.verify import process_logits

# --- config ------------------------------------------------------------------------------------


@dataclass
class EagleConfig:
    # The settings that only change how a trained head decodes (evaluate.py's FOLDER:key=value).
    DECODING_KEYS: ClassVar[tuple[str, ...]] = (
        "tree_depth", "tree_top_k", "tree_budget", "draft_weights", "stop_below", "lookup_ngram",
    )  # fmt: skip

    # eagle3: fused low/mid/high features, training-time test, reduced draft vocabulary |
    # eagle1: the final feature, feature regression + cross-entropy, the target's LM head.
    version: str = choice("eagle3", "eagle1")
    # eagle3: the target hidden-state ids fused into the feature (0 = embeddings, i = output of
    # decoder layer i, L = final normed state); None: EAGLE-3's low/mid/high choice for the target.
    feature_layers: list[int] | None = None
    # eagle3: size of the draft vocabulary (the most frequent target tokens in the training
    # data, EOS always in); 0: the target's whole vocabulary.
    draft_vocab_size: int = 0
    # Training-time test depth K: the head is unrolled K steps on its own outputs.
    # None: 7 for eagle3, 1 for eagle1 (the EAGLE-1 paper trains one step with feature noise).
    ttt_steps: int | None = None
    # Step k of the unroll is weighted ttt_decay ** k.
    ttt_decay: float = 0.8
    # Half-width a of the uniform noise U(-a, a) added to the input features while training
    # (EAGLE-1's remedy for the error that accumulates in drafted features).
    feature_noise: float = 0.0
    # eagle1: weight of the smooth-L1 regression of h_t onto the next target feature.
    reg_weight: float = 1.0
    # eagle1: weight of the cross-entropy against the target's distribution (eagle3 has only it).
    cls_weight: float = 0.1
    # Decoding: draft depth (a chain drafts this many tokens; the tree grows this many levels).
    # Also the depth of the simulated tau reported during training.
    tree_depth: int = 5
    # Decoding: children per expanded node and nodes expanded per level of the dynamic tree;
    # 1 drafts a chain.
    tree_top_k: int = 4
    # Decoding: draft tokens verified per step (the tree is reranked down to this many). On a
    # CPU a 16-token verification costs ~1.8 plain steps and a 64-token one 3.6, so the demo
    # keeps the tree small; GPUs afford 60+.
    tree_budget: int = 12
    # Decoding: the head's weights while drafting. full: as trained. int8: int8 copies with one
    # scale per output row (CPU only): a CPU drafting step streams every weight once per token,
    # and int8 makes the head's products ~3x cheaper; drafts change slightly, output does not.
    draft_weights: str = choice("full", "int8")
    # Decoding, chains: stop drafting after a position where the head's most likely token has
    # less probability than this (0: always draft tree_depth tokens). Saves the head passes after
    # a token that is unlikely to be accepted anyway, so tree_depth can go deeper where the head
    # is sure.
    stop_below: float = 0.0
    # Decoding: when the context's last lookup_ngram or more tokens occurred before, draft what
    # followed them (prompt lookup, up to tree_depth tokens, no head pass) instead of running the
    # head; 0: always the head. Text that repeats its context (code, edits, a model that loops)
    # is drafted for free and exactly; elsewhere the head drafts as usual. The same split as
    # suffix decoding beside a model drafter in Arctic Inference. Output stays exact either way.
    lookup_ngram: int = 0

    def __post_init__(self) -> None:
        if self.ttt_steps is None:
            self.ttt_steps = 7 if self.version == "eagle3" else 1
        for key, low in (("ttt_steps", 1), ("tree_depth", 1), ("tree_top_k", 1),
                         ("tree_budget", 1), ("draft_vocab_size", 0),
                         ("lookup_ngram", 0)):  # fmt: skip
            if getattr(self, key) < low:
                raise ValueError(f"drafter.{key} must be >= {low}; got {getattr(self, key)}")
        if not 0 <= self.stop_below < 1:
            raise ValueError(f"drafter.stop_below must be in [0, 1); got {self.stop_below}")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"drafter.ttt_decay must be in (0, 1]; got {self.ttt_decay}")
        if self.feature_noise < 0 or self.reg_weight < 0 or self.cls_weight < 0:
            raise ValueError("drafter.feature_noise, reg_weight and cls_weight must be >= 0")
        if self.version == "eagle1" and self.reg_weight == 0 and self.cls_weight == 0:
            raise ValueError("drafter.reg_weight and cls_weight are both 0: eagle1 trains nothing")
        if self.feature_layers is not None and len(self.feature_layers) != 3:
            raise ValueError(
                f"drafter.feature_layers must name 3 target layers (low, mid, high); got "
                f"{self.feature_layers}"
            )


def default_feature_layers(num_layers: int) -> list[int]:
    """EAGLE-3's low/mid/high choice: outputs of layers 2, L // 2 and L - 3; spread over what
    exists when the target is too shallow for that (L < 8)."""
    if num_layers >= 8:
        return [2, num_layers // 2, num_layers - 3]
    return [1, max(1, num_layers // 2), max(1, num_layers - 1)]


def resolve_config(config: EagleConfig, target) -> EagleConfig:
    """A copy of `config` with the target-dependent defaults filled in, or a clear error."""
    config = copy.deepcopy(config)
    if config.version == "eagle3":
        layers = config.feature_layers or default_feature_layers(target.num_layers)
        config.feature_layers = target.check_layer_ids(layers)
        if config.draft_vocab_size > target.vocab_size:
            raise ValueError(
                f"drafter.draft_vocab_size={config.draft_vocab_size} is larger than the target "
                f"{target.name!r}'s vocabulary ({target.vocab_size} tokens); use at most "
                f"{target.vocab_size}, or 0 for the whole vocabulary"
            )
    else:
        config.feature_layers = None
        config.draft_vocab_size = 0  # eagle1 drafts through the target's own LM head
    return config


# --- draft vocabulary --------------------------------------------------------------------------


def build_draft_vocab(
    examples_or_counts: Iterable | torch.Tensor,
    size: int,
    vocab_size: int,
    *,
    always: Iterable[int] = (),
) -> torch.Tensor:
    """The draft vocabulary d2t: (size,) target ids, ascending, of the most frequent tokens.

    `examples_or_counts` is either a (vocab_size,) tensor of token counts or training examples
    (with `input_ids` and `loss_mask`; the tokens the head will be trained to predict are
    counted). `always` (the EOS ids) are included whatever their count, so the head can end a
    draft. Ties go to the lower id, so the result is deterministic.
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    if isinstance(examples_or_counts, torch.Tensor):
        counts = examples_or_counts.double().flatten()
        if counts.numel() != vocab_size:
            raise ValueError(f"token counts have {counts.numel()} entries, vocab is {vocab_size}")
    else:
        counts = torch.zeros(vocab_size, dtype=torch.double)
        for e in examples_or_counts:
            ids = torch.as_tensor(e.input_ids, dtype=torch.long)
            keep = torch.as_tensor(e.loss_mask, dtype=torch.bool)
            counts += torch.bincount(ids[keep], minlength=vocab_size).double()
    always = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(always) > size:
        raise ValueError(f"draft vocabulary size {size} cannot hold the {len(always)} EOS ids")
    score = counts.clone()
    score[always] = float("inf")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:size]).values


# --- module ------------------------------------------------------------------------------------


class EagleDrafter(Drafter):
    """The EAGLE head. The target's embedding (and, for eagle1, LM head) are used, not owned:
    `self.target` is a plain attribute, so they are neither trained nor saved."""

    kind = "eagle"
    config_class = EagleConfig
    shared_with_target: tuple[str, ...] = ()

    def __init__(self, config: EagleConfig, target, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        config = resolve_config(config, target)
        self.config = config
        self.target = target  # not an nn.Module: not registered, not saved
        self.target_fingerprint: dict | None = None
        self._drafting = SharedWeights()  # drafting_weights' cache
        H, V = target.hidden_size, target.vocab_size
        self.capture_layers: list[int] = self.capture_layers_for(config, target)

        layer_config = copy.deepcopy(target.config)
        layer_config.num_hidden_layers = 1
        if getattr(layer_config, "layer_types", None) is not None:
            layer_config.layer_types = layer_config.layer_types[:1]
        self.layer = type(target.layers[0])(layer_config, layer_idx=0)
        self.rotary = type(target.model.model.rotary_emb)(config=layer_config)
        norm_class = type(target.norm)
        eps = getattr(target.config, "rms_norm_eps", 1e-6)
        if config.version == "eagle1":
            self.fc = nn.Linear(2 * H, H, bias=True)
        else:
            self.fc_fuse = nn.Linear(3 * H, H, bias=False)
            self.embed_norm = norm_class(H, eps=eps)
            self.feature_norm = norm_class(H, eps=eps)
            self.fc_in = nn.Linear(2 * H, H, bias=False)
            self.final_norm = norm_class(H, eps=eps)
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

    def new_session(self, target, **options) -> EagleSession:
        """Per-call drafting state for the inference loop (see the session section below)."""
        return EagleSession(self, target, **options)

    def drafting_weights(self, int8: bool) -> DraftingWeights | None:
        """The head's weights as drafting runs them (drafters/lean.py), or None where its layer
        is not one LeanLayer reproduces (sessions then call the modules). Built once and shared
        by sessions until a parameter changes: the key holds the parameters themselves with
        their storage and version, and switching train/eval mode drops it (writes through
        `.data` or fused optimizers do not bump versions; the trainer switches modes)."""
        if not lean_supported(self.layer, self.rotary):
            return None
        params = [*self.parameters(), self.target.model.get_output_embeddings().weight]
        return self._drafting.get(params, int8, lambda: DraftingWeights(self, int8))

    def train(self, mode: bool = True) -> EagleDrafter:
        self._drafting.clear()  # training changes the weights; drafting rebuilds them
        return super().train(mode)

    # The three pieces every use (training, acceptance, drafting) is built from.

    def fuse(self, hidden_states: Mapping[int, torch.Tensor]) -> torch.Tensor:
        """The target's hidden states at `capture_layers` -> (batch, seq, hidden) features."""
        dtype = self.layer.input_layernorm.weight.dtype
        if self.config.version == "eagle1":
            return hidden_states[self.capture_layers[0]].to(dtype)
        low_mid_high = [hidden_states[i].to(dtype) for i in self.capture_layers]
        return self.fc_fuse(torch.cat(low_mid_high, dim=-1))  # (batch, seq, hidden)

    def step(
        self,
        tokens: torch.Tensor,
        features: torch.Tensor,
        positions: torch.Tensor,
        attention_mask: torch.Tensor,
        cache: DynamicCache | None,
    ) -> torch.Tensor:
        """One head pass: (batch, n) next tokens + (batch, n, hidden) features of the positions
        before them -> (batch, n, hidden) h, the predicted next features. `attention_mask` is a
        float 4D mask (batch, 1, n, cached + n); the keys are appended to `cache`."""
        x = self.layer_input(tokens, features)
        cos_sin = self.rotary(x, positions)
        out = self.layer(
            x, attention_mask=attention_mask, position_ids=positions, cache=cache,
            use_cache=cache is not None, position_embeddings=cos_sin,
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out

    def layer_input(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(batch, n) tokens + (batch, n, hidden) features -> (batch, n, hidden) layer input."""
        emb = self.target.embed(tokens).to(features.dtype)  # (batch, n, hidden)
        if self.config.version == "eagle1":
            return self.fc(torch.cat([emb, features], dim=-1))
        return self.fc_in(torch.cat([self.embed_norm(emb), self.feature_norm(features)], dim=-1))

    def draft_logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) logits (the target's vocab for eagle1)."""
        if self.config.version == "eagle1":
            return self.target.lm_head(h.to(self.target.dtype)).to(h.dtype)
        return self.lm_head(self.final_norm(h))

    def forward(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, dict]:
        """The training loss (the trainer calls the module, so DDP sees the forward)."""
        return self.loss(batch, target_out)

    # --- loss: training-time test ----------------------------------------------------------------

    def unroll(
        self, batch: Mapping[str, torch.Tensor], target_out, steps: int
    ) -> list[dict[str, torch.Tensor]]:
        """Run the head `steps` steps on its own outputs, all positions at once.

        Step k at position t (t < S = seq - 1) takes token x_{t+1+k} and, as feature, the target's
        f_t for k = 0, else the head's own h from step k - 1 at t; it attends to step 0's keys at
        positions <= t and to steps 1..k at t only (exactly what the head's KV cache holds while
        drafting), at position id t + k. Its target is the target's distribution at t + 1 + k.
        Returns per step: h (batch, S, hidden), logits (batch, S, draft vocab), p_logits
        (batch, S, vocab), valid (batch, S) bool, and the next true feature (batch, S, hidden).
        """
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"].bool()
        B, T = input_ids.shape
        S = T - 1
        features = self.fuse(target_out.hidden_states)  # (batch, T, hidden)
        feature = features[:, :S]
        if self.training and self.config.feature_noise > 0:
            a = self.config.feature_noise
            feature = feature + (torch.rand_like(feature) * 2 - 1) * a
        device, dtype = feature.device, feature.dtype
        t = torch.arange(S, device=device)
        causal = t[None, :] <= t[:, None]  # (S, S)
        eye = torch.eye(S, dtype=torch.bool, device=device)
        cache = DynamicCache()
        out = []
        for k in range(steps):
            idx = (t + 1 + k).clamp(max=T - 1)  # (S,) token / target position; clamped = invalid
            nxt = t + 2 + k  # the token position the step predicts
            valid = (nxt < T)[None, :] & loss_mask[:, nxt.clamp(max=T - 1)]  # (B, S)
            allowed = torch.cat([causal] + [eye] * k, dim=1)  # (S, (k + 1) S)
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device)
            mask = mask.masked_fill(~allowed, torch.finfo(dtype).min)[None, None].expand(
                B, 1, -1, -1
            )
            positions = (t + k)[None].expand(B, S)
            h = self.step(input_ids[:, idx], feature, positions, mask, cache)  # (B, S, hidden)
            out.append({
                "h": h,
                "logits": self.draft_logits(h),
                "p_logits": target_out.logits[:, idx],
                "valid": valid,
                "next_feature": features[:, idx],
            })  # fmt: skip
            feature = h
        return out

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, dict]:
        """sum_k ttt_decay^k * (mean over step k's valid positions of its loss).

        eagle3: soft cross-entropy to the target distribution restricted (and renormalised) to
        the draft vocabulary; positions whose target argmax is outside it are masked.
        eagle1: reg_weight * smooth-L1(h, next feature) + cls_weight * soft cross-entropy to p.
        """
        cfg = self.config
        total = None
        metrics: dict[str, torch.Tensor] = {}
        for k, s in enumerate(self.unroll(batch, target_out, cfg.ttt_steps)):
            step_loss, acc = self._step_loss(s)
            total = (
                step_loss * cfg.ttt_decay**k
                if total is None
                else total + step_loss * cfg.ttt_decay**k
            )
            metrics[f"loss_{k}"] = step_loss.detach()
            metrics[f"top1_{k}"] = acc.detach()
        return total, metrics

    def _step_loss(self, s: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean loss, top-1 agreement) of one unrolled step over its valid positions."""
        cfg = self.config
        p_logits = s["p_logits"].float()  # (B, S, V)
        valid = s["valid"]
        if cfg.version == "eagle3":
            # the target's argmax must be draftable, else the restricted target is meaningless
            valid = valid & (self.t2d[p_logits.argmax(-1)] >= 0)
            p_logits = p_logits.index_select(-1, self.d2t)  # (B, S, Vd): restricted
        log_q = F.log_softmax(s["logits"].float(), dim=-1)
        p = F.softmax(p_logits, dim=-1)
        ce = -(p * log_q).sum(-1)  # (B, S)
        n = valid.sum().clamp(min=1)
        w = valid.float()
        agree = ((log_q.argmax(-1) == p_logits.argmax(-1)).float() * w).sum() / n
        if cfg.version == "eagle3":
            return (ce * w).sum() / n, agree
        reg = F.smooth_l1_loss(s["h"].float(), s["next_feature"].float(), reduction="none").mean(-1)
        return ((cfg.reg_weight * reg + cfg.cls_weight * ce) * w).sum() / n, agree

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(alpha summed, count) per draft depth 1..tree_depth, unrolled on the head's own outputs.

        alpha = sum_x min(p(x), q(x)) with p the target softmax over the full vocabulary and q
        the draft softmax mapped to it through d2t (tokens outside the draft vocabulary get 0).
        """
        sums, counts = [], []
        for s in self.unroll(batch, target_out, self.config.tree_depth):
            p = F.softmax(s["p_logits"].float(), dim=-1)  # (B, S, V)
            q_draft = F.softmax(s["logits"].float(), dim=-1)
            if self.config.version == "eagle3":
                q = torch.zeros_like(p).index_copy_(-1, self.d2t, q_draft)
            else:
                q = q_draft
            alpha = torch.minimum(p, q).sum(-1)  # (B, S)
            sums.append((alpha * s["valid"]).sum())
            counts.append(s["valid"].sum().float())
        return torch.stack(sums), torch.stack(counts)


# --- session (inference): chain and EAGLE-2 dynamic tree ---------------------------------------


class DraftingWeights:
    """The head as drafting runs it: the layer's fused (and maybe int8) weights, and its input
    and output products with the RMSNorm weights before them folded in. eps: the epsilons of
    the norms before fc_in (embedding, feature) and before the LM head; None for eagle1."""

    @torch.no_grad()
    def __init__(self, head: EagleDrafter, int8: bool) -> None:
        self.int8 = int8
        self.layer = LayerWeights(head.layer, int8=int8)
        if head.config.version == "eagle1":
            self.eps = None
            self.fuse = None  # the final feature is used as it is
            self.input = DraftLinear(head.fc.weight, head.fc.bias, int8=int8)
            lm = head.target.model.get_output_embeddings()
            self.output = DraftLinear(lm.weight, lm.bias, int8=int8)
        else:
            self.eps = tuple(n.variance_epsilon for n in (head.embed_norm, head.feature_norm,
                                                          head.final_norm))  # fmt: skip
            in_scale = torch.cat([head.embed_norm.weight, head.feature_norm.weight])
            self.fuse = DraftLinear(head.fc_fuse.weight, int8=int8)
            self.input = DraftLinear(head.fc_in.weight, in_scale=in_scale, int8=int8)
            self.output = DraftLinear(
                head.lm_head.weight, in_scale=head.final_norm.weight, int8=int8
            )

    def memory_bytes(self) -> int:
        """Bytes beyond the head's own parameters: the int8 copies (fp weights are shared, but
        the fused layer and folded products are copies too)."""
        linears = [self.input, self.output] + ([self.fuse] if self.fuse else [])
        return self.layer.memory_bytes() + sum(lin.memory_bytes() for lin in linears)


class EagleSession:
    """One generate call's drafting state: the head's KV cache and the target features it needs.

    Contract with the inference loop (beyond `DraftSession`):

    - `capture_layers: list[int]`: the target hidden-state ids the session needs; every
      verification forward must capture them (`Target.forward(..., capture_layers=...)`).
    - `accept(path, hidden_states)` after EVERY verification forward, also when the tree was
      empty (the first step, which verifies the prompt, and steps at the end of generation).
      `hidden_states[layer]` is (batch, pending + n, hidden): every position of that forward in
      order, i.e. the pending tokens (the whole prompt at first, then the root = the context's
      last token), then the n tree nodes in tree order. With one pending token this is
      (batch, n + 1, hidden) with index 0 the root. `prefill(hidden_states)` is the same call for
      a prompt forward with no tree.
    - The first `propose` returns an empty tree (no features yet); the loop's first forward is
      then a plain prefill whose hidden states go to `accept([], hidden_states)`.

    State: the head's cache holds one entry per pair (f_t, x_{t+1}) for t < `fed`, built from the
    target's true features; tree entries drafted from predicted features are cropped on accept
    and the accepted tokens are re-fed with their true features at the next proposal (in the same
    head call as the first draft level, so it costs no extra call).

    Running the head: through drafters/lean.py's LeanLayer (fused products, norm weights folded
    in, an in-place KV cache that a rejected draft leaves by moving a length) from weights the
    head builds once and shares across sessions; draft_weights=int8 makes them int8 copies (CPU).

    Drafting: a chain (tree_top_k = 1) takes the argmax (greedy) or samples from q, recording q
    for lossless verification, and with stop_below > 0 ends after the first unsure position. A
    tree is EAGLE-2's dynamic tree: each level expands the top_k nodes of the newest level by
    cumulative draft log-probability into their top_k children,
    and the whole tree is reranked to `tree_budget` nodes. Tree children are deterministic (point
    masses, q = None) also when sampling: the rerank keeps or drops a node by its own token's
    probability, so a sampled child that survived it would no longer be distributed as q.

    With lookup_ngram > 0, a context whose last lookup_ngram or more tokens occurred before is
    drafted by prompt lookup instead (a chain of point masses, no head pass); the features of
    what it verifies are fed to the head at its next proposal like any accepted token's.

    Tree shape: `tree_depth`, `tree_top_k`, `tree_budget` (and `draft_weights`, `stop_below`,
    `lookup_ngram`) default to the head's config. The loop's own knobs mean the same here as for
    every drafter: `gamma` (generate's gamma, evaluate.py's --gamma) is the draft depth and `topk`
    the children per expanded node (1: a chain); the budget stays the config's unless
    `tree_budget` is given.
    """

    def __init__(
        self,
        drafter: EagleDrafter,
        target,
        *,
        sampling: SamplingSettings,
        generator: torch.Generator | None = None,
        tree_depth: int | None = None,
        tree_top_k: int | None = None,
        tree_budget: int | None = None,
        draft_weights: str | None = None,
        stop_below: float | None = None,
        lookup_ngram: int | None = None,
        gamma: int | None = None,
        topk: int | None = None,
        **_ignored,
    ) -> None:
        from specdraft.drafters.target import fingerprint_differences

        if drafter.target_fingerprint is not None:
            diffs = fingerprint_differences(drafter.target_fingerprint, target.fingerprint)
            if diffs:
                raise ValueError(
                    f"this EAGLE head was trained for another target: {'; '.join(diffs)}"
                )
        cfg = drafter.config
        self.head = drafter
        self.sampling = sampling
        self.generator = generator
        self.depth = _either("tree_depth", tree_depth, "gamma", gamma) or cfg.tree_depth
        self.top_k = _either("tree_top_k", tree_top_k, "topk", topk) or cfg.tree_top_k
        self.budget = tree_budget or cfg.tree_budget
        self.int8 = (draft_weights or cfg.draft_weights) == "int8"
        self.stop_below = cfg.stop_below if stop_below is None else float(stop_below)
        ngram = cfg.lookup_ngram if lookup_ngram is None else int(lookup_ngram)
        self.lookup = None  # prompt lookup tried before the head (lookup_ngram > 0)
        if ngram > 0:
            self.lookup = PromptLookupSession(max(3, ngram), ngram, self.depth)
        self.lookup_steps = 0  # proposals drafted by lookup rather than the head
        if self.int8 and not int8_supported(target.device):
            _warn_once(
                f"draft_weights=int8 runs on CPU only; drafting on {target.device} with the "
                "head's full weights"
            )
            self.int8 = False
        self.capture_layers: list[int] = list(drafter.capture_layers)
        self.w = drafter.drafting_weights(self.int8)  # None: run the head's modules
        if self.w is None and self.int8:
            _warn_once(
                f"draft_weights=int8 needs a layer drafters/lean.py runs ({type(drafter.layer)}"
                " is not one); drafting with the head's full weights"
            )
        self.layer = None  # the head's layer and KV cache, built at the first proposal
        self.fed = 0  # pairs (f_t, x_{t+1}) in the head's cache: t = 0 .. fed - 1
        self.features: torch.Tensor | None = None  # (batch, m, hidden): f_fed .. f_{fed+m-1}
        self._base = 0  # context length at the last proposal
        self._n = 0  # nodes of the last proposed tree
        self._waiting = False  # a proposal whose accept has not come yet

    @property
    def _known(self) -> int:
        return self.fed + (0 if self.features is None else self.features.shape[1])

    @torch.no_grad()
    def propose(self, context: DraftContext) -> DraftTree:
        if self._waiting:
            raise RuntimeError(
                "EagleSession.propose was called twice without accept(path, hidden_states) in "
                "between: the loop must pass the verification forward's hidden states at "
                f"{self.capture_layers} after every step, also when the tree was empty"
            )
        seq = context.tokens  # (batch, length)
        length = seq.shape[1]
        self._base, self._waiting = length, True
        depth = min(self.depth, context.max_depth)
        # no features yet: before the prefill (a one-token prompt needs none to be "known")
        if self.features is None or self._known < length - 1 or depth <= 0:
            self._n = 0
            return DraftTree.empty(seq.shape[0], seq.device)
        if self.lookup is not None:  # the context repeats itself: copy, no head pass
            tree = self.lookup.propose(DraftContext(seq, max_depth=depth))
            if len(tree):
                self._n = len(tree)
                self.lookup_steps += 1
                return tree
        if self.layer is None:  # room for the whole call: prompt, new tokens, one more draft
            self._build(capacity=length + context.max_depth + depth + 1)
        # 1. Feed the pairs with true features not yet in the head's cache (causally, at
        # positions fed .. length - 2); the last output (token = the root) drafts level 1.
        n_new = length - 1 - self.fed
        feats = self.features[:, :n_new]
        tokens = seq[:, self.fed + 1 : length].to(feats.device)
        h = self._step(tokens, feats, self.fed)[:, -1:]  # (batch, 1, hidden)
        self.fed, self.features = length - 1, self.features[:, n_new:]
        tree = self._chain(h, depth) if self.top_k == 1 else self._tree(h, depth)
        self._n = len(tree)
        return tree

    def _build(self, capacity: int) -> None:
        """The head's layer with an in-place KV cache for this call (drafters/lean.py), from the
        head's shared drafting weights; a layer layout LeanLayer does not know runs as modules."""
        lean = None if self.w is None else self.w.layer
        self.layer = decode_layer(self.head.layer, self.head.rotary, capacity, weights=lean)

    def _step(self, tokens, features, positions, visible=None) -> torch.Tensor:
        """One head pass: (1, n) tokens + (1, n, hidden) features -> (1, n, hidden) h, the keys
        appended to the head's cache. positions and visible as `LeanLayer.__call__` takes them."""
        w = self.w
        if w is None:
            return self.layer(self.head.layer_input(tokens, features), positions, visible)
        emb = self.head.target.embed(tokens).to(features.dtype)
        if w.eps is not None:  # eagle3: both inputs normed (their weights are in w.input)
            emb, features = rms(emb, w.eps[0]), rms(features, w.eps[1])
        return self.layer(w.input(torch.cat([emb, features], dim=-1)), positions, visible)

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) -> (..., draft vocab) draft logits (the target's vocab for eagle1)."""
        w = self.w
        if w is None:
            return self.head.draft_logits(h)
        return w.output(h if w.eps is None else rms(h, w.eps[2]))

    def _fuse(self, hidden_states: Mapping[int, torch.Tensor], rows: list[int]) -> torch.Tensor:
        """The features of the given positions (rows) of a verification forward."""
        w = self.w
        if w is None or w.fuse is None:
            return self.head.fuse(hidden_states)[:, rows]
        dtype = w.layer.dtype
        low_mid_high = [hidden_states[i][:, rows].to(dtype) for i in self.capture_layers]
        return w.fuse(torch.cat(low_mid_high, dim=-1))

    def _to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.head.d2t[draft_ids] if self.head.config.version == "eagle3" else draft_ids

    def _q_full(self, logits: torch.Tensor) -> torch.Tensor:
        """(batch, draft vocab) logits -> (batch, vocab) the processed draft distribution q."""
        q = process_logits(logits, self.sampling)
        if self.head.config.version == "eagle3":
            q = torch.zeros(q.shape[0], self.head.target.vocab_size, device=q.device).index_copy_(
                -1, self.head.d2t, q
            )
        return q

    def _chain(self, h: torch.Tensor, depth: int) -> DraftTree:
        """Up to depth tokens, each fed back with the head's h; the last one is never fed.
        With a stop threshold, the chain ends after a position where the head's most likely token
        has less probability than it (softmax of the head's logits greedy; the largest entry of q
        when sampling, whichever token was drawn): that token is still verified, but no head pass
        is spent beyond it. The rule only looks at the draft so far, so sampling stays exact."""
        tokens, qs = [], []
        pos = self._base - 1  # position id of level d is (length - 2) + d
        for d in range(depth):
            logits = self._logits(h[:, -1])  # (batch, draft vocab)
            if self.sampling.greedy:
                if self.stop_below > 0:
                    top, best = logits.float().softmax(-1).max(-1, keepdim=True)
                    sure = float(top) >= self.stop_below
                else:
                    best = logits.argmax(-1, keepdim=True)
                token = self._to_target(best)  # (batch, 1)
            else:
                q = self._q_full(logits)  # (batch, vocab)
                token = torch.multinomial(q, 1, generator=self.generator)
                qs.append(q)
                if self.stop_below > 0:  # the head's confidence, not the luck of the draw
                    sure = float(q.max()) >= self.stop_below
            tokens.append(token)
            if self.stop_below > 0 and not sure:
                break
            if d + 1 < depth:  # level d + 1 sees the real prefix and the levels before it
                h = self._step(token, h[:, -1:], pos + d)
        q = torch.stack(qs, dim=1) if qs else None  # (batch, depth, vocab)
        return DraftTree.chain(torch.cat(tokens, dim=1), q)

    def _tree(self, h: torch.Tensor, depth: int) -> DraftTree:
        """EAGLE-2's dynamic tree (batch 1).

        1. Level 1: the root's top_k tokens, scored by their draft log-probability.
        2. Each further level: the top_k nodes of the newest level by cumulative log-probability
           are fed together (each attends to the real prefix, its fed ancestors and itself) and
           each gets its top_k children, scored by parent score + own log-probability.
        3. Rerank all nodes by score and keep the best `tree_budget`: a child never outscores its
           parent, so the kept set is a tree (ties are broken towards the shallower node).
        """
        k = self.top_k
        logp = F.log_softmax(self._logits(h[0, -1]).float(), dim=-1)  # (draft vocab,)
        scores, ids = logp.topk(min(k, logp.shape[-1]))
        toks = self._to_target(ids).tolist()
        parents, depths, cum = [-1] * len(toks), [1] * len(toks), scores.tolist()
        newest = list(range(len(toks)))
        fed: list[int] = []  # node ids in head-cache order (after the real prefix)
        h_of: dict[int, torch.Tensor] = {-1: h[0, -1]}  # node -> output h, for its children
        for d in range(2, depth + 1):
            frontier = sorted(newest, key=lambda i: -cum[i])[:k]
            slot = {node: s for s, node in enumerate(fed)}
            allowed = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
            for row, node in enumerate(frontier):
                allowed[row, len(fed) + row] = True
                a = parents[node]
                while a >= 0:
                    allowed[row, slot[a]] = True
                    a = parents[a]
            # the real prefix is visible to all
            visible = torch.cat([torch.ones(len(frontier), self.fed, dtype=torch.bool), allowed], 1)
            feats = torch.stack([h_of[parents[n]] for n in frontier])[None]  # (1, f, hidden)
            tokens = torch.tensor([[toks[n] for n in frontier]], device=h.device)
            # the newest level is depth d - 1: step d - 1 at t = length - 2
            positions = [self._base - 3 + d] * len(frontier)
            out = self._step(tokens, feats, positions, visible)[0]  # (f, hidden)
            fed += frontier
            for row, node in enumerate(frontier):
                h_of[node] = out[row]
            child_logp = F.log_softmax(self._logits(out).float(), dim=-1)
            c_scores, c_ids = child_logp.topk(min(k, child_logp.shape[-1]), dim=-1)  # (f, k)
            c_tok = self._to_target(c_ids).tolist()
            newest = []
            for row, node in enumerate(frontier):
                for j in range(c_ids.shape[1]):
                    newest.append(len(toks))
                    toks.append(c_tok[row][j])
                    parents.append(node)
                    depths.append(d)
                    cum.append(cum[node] + float(c_scores[row, j]))
        order = sorted(range(len(toks)), key=lambda i: (-cum[i], depths[i], i))
        keep: set[int] = set()
        for i in order:
            if len(keep) == self.budget:
                break
            if parents[i] < 0 or parents[i] in keep:
                keep.add(i)
        kept = sorted(keep, key=lambda i: (depths[i], i))  # topological: parents first
        new_index = {old: new for new, old in enumerate(kept)}
        return DraftTree(
            torch.tensor([[toks[i] for i in kept]], device=h.device),
            [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept],
            [depths[i] for i in kept],
            None,
        )

    @torch.no_grad()
    def accept(
        self, path: list[int], hidden_states: Mapping[int, torch.Tensor] | None = None
    ) -> None:
        """Take the true features of the verified tokens; drop the drafted entries of the cache.

        `path`: accepted node indices, root to leaf. `hidden_states`: see the class docstring.
        """
        if hidden_states is None:
            raise ValueError(
                "EagleSession.accept needs hidden_states: the verification forward's hidden "
                f"states at layers {self.capture_layers} (see the EagleSession docstring)"
            )
        self._waiting = False
        positions = next(iter(hidden_states.values())).shape[1]
        pending = positions - self._n
        if pending < 1 or self._known + pending != self._base:
            raise ValueError(
                f"EagleSession.accept got hidden states for {positions} positions; expected "
                f"the {self._base - self._known} pending token(s) then the {self._n} tree nodes"
            )
        rows = list(range(pending)) + [pending + i for i in path]
        new = self._fuse(hidden_states, rows)  # (batch, pending + accepted, hidden)
        self.features = new if self.features is None else torch.cat([self.features, new], dim=1)
        if self.layer is not None:  # drafted entries were built from predicted features
            self.layer.crop(self.fed)

    def prefill(self, hidden_states: Mapping[int, torch.Tensor]) -> None:
        """The prompt forward's hidden states (batch, prompt, hidden) per layer: accept([], ...)."""
        if not self._waiting:  # a prefill before any proposal: stand in for the empty one
            self._base, self._n, self._waiting = (
                self._known + next(iter(hidden_states.values())).shape[1],
                0,
                True,
            )
        self.accept([], hidden_states)

    def extra_memory_bytes(self) -> int:
        """The head's KV cache, plus the drafting copies of its weights (fused, folded, int8),
        which exist from the session's start even if every draft was copied."""
        weights = 0 if self.w is None else self.w.memory_bytes()
        return weights + (0 if self.layer is None else self.layer.memory_bytes())


def _warn_once(message: str) -> None:
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


_WARNED: set[str] = set()


def _either(key: str, value: int | None, loop_key: str, loop_value: int | None) -> int | None:
    """A session option given under its own name or the loop's; both given must agree."""
    if value is not None and loop_value is not None and value != loop_value:
        raise ValueError(f"{key}={value} and {loop_key}={loop_value} set the same thing; pass one")
    return value if value is not None else loop_value
