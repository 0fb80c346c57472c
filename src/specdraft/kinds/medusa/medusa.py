"""Medusa heads: K extra heads on the target's last hidden state, verified as a tree.

Medusa (Cai et al. 2024): at position t the target's final normed hidden state h_t feeds its LM
head, which predicts x_{t+1}, and K heads, head k (0-based) predicting x_{t+2+k}. Each head is
`num_layers` residual blocks x + SiLU(W x + b), each block with its own weights (W and b start at
zero, so a fresh block is the identity), and an output layer: its own, initialised from the
target's LM head, or the target's LM head itself (output=shared). The heads do not see each
other's guesses, so their top candidates are combined into a tree (the Cartesian product,
pruned by measured accuracy) that the target verifies in one pass.

Read top to bottom: the drafter, the loss (Medusa-1: cross-entropy on the data's tokens or
self-distillation to the target's distribution, head k weighted loss_decay^k), the acceptance and
accuracy statistics the trainer measures and the tree built from those accuracies. Its settings
are in medusa_config.py, its head modules in medusa_layers.py, the drafting session the loop
drives in medusa_session.py.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from specdraft.attention import loss_targets, target_inputs
from specdraft.core import DecodeConfig
from specdraft.drafters.base import CheckpointRecord, Drafter, Metrics, sum_and_count, warn_once
from specdraft.drafters.lean import SharedWeights
from specdraft.drafters.position_tree import expected_length, tree_paths, tree_reach
from specdraft.drafters.served import ServedDrafts, alpha_agreement, depth_sums, one_later
from specdraft.drafting import DraftVocab
from specdraft.kinds.medusa.medusa_config import MedusaConfig, MedusaDecode
from specdraft.kinds.medusa.medusa_layers import MedusaHead
from specdraft.kinds.medusa.medusa_session import MedusaSession, tree_shapes
from specdraft.losses import token_losses
from specdraft.targets.target import peft_hash


class MedusaDrafter(Drafter):
    """K Medusa heads. The target's LM head (output=shared) is used, not owned: `self.target` is
    a plain attribute, so it is neither trained nor saved."""

    kind = "medusa"
    drafts_after_prefill = True  # the heads read the target's state at the last verified token
    title = "Medusa"
    session_class = MedusaSession
    batch_drafts = "all"  # the heads run over the batch at once, chains and trees
    config_class = MedusaConfig
    # A drafter loaded for decoding ignores Medusa-2's adapter weights in model.safetensors:
    # decoding gets them merged into the target (load_target(..., adapter=...)).
    checkpoint = CheckpointRecord(training_only_prefixes=("lora.",))
    decode_class = MedusaDecode
    # the loss (kl) makes the target's logits from its final state, which it reads anyway
    reads_target_logits = False

    def __init__(self, config: MedusaConfig, target, d2t: torch.Tensor | None = None) -> None:
        super().__init__()
        self.config = config
        self.target = target  # not an nn.Module: not registered, not saved
        self._drafting = SharedWeights()
        H, V = target.hidden_size, target.vocab_size
        # the final normed hidden state, the one the target's LM head reads
        self.capture_layers: list[int] = [target.num_layers]
        own = config.output == "own"
        Vd = (config.draft_vocab_size or V) if own else None
        if config.draft_vocab_size > V:
            raise ValueError(
                f"drafter.draft_vocab_size={config.draft_vocab_size} is larger than the target "
                f"{target.name!r}'s vocabulary ({V} tokens); use at most {V}, or 0 for all of it"
            )
        self.heads = nn.ModuleList(
            MedusaHead(H, config.num_layers, Vd) for _ in range(config.num_heads)
        )
        d2t = torch.arange(Vd or V) if d2t is None else d2t.long()
        if d2t.shape != (Vd or V,):
            raise ValueError(f"d2t has shape {tuple(d2t.shape)}; the config says ({Vd or V},)")
        t2d = torch.full((V,), -1, dtype=torch.long)
        t2d[d2t] = torch.arange(len(d2t))
        # draft id -> target id, and target id -> draft id (-1: not in the draft vocabulary)
        self.register_buffer("d2t", d2t.clone())
        self.register_buffer("t2d", t2d)
        if own:
            lm = target.model.get_output_embeddings().weight
            with torch.no_grad():  # training starts from the target's next-token predictor
                for head in self.heads:
                    head.out.weight.copy_(lm[d2t].float())

    @classmethod
    def build(cls, config: MedusaConfig, target, d2t: torch.Tensor | None = None) -> MedusaDrafter:
        """Heads for training. Medusa-2 (lora.rank > 0) puts LoRA adapters into `target` in place
        and registers them here, so the trainer, DDP and the checkpoint see them as the
        drafter's own parameters."""
        drafter = cls(config, target, d2t)
        if config.lora.rank > 0:
            adapters = {}
            for name, module in target.attach_lora(config.lora).named_modules():
                if hasattr(module, "lora_A") and "default" in module.lora_A:
                    adapters[name.replace(".", "__")] = nn.ModuleDict({
                        "A": module.lora_A["default"], "B": module.lora_B["default"],
                        "dropout": module.lora_dropout["default"],
                    })  # fmt: skip
            drafter.lora = nn.ModuleDict(adapters)
        return drafter

    @classmethod
    def sharding_problem(cls, config: MedusaConfig) -> str | None:
        if config.lora.rank > 0:
            return (
                "Medusa-2 (drafter.lora.rank > 0) trains adapters inside the target: shard the "
                "whole run with DeepSpeed ZeRO-3 instead, or train Medusa-1"
            )
        return None

    @property
    def peft(self):
        """Medusa-2's target with its adapters while training (Target.attach_lora holds it);
        None for Medusa-1 and for heads loaded to decode (their target has the adapter merged)."""
        return self.target.adapter if self.config.lora.rank > 0 else None

    @property
    def runs_target(self) -> bool:
        """True for Medusa-2: the target's forward is part of the loss (gradients reach the
        adapters), so the trainer hands the drafter no target output and it runs its own."""
        return self.peft is not None

    def param_groups(self) -> list[dict]:
        """The optimizer's groups: the heads at lr x heads_lr_multiplier, and Medusa-2's adapters
        at lr once heads_warmup_steps have passed. Before that the trainer gives the adapters
        no gradient (AdamW leaves them and their moments alone), except under DeepSpeed, which
        keeps its own gradient buffers: there only their zero lr holds them, their gradients
        still enter ZeRO's clipping norm and Adam moments, and the target's backward is computed
        during the warm-up all the same."""
        heads = [p for n, p in self.named_parameters() if not n.startswith("lora.")]
        groups = [{"params": heads, "lr_scale": self.config.heads_lr_multiplier, "start_step": 0}]
        if self.peft is not None:
            lora = [p for n, p in self.named_parameters() if n.startswith("lora.")]
            groups.append(
                {"params": lora, "lr_scale": 1.0, "start_step": self.config.heads_warmup_steps}
            )
        return groups

    def trained_fingerprint(self, target) -> dict:
        """The fingerprint of the target these heads decode with: Medusa-2's is the fine-tuned
        one, its adapter's hash added to the base's."""
        if self.peft is None:
            return target.fingerprint
        return {**target.fingerprint, "adapter": peft_hash(self.peft)}

    def write_extra(self, folder) -> None:
        """Checkpoint files beside the weights: Medusa-2's adapter in peft's format (adapter/),
        for load_target(base, adapter=...) and any peft user."""
        if self.peft is not None:
            self.peft.save_pretrained(str(folder / "adapter"))

    @classmethod
    def from_checkpoint(cls, config: MedusaConfig, target, hf_model) -> MedusaDrafter:
        # d2t is a placeholder here; load_drafter fills it from the weights.
        return cls(config, target)

    @property
    def draft_vocab_size(self) -> int:
        return len(self.d2t)

    @property
    def reduced_vocab(self) -> bool:
        return len(self.d2t) < self.target.vocab_size

    def depth_cap(self) -> tuple[int, str]:
        return self.config.num_heads, f"one head a level ({self.config.num_heads} heads)"

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        ignored = super().ignored_settings(decode)
        ranks = self.accuracy_ranks
        if decode.tree_top_k > ranks:
            ignored.append(
                f"tree_top_k={decode.tree_top_k} is more candidates per head than these heads' "
                f"measured ranks ({ranks}): their trees use the top {ranks}"
            )
        return ignored

    def train(self, mode: bool = True) -> MedusaDrafter:
        self._drafting.clear()  # training changes the weights; drafting rebuilds them
        return super().train(mode)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) final normed target states -> (num_heads, ..., draft vocab) logits."""
        x = self.features(h)
        return torch.stack([self.output(k)(x[k]) for k in range(len(self.heads))])

    def features(self, h: torch.Tensor) -> torch.Tensor:
        """(..., hidden) final normed target states -> (num_heads, ..., hidden): each head's
        blocks, before its output layer."""
        dtype = self.heads[0].blocks[0].linear.weight.dtype
        return torch.stack([head.features(h.to(dtype)) for head in self.heads])

    def output(self, k: int):
        """Head k's output layer, (..., hidden) -> (..., draft vocab) logits: its own, or the
        target's LM head (output=shared)."""
        if self.config.output == "shared":
            return lambda x: self.target.lm_head(x.to(self.target.dtype)).to(x.dtype)
        return self.heads[k].out

    def _target_logits(self, h: torch.Tensor) -> torch.Tensor:
        """The target's logits from its final normed states (the teacher of loss=kl)."""
        return self.target.lm_head(h.to(self.target.dtype))

    def forward(
        self, batch: Mapping[str, torch.Tensor], target_out=None
    ) -> tuple[torch.Tensor, Metrics]:
        """The training loss as a sum over `loss_tokens(batch)` tokens (the trainer calls the
        module, so DDP sees the forward). Medusa-1: the heads' loss on the frozen target's
        output. Medusa-2: target_loss + heads_weight * the heads' loss, on the fine-tuned
        target's output: its own forward, with gradients into the adapters, when target_out is
        None (training), else the one given (evaluation)."""
        if self.peft is None:
            return self.loss(batch, target_out)
        out = target_out
        if out is None:  # the logits come from the final state, a chunk at a time (_target_term)
            out = self.target.forward_with_grad(
                batch["input_ids"], **target_inputs(batch),
                capture_layers=self.capture_layers, logits_to_keep=1,
            )  # fmt: skip
        heads_sum, metrics = self.loss(batch, out)
        target_sum = self._target_term(batch, out)
        metrics["loss_heads"] = (heads_sum.detach(), loss_targets(batch, 2).sum().float())
        metrics["loss_target"] = (target_sum.detach(), batch["loss_mask"][:, 1:].sum().float())
        return target_sum + self.config.heads_weight * heads_sum, metrics

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Medusa-1: head 0 scores token t + 2 from position t, so the loss tokens from the
        third on; Medusa-2: its target term scores every loss token."""
        return loss_targets(batch, 1 if self.peft is not None else 2).sum().float()

    def _target_term(self, batch: Mapping[str, torch.Tensor], out) -> torch.Tensor:
        """Medusa-2's term for the fine-tuned target's own next-token predictions, summed over
        the loss tokens: cross-entropy on the data (lm) or KL from the frozen base (kl). The
        logits come from the final states (`out`'s, and the base's), a chunk at a time."""
        keep = batch["loss_mask"][:, 1:].bool()
        L = self.target.num_layers
        h = out.hidden_states[L][:, :-1][keep]  # (n, hidden), with gradients into the adapters
        if self.config.target_loss == "lm":
            labels = batch["input_ids"][:, 1:][keep]
            scored = token_losses(
                h, self.target.lm_head, labels=labels, chunk_tokens=self.loss_chunk_tokens
            )
            return scored.ce.sum()
        with torch.no_grad(), self.peft.disable_adapter():
            base = self.target.forward(
                batch["input_ids"], **target_inputs(batch), capture_layers=[L], logits_to_keep=1
            )

        def base_logits(x: torch.Tensor) -> torch.Tensor:
            with self.peft.disable_adapter():  # an adapter on the LM head is off for the base
                return self.target.lm_head(x)

        scored = token_losses(
            h, self.target.lm_head, target=base.hidden_states[L][:, :-1][keep],
            target_head=base_logits, divergence="fkl", chunk_tokens=self.loss_chunk_tokens,
        )  # fmt: skip
        return scored.divergence.sum()

    def _target_out(self, batch: Mapping[str, torch.Tensor], target_out):
        """The target's output for measuring: the one given, or (Medusa-2) the fine-tuned
        target's own, without gradients."""
        if target_out is not None:
            return target_out
        return self.target.forward(
            batch["input_ids"], **target_inputs(batch), capture_layers=self.capture_layers
        )

    # --- loss -----------------------------------------------------------------------------------

    def heads_scored(self, batch: Mapping[str, torch.Tensor]):
        """(k, S_k, valid) for each head the batch is long enough for: head k scores x_{t+2+k}
        from each position t < S_k = seq - 2 - k; valid (batch, S_k) bool where that token is a
        loss token of t's own document."""
        T = batch["input_ids"].shape[1]
        for k in range(min(self.config.num_heads, max(T - 2, 0))):
            yield k, T - 2 - k, loss_targets(batch, 2 + k)

    def per_head(
        self, batch: Mapping[str, torch.Tensor], target_out
    ) -> list[dict[str, torch.Tensor]]:
        """Per head k (`heads_scored`): logits (batch, S_k, draft vocab) from h_t; p_logits
        (batch, S_k, vocab) the target's logits at t + 1 + k, which predict the same token; and
        valid."""
        target_out = self._target_out(batch, target_out)
        T = batch["input_ids"].shape[1]
        h = target_out.hidden_states[self.capture_layers[0]]  # (batch, T, hidden)
        p_logits = target_out.logits.detach()  # a teacher, also when the target trains
        logits = self.logits(h[:, : max(T - 2, 0)])  # (K, batch, T - 2, draft vocab)
        return [
            {"logits": logits[k, :, :S], "p_logits": p_logits[:, 1 + k : 1 + k + S], "valid": valid}
            for k, S, valid in self.heads_scored(batch)
        ]

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """Sum over positions t of sum_k loss_decay^k * (head k's loss at t, where valid): each
        scored token's loss (head 0 scores token t + 2; a position a later head cannot score
        adds 0).

        ce: cross-entropy against the data's token (positions whose token is outside the draft
        vocabulary add 0); kl: KL(p || q) to the target's distribution, restricted and
        renormalised to the draft vocabulary as EAGLE-3 does.
        Logged per head: loss_k, top1_k and top5_k (the data's token, or the target's argmax for
        kl, among the head's best 1 / 5).
        The heads' output layers (and, for kl, the target's LM head on its final states) run
        inside specdraft/losses.py, `loss_chunk_tokens` positions at a time.
        """
        cfg = self.config
        target_out = self._target_out(batch, target_out)
        input_ids = batch["input_ids"]
        T = input_ids.shape[1]
        h = target_out.hidden_states[self.capture_layers[0]]  # (batch, T, hidden)
        x = self.features(h[:, : max(T - 2, 0)])  # (K, batch, T - 2, hidden)
        total = None
        metrics: Metrics = {}
        for k, S, valid in self.heads_scored(batch):
            if cfg.loss == "ce":
                label = self.t2d[input_ids[:, 2 + k : 2 + k + S][valid]]  # -1: not draftable
                scored = token_losses(
                    x[k, :, :S][valid], self.output(k), labels=label, top_k=5,
                    chunk_tokens=self.loss_chunk_tokens,
                )  # fmt: skip
                per_token = scored.ce
            else:
                # the target's distribution at t + 1 + k, which predicts the same token: a
                # teacher, also when the target trains (detached). Its argmax must be
                # draftable, else the restricted target is meaningless (label -1).
                scored = token_losses(
                    x[k, :, :S][valid], self.output(k),
                    target=h[:, 1 + k : 1 + k + S][valid].detach(),
                    target_head=self._target_logits,
                    target_rows=self.d2t if self.reduced_vocab else None, divergence="fkl",
                    top_k=5, chunk_tokens=self.loss_chunk_tokens,
                )  # fmt: skip
                per_token, label = scored.divergence, scored.target_token
            keep = label >= 0  # (n,)
            weighted = per_token.where(keep, 0).sum() * cfg.loss_decay**k
            total = weighted if total is None else total + weighted
            metrics[f"loss_{k}"] = sum_and_count(per_token, keep)
            metrics[f"top1_{k}"] = sum_and_count(scored.hits[:, 0], keep)
            metrics[f"top5_{k}"] = sum_and_count(scored.hits.any(-1), keep)
        if total is None:
            raise ValueError(
                f"the batch's sequences ({batch['input_ids'].shape[1]} tokens) are too short for "
                "any Medusa head: head 0 needs at least 3 tokens"
            )
        zero = total.detach().new_zeros(())
        for k in range(cfg.num_heads):  # a head the batch is too short for: every process
            for name in ("loss", "top1", "top5"):  # reduces the same figures, so none waits
                metrics.setdefault(f"{name}_{k}", (zero, zero))
        return total, metrics

    # --- what evaluation measures -----------------------------------------------------------------

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(alpha summed, greedy agreement summed, count) per draft depth 1..min(gamma, K) of a
        chain (head d - 1 at depth d). alpha = sum_x min(p(x), q(x)), q mapped to the target's
        vocabulary through d2t; greedy agreement: the head's argmax is the target's."""
        depth = min(decode.gamma, self.config.num_heads)
        return depth_sums(
            (*alpha_agreement(s["p_logits"], s["logits"], self.d2t), s["valid"])
            for s in self.per_head(batch, target_out)[:depth]
        )

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """The heads' logits after every position: after a context ending at c, head k reads
        the target's state at c - 1 and drafts depth k + 1 (the heads do not read the drafts,
        so every node of a tree at that depth takes its candidates from head k)."""
        h = self._target_out(batch, target_out).hidden_states[self.capture_layers[0]]
        depth = min(decode.gamma, self.config.num_heads)
        logits = self.logits(h[:, :-1])[:depth].permute(1, 2, 0, 3)  # (batch, seq - 1, depth, Vd)
        return one_later(logits, 0.0)  # nothing is drafted after the first token alone

    @torch.no_grad()
    def served_tree_drafts(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> ServedDrafts | None:
        """What the session drafts after every position with tree_top_k > 1: the tree of
        `tree_paths` over the heads' ranked candidates, built from the accuracies the heads
        carry (`checkpoint.heldout`), as the session builds it."""
        logits = self.served_logits(batch, target_out, decode)
        ids = batch["input_ids"]
        depth = logits.shape[2]
        # the rank of the batch's token among head d's candidates after each context (-1: not one)
        accuracy = self.accuracies(greedy=True)
        width = min(decode.tree_top_k, accuracy.shape[1], logits.shape[-1])
        ranked = self.d2t[logits.topk(width, dim=-1).indices]  # (B, T, depth, w)
        ranked[:, 0] = -1  # nothing is drafted after the first token alone
        B, T = ids.shape
        at = (
            torch.arange(T, device=ids.device)[:, None] + 1 + torch.arange(depth, device=ids.device)
        )
        truth = ids[:, at.clamp(max=T - 1)]  # (B, T, depth)
        hit = (ranked == truth[..., None]) & (at < T)[None, :, :, None]
        rank = torch.where(hit.any(-1), hit.float().argmax(-1), -1).tolist()  # (B, T, depth)
        shape = torch.zeros(3, B, T, decode.gamma, dtype=torch.long)  # accepted, depth, size
        for cap in range(1, decode.gamma + 1):
            paths = tree_paths(accuracy, decode.tree_budget, min(cap, depth), decode.tree_top_k)
            nodes, deepest = set(paths), max(map(len, paths), default=0)
            shape[1, ..., cap - 1], shape[2, ..., cap - 1] = deepest, len(paths)
            for b in range(B):
                for c in range(T):
                    k = 0  # greedy verification walks the one child holding the next token
                    while k < deepest and tuple(rank[b][c][: k + 1]) in nodes:
                        k += 1
                    shape[0, b, c, cap - 1] = k
        shape = shape.to(ids.device)
        return ServedDrafts(shape[0], shape[1], shape[2])

    def sampled_tree_reach(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        decode: DecodeConfig,
        temperature: float,
    ) -> torch.Tensor | None:
        """The tree the session samples from the heads' sampled accuracies
        (position_tree.tree_reach)."""
        shape = tree_shapes(self.accuracies(greedy=False), decode)
        return tree_reach(self, batch, target_out, decode, lambda q: shape(q.shape[0]), temperature)

    def draft_vocab(self) -> DraftVocab | None:
        return (
            DraftVocab(self.d2t, self.target.vocab_size, self.t2d) if self.reduced_vocab else None
        )

    @torch.no_grad()
    def eval_statistics(
        self, batch: Mapping[str, torch.Tensor], target_out
    ) -> dict[str, torch.Tensor]:
        """Sums the trainer adds up over held-out data and hands to `heldout_summary`: per head
        and rank r, how often the head's r-th candidate is the target's argmax (greedy), the
        target's probability of it summed (sampled), and the positions counted."""
        K, R = self.config.num_heads, self.accuracy_ranks
        device = self.d2t.device
        greedy = torch.zeros(K, R, device=device)
        sampled = torch.zeros(K, R, device=device)
        count = torch.zeros(K, 1, device=device)
        for k, s in enumerate(self.per_head(batch, target_out)):
            ranked = self.d2t[s["logits"].topk(R, dim=-1).indices]  # (B, S, R) R <= draft vocab
            p = F.softmax(s["p_logits"].float(), dim=-1)
            w = s["valid"].float()[..., None]  # (B, S, 1)
            hit = ranked == s["p_logits"].argmax(-1)[..., None]  # (B, S, R)
            greedy[k] = (hit.float() * w).sum((0, 1))
            sampled[k] = (p.gather(-1, ranked) * w).sum((0, 1))
            count[k] = w.sum()
        return {"greedy": greedy, "sampled": sampled, "count": count}

    def heldout_summary(self, sums: Mapping[str, torch.Tensor]) -> dict:
        """The measured per-rank accuracies (K lists of R), saved in the checkpoint: the tree's
        input."""
        count = sums["count"].clamp(min=1)
        return {
            "accuracy_greedy": (sums["greedy"] / count).float().cpu().tolist(),
            "accuracy_sampled": (sums["sampled"] / count).float().cpu().tolist(),
        }

    @property
    def accuracy_ranks(self) -> int:
        """Ranks per head whose accuracy evaluation measures."""
        return min(self.config.accuracy_ranks, len(self.d2t))

    def measured_accuracy(self, greedy: bool) -> torch.Tensor | None:
        """(K, R) the per-rank accuracies its checkpoint carries for this way of decoding, or
        None for heads never evaluated (eval_every=0, a published head) or measured at another
        shape."""
        values = self.checkpoint.heldout.get("accuracy_greedy" if greedy else "accuracy_sampled")
        if values is None:
            return None
        acc = torch.tensor(values, dtype=torch.float)
        shape = (self.config.num_heads, self.accuracy_ranks)
        if acc.shape != shape or torch.isnan(acc).any():
            return None
        return acc

    def predicted_tree_tau(self, decode: DecodeConfig) -> float | None:
        """1 + the expected accepted length of the tree `decode` serves, under the greedy
        per-rank accuracies the last evaluation measured (what the tree is built from); None
        for heads that carry none."""
        accuracy = self.measured_accuracy(greedy=True)
        if accuracy is None:
            return None
        paths = tree_paths(accuracy, decode.tree_budget, decode.gamma, decode.tree_top_k)
        return 1 + expected_length(accuracy, paths)

    def accuracies(self, greedy: bool) -> torch.Tensor:
        """(K, R) the measured per-rank accuracies for this way of decoding; a fallback with a
        warning for heads never evaluated (eval_every=0, or a published head)."""
        acc = self.measured_accuracy(greedy)
        if acc is None:
            warn_once(
                "these Medusa heads carry no measured accuracy (trained with eval_every=0, or "
                "imported): their tree is built from an assumed one, 0.6^(k+1) for a head's top "
                "candidate and halving per rank; train with evaluation on for a measured tree"
            )
            K, R = self.config.num_heads, self.accuracy_ranks
            k = torch.arange(K, dtype=torch.float)[:, None]
            r = torch.arange(R, dtype=torch.float)[None, :]
            acc = 0.6 ** (k + 1) * 0.5**r
        return acc
