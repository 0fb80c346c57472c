"""Two-model drafting: a small causal LM distilled from the target (DistillSpec, Zhou et al. 2024).

Read top to bottom: the config, the student (the drafter module), the distillation losses and the
on-policy data the student generates for itself; the sessions the inference loop drives are
kinds/distill/distill_session.py. The student is any Hugging Face causal LM with the target's vocabulary; its checkpoint is
a plain HF model folder, so it also serves as `generate(assistant_model=...)` in transformers.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, PreTrainedModel

from specdraft.attention import model_inputs
from specdraft.config import choice
from specdraft.core import DecodeConfig, SamplingSettings
from specdraft.drafters.base import Drafter, Metrics, sum_and_count
from specdraft.drafters.lean import SharedWeights
from specdraft.drafters.served import agreement_sums
from specdraft.drafting import draft_token
from specdraft.kinds.distill.distill_layers import ModelWeights, lean_model_supported
from specdraft.kinds.distill.distill_session import DistillSession
from specdraft.losses import divergence_per_row, token_losses
from specdraft.targets.target import final_logits

# --- config ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DistillDecode(DecodeConfig, owner="two-model"):
    """The two-model draft's decoding settings: every kind's, and an adaptive depth."""

    # Grow gamma after a draft accepted to its full depth, shrink it otherwise.
    dynamic_gamma: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.dynamic_gamma, bool):
            raise ValueError(f"dynamic_gamma must be true or false; got {self.dynamic_gamma!r}")


@dataclass
class DistillConfig:
    # Where the student's weights come from: target (embeddings, LM head, final norm and the
    # layers in init_layers copied from the target; needs the target's hidden size) | random
    # (a fresh model of the preset below) | path (a HF causal LM folder or hub id in student_path).
    init: str = choice("target", "random", "path")
    # The student to load when init=path.
    student_path: str | None = None
    # Preset derived from the target: decoder layers of the student.
    num_layers: int = 1
    # Student hidden size; None keeps the target's (required for init=target).
    hidden_size: int | None = None
    # Student MLP width; None scales the target's by hidden_size / target hidden size.
    intermediate_size: int | None = None
    # Student attention heads; None scales the target's by hidden_size / target hidden size.
    num_heads: int | None = None
    # init=target: which target layers (0-based) seed the student's layers; None: the first ones.
    init_layers: list[int] | None = None
    # Divergence to the target's distribution: fkl (KL(p||q)) | rkl (KL(q||p)) | jsd (JSD(beta)) |
    # tvd (total variation) | lk | lk_hybrid (the LK losses, for the acceptance rate:
    # specdraft/losses.py) | none (cross-entropy on the data only).
    divergence: str = choice("fkl", "rkl", "jsd", "tvd", "lk", "lk_hybrid", "none")
    # JSD(beta) mixes m = beta * p + (1 - beta) * q; beta -> 0 approaches forward KL's behaviour.
    jsd_beta: float = 0.5
    # Both distributions are softened by this temperature before the divergence.
    temperature: float = 1.0
    # Weight of the plain cross-entropy on the data's next tokens, added to the divergence.
    ce_weight: float = 0.0
    # On-policy share lambda (GKD/DistillSpec): the chance that a micro-batch is replaced by
    # continuations the student samples from the data's prompts, scored by the target.
    on_policy_ratio: float = 0.0
    # Tokens the student samples per on-policy sequence.
    on_policy_tokens: int = 32
    # Sampling temperature of on-policy continuations.
    on_policy_temperature: float = 1.0

    def __post_init__(self) -> None:
        if self.init == "path" and not self.student_path:
            raise ValueError("drafter.init=path needs drafter.student_path (a HF model folder)")
        for key, low in (("num_layers", 1), ("on_policy_tokens", 1)):
            if getattr(self, key) < low:
                raise ValueError(f"drafter.{key} must be >= {low}; got {getattr(self, key)}")
        for key in ("jsd_beta", "on_policy_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ValueError(f"drafter.{key} must be in [0, 1]; got {getattr(self, key)}")
        if not (self.temperature > 0 and self.on_policy_temperature > 0):
            raise ValueError("drafter.temperature and drafter.on_policy_temperature must be > 0")
        if self.divergence == "none" and self.ce_weight <= 0:
            raise ValueError("drafter.divergence=none trains on nothing unless ce_weight > 0")


# --- module ------------------------------------------------------------------------------------


def build_student(cfg: DistillConfig, target) -> PreTrainedModel:
    """The student HF causal LM for `cfg`: loaded, random, or seeded from the target.

    Random initialisation draws from torch's global generator; the trainer seeds it first.
    """
    if cfg.init == "path":
        student = AutoModelForCausalLM.from_pretrained(cfg.student_path, dtype=torch.float32)
        _check_vocab(student, target, cfg.student_path)
        return student
    config = copy.deepcopy(target.config)
    t_hidden = target.hidden_size
    hidden = cfg.hidden_size or t_hidden
    if cfg.init == "target" and hidden != t_hidden:
        raise ValueError(
            f"drafter.init=target copies the target's embeddings, so the student needs its hidden "
            f"size {t_hidden}, not drafter.hidden_size={hidden}; use drafter.init=random for a "
            "narrower student"
        )
    scale = hidden / t_hidden
    target_heads = config.num_attention_heads
    heads = cfg.num_heads or max(1, round(target_heads * scale))
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if hidden % heads:
        raise ValueError(f"drafter.hidden_size={hidden} is not divisible by num_heads={heads}")
    config.num_hidden_layers = cfg.num_layers
    config.hidden_size = hidden
    config.intermediate_size = cfg.intermediate_size or max(
        1, round(config.intermediate_size * scale)
    )
    config.num_attention_heads = heads
    if hasattr(config, "num_key_value_heads"):
        config.num_key_value_heads = max(1, min(heads, round(kv_heads * scale)))
        while heads % config.num_key_value_heads:
            config.num_key_value_heads -= 1
    if hasattr(config, "head_dim") and (hidden != t_hidden or heads != target_heads):
        # a narrower student: its heads split its width. At the target's width and heads the
        # target's own head_dim stays (Qwen3's and Gemma's are not hidden / heads), so seeded
        # layers keep their shapes.
        config.head_dim = hidden // heads
    if getattr(config, "layer_types", None) is not None:
        # each student layer keeps the attention type of the target layer that seeds it
        seeds = cfg.init_layers if cfg.init_layers is not None else range(cfg.num_layers)
        types = list(config.layer_types)
        config.layer_types = [types[i % len(types)] for i in seeds]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if cfg.init == "target":
        _copy_from_target(student, target, cfg)
    return student


def _copy_from_target(student: PreTrainedModel, target, cfg: DistillConfig) -> None:
    layers = cfg.init_layers if cfg.init_layers is not None else list(range(cfg.num_layers))
    if len(layers) != cfg.num_layers or not all(0 <= i < target.num_layers for i in layers):
        raise ValueError(
            f"drafter.init_layers={layers} must name {cfg.num_layers} target layers in "
            f"0..{target.num_layers - 1}"
        )
    # a sharded target gathers each piece for the copy (target.whole), one at a time
    pieces = [
        (student.get_input_embeddings(), target.model.get_input_embeddings()),
        (student.get_output_embeddings(), target.model.get_output_embeddings()),
        (student.model.norm, target.norm),
        *((mine, target.layers[i]) for mine, i in zip(student.model.layers, layers, strict=True)),
    ]
    with torch.no_grad():
        for mine, theirs in pieces:
            with target.whole(theirs):
                mine.load_state_dict(theirs.state_dict())


def _check_vocab(student: PreTrainedModel, target, where: str) -> None:
    vocab = student.get_output_embeddings().weight.shape[0]
    if vocab != target.vocab_size:
        raise ValueError(
            f"the student {where} has a vocabulary of {vocab} tokens but the target "
            f"{target.name!r} has {target.vocab_size}: a draft model must share the target's "
            "tokenizer. Pick a student trained with the target's tokenizer, or use "
            "drafter.init=target / random to build one from the target."
        )


class DistillDrafter(Drafter):
    """The student wrapped as a drafter. `hf_model` is the plain HF causal LM that is saved."""

    kind = "distill"
    title = "two-model"
    session_class = DistillSession  # one row or a batch's chains; trees row by row
    batch_drafts = "chains"
    config_class = DistillConfig
    decode_class = DistillDecode
    # A plain HF causal LM (a folder without a specdraft block, or a model passed to generate)
    # drafts as this kind. The loss needs only the target's logits, no hidden states.
    wraps_hf_models = True

    def __init__(
        self, hf_model: PreTrainedModel, config: DistillConfig | None = None, target=None
    ) -> None:
        super().__init__()
        self.hf_model = hf_model
        # A plain HF folder loaded for inference has no training config: the defaults describe it.
        self.config = config if config is not None else DistillConfig()
        self._drafting = SharedWeights()  # drafting_weights' cache
        # The target whose LM head the loss applies to the target's final states, a chunk at a
        # time: a plain attribute, neither trained nor saved. Without one (a student loaded to
        # decode) or with a ZeRO-3 shard of it (no whole LM head) the loss reads the target's
        # logits from its forward instead.
        self.target = target if target is not None and target.complete else None
        if self.target is not None:
            self.capture_layers = [self.target.num_layers]
            self.reads_target_logits = False

    def as_hf_model(self) -> PreTrainedModel:
        return self.hf_model

    def transformers_baseline(self, decode: DecodeConfig):
        # transformers reads gamma and its schedule from the assistant's own generation config;
        # a zero confidence threshold turns off its early stop, so gamma is constant
        config = self.hf_model.generation_config
        config.num_assistant_tokens = decode.gamma
        config.num_assistant_tokens_schedule = "constant"
        config.assistant_confidence_threshold = 0.0
        return "hf_assisted", {}, {"assistant_model": self.hf_model}

    def drafting_weights(self, int8: bool) -> ModelWeights | None:
        """The student's weights as lean drafting runs them (drafters/lean.py), or None where it
        is not a model LeanModel runs. Shared by sessions until a parameter changes."""
        if not lean_model_supported(self.hf_model):
            return None
        params = list(self.hf_model.parameters())
        return self._drafting.get(params, int8, lambda: ModelWeights(self.hf_model, int8=int8))

    def train(self, mode: bool = True) -> DistillDrafter:
        self._drafting.clear()  # training changes the weights; drafting rebuilds them
        return super().train(mode)

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        ignored = super().ignored_settings(decode)
        if decode.chain:
            return ignored
        if decode.draft_weights == "int8":
            ignored.append(
                "draft_weights=int8 is ignored by two-model trees (tree_top_k > 1): they draft "
                "with the student's full weights; int8 is for chains"
            )
        return ignored

    @property
    def vocab_size(self) -> int:
        return self.hf_model.get_output_embeddings().weight.shape[0]

    @classmethod
    def build(cls, config: DistillConfig, target) -> DistillDrafter:
        return cls(build_student(config, target), config, target)

    @classmethod
    def from_checkpoint(cls, config: DistillConfig, target, hf_model) -> DistillDrafter:
        if target is not None:
            _check_vocab(hf_model, target, "checkpoint")
        return cls(hf_model, config)

    # --- loss ----------------------------------------------------------------------------------

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """Sum over the batch's loss tokens of the divergence (+ ce_weight * cross-entropy), over
        `loss_tokens(batch)` tokens. Position t's logits predict token t + 1, so the loss at t
        counts where loss_mask[t + 1]. The student's LM head (and the target's, on its final
        states) run inside specdraft/losses.py, `loss_chunk_tokens` positions at a time.
        """
        cfg = self.config
        input_ids = batch["input_ids"]
        keep = batch["loss_mask"][:, 1:].bool()  # (b, s - 1): token t + 1 is a target
        # packed rows: each document attends to itself only (specdraft/attention.py), which
        # transformers applies in a forward without a cache
        out = self.hf_model(
            input_ids=input_ids, **model_inputs(batch), use_cache=False,
            output_hidden_states=True, logits_to_keep=1,
        )  # fmt: skip
        student = out.hidden_states[-1][:, :-1][keep]  # (n, hidden): the final normed states
        final = target_out.hidden_states.get(self.target.num_layers) if self.target else None
        if final is not None:
            target, target_head = final[:, :-1][keep], self.target.lm_head
        else:  # the target's logits as its forward gave them
            target, target_head = target_out.logits[:, :-1][keep], None
        scored = token_losses(
            student, partial(final_logits, self.hf_model), labels=input_ids[:, 1:][keep],
            target=target, target_head=target_head,
            divergence="fkl" if cfg.divergence == "none" else cfg.divergence,
            temperature=cfg.temperature, beta=cfg.jsd_beta, top_k=1,
            chunk_tokens=self.loss_chunk_tokens,
        )  # fmt: skip
        metrics: Metrics = {}
        loss = scored.ce.new_zeros(())
        if cfg.divergence != "none":
            metrics[f"loss_{cfg.divergence}"] = sum_and_count(scored.divergence)
            loss = loss + scored.divergence.sum()
        metrics["loss_ce"] = sum_and_count(scored.ce)
        if cfg.ce_weight > 0:
            loss = loss + cfg.ce_weight * scored.ce.sum()
        metrics["top1_agreement"] = sum_and_count(scored.hits[:, 0])
        return loss, metrics

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, ...]:
        """(alpha summed over loss tokens, greedy agreement summed, token count), one entry per
        draft depth 1..gamma.

        alpha = sum_x min(p(x), q(x)) (Leviathan et al.) at temperature 1 on teacher-forced data,
        the chance a sampled draft token is accepted; greedy agreement: the student's argmax is
        the target's. A chain drafter's positions are alike, so each depth gets the same estimate
        and the trainer's tau = 1 + sum_k prod_{i<=k} alpha_i equals
        (1 - alpha^(gamma+1)) / (1 - alpha), for the gamma the drafter is served with.
        """
        # packed rows: each document attends to itself only (specdraft/attention.py), which
        # transformers applies in a forward without a cache
        out = self.hf_model(input_ids=batch["input_ids"], **model_inputs(batch), use_cache=False)
        keep = batch["loss_mask"][:, 1:].bool()  # (b, s - 1): token t + 1 is a target
        sums = agreement_sums(target_out.logits[:, :-1][keep], out.logits[:, :-1][keep])
        return tuple(x.repeat(decode.gamma) for x in sums)

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DistillDecode
    ) -> torch.Tensor | None:
        """The student's chain logits after every position: its logits at c + i - 1 are depth
        i's after a context ending at c (its cache then holds the batch's tokens). A dynamic
        gamma has none."""
        if getattr(decode, "dynamic_gamma", False):
            return None
        ids = batch["input_ids"]
        return self.hf_model(input_ids=ids, attention_mask=batch["attention_mask"]).logits

    # --- on-policy data ------------------------------------------------------------------------

    @torch.no_grad()
    def prepare_batch(
        self,
        batch: dict[str, torch.Tensor],
        target,
        generator: torch.Generator,
        shared: torch.Generator | None = None,
    ) -> dict[str, torch.Tensor]:
        """With probability on_policy_ratio, swap the batch for the student's own continuations.

        Whether to is drawn from `shared`, a generator in the same state on every process (the
        trainer's; `generator` when not given): every process then generates, or none does, so
        they run the same forwards (ZeRO-3 would hang otherwise). The continuations are sampled
        with this process's own `generator`.

        The prompt is each row's prefix before its first loss token (at most half the row), cut
        to the shortest in the batch so the rows stay aligned; the student samples
        on_policy_tokens after it, and only those sampled tokens are trained on (the target
        scores them when the trainer runs it on the returned batch).
        """
        cfg = self.config
        if (
            cfg.on_policy_ratio == 0
            or torch.rand((), generator=shared or generator, device=(shared or generator).device)
            >= cfg.on_policy_ratio
        ):
            return batch
        input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
        first_loss = torch.where(loss_mask.any(1), loss_mask.int().argmax(1), input_ids.shape[1])
        lengths = batch["attention_mask"].sum(1)
        prompt_len = int(torch.minimum(first_loss, lengths // 2).clamp(min=1).min())
        prompt = input_ids[:, :prompt_len]
        sampled = sample(
            self.hf_model, prompt, cfg.on_policy_tokens, cfg.on_policy_temperature, generator
        )
        ids = torch.cat([prompt, sampled], dim=1)
        new_mask = torch.zeros_like(ids)
        new_mask[:, prompt_len:] = 1
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": new_mask}


def divergence(
    target_logits: torch.Tensor,
    student_logits: torch.Tensor,
    kind: str,
    temperature: float = 1.0,
    beta: float = 0.5,
) -> torch.Tensor:
    """Per-position divergence between target p and student q, both softened by `temperature`.

    (n, vocab) logits -> (n,). Computed in float32 from log-probabilities, so a token one
    distribution gives probability 0 contributes 0 rather than nan.
    """
    log_p = F.log_softmax(target_logits.float() / temperature, dim=-1)
    log_q = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return divergence_per_row(log_p, log_q, kind, beta)


@torch.no_grad()
def sample(
    model: PreTrainedModel,
    prompt: torch.Tensor,
    new_tokens: int,
    temperature: float,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(batch, prompt) -> (batch, new_tokens) tokens sampled from `model` with its KV cache."""
    out = model(input_ids=prompt, use_cache=True)
    sampling = SamplingSettings(temperature=temperature)
    tokens = []
    for i in range(new_tokens):
        token, _ = draft_token(out.logits[:, -1], sampling, generator)  # (batch, 1)
        tokens.append(token)
        if i + 1 < new_tokens:
            out = model(input_ids=token, cache=out.cache, use_cache=True)
    return torch.cat(tokens, dim=1)
