"""LayerSkip: the target fine-tuned so that its own first E layers draft for the rest.

Training (Elhoushi et al. 2024, "LayerSkip"): the target itself trains, with
- layer dropout: in each sample, layer l is skipped with probability
  p_max * scale(l / (L - 1)) (scales below), so late layers learn to be optional and early
  ones to carry the prediction; off in evaluation. Skipped samples do not run the layer at all;
- an early-exit loss: the shared final norm and LM head read the hidden state after chosen
  layers, and each exit's cross-entropy over the loss tokens is weighted by a scale function of
  its depth, with e_scale on the non-final exits; a curriculum can rotate or grow the set of
  exits over training; the last layer always trains.
Each training sample's layer-dropout draws come from its own generator, seeded by the step's
shared seed and the sample's index in the training set (`prepare_batch`): a run is deterministic
for its seed, a resumed run equals an uninterrupted one, and two processes skip what one does.

Decoding (self-speculation): layers [0, E) + final norm + LM head draft a chain; layers [E, L)
verify it, fed the exit-layer hidden states the draft already computed, so the early layers run
once per token. Draft and verification share the loop's one KV cache: drafting appends the
early layers' entries, verification the late layers', and the loop's compaction keeps the
accepted path in both. The checkpoint is a plain Hugging Face model folder (the fine-tuned
target) with the drafter's block: it is its own target. The sessions, and running a range of
layers at a time, are kinds/layerskip/layerskip_session.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn

from specdraft.attention import FULL, SLIDING, AttentionLayout, model_inputs
from specdraft.core import (
    DecodeConfig,
    SamplingSettings,
    check_integer,
)
from specdraft.drafters.base import Drafter, LoraConfig, Metrics, sum_and_count
from specdraft.drafters.served import agreement_sums
from specdraft.drafters.sessions import RowSessions
from specdraft.kinds.layerskip.layerskip_session import (
    LayerSkipRowSession,
    LayerSkipSession,
    run_layers,
)
from specdraft.losses import token_losses
from specdraft.targets.target import (
    adapter_hash,
    final_logits,
    layer_rotary,
    llama_parts,
    peft_hash,
    weights_hash,
)

# scale(x), x = l / (L - 1) in [0, 1]: how layer dropout grows with depth (p_max at the top for
# all but uniform; exp is the paper's choice for continual pre-training)
DROPOUT_SCALES = {
    "uniform": lambda x: 1.0,
    "linear": lambda x: x,
    "exp": lambda x: 2.0**x - 1.0,
    "log": lambda x: math.log2(1.0 + x),
    "sin": lambda x: math.sin(math.pi / 2 * x),
}
# weight(e) of the exit after e layers (e = 1..L) before normalising: uniform, e, 1 + ... + e,
# sqrt(e), 1 / e, 1 / sqrt(e) (deeper exits weigh more with the first four)
EXIT_SCALES = {
    "uniform": lambda e: 1.0,
    "l": lambda e: float(e),
    "sum_l": lambda e: e * (e + 1) / 2.0,
    "sqrt_l": lambda e: math.sqrt(e),
    "inv_l": lambda e: 1.0 / e,
    "inv_sqrt_l": lambda e: 1.0 / math.sqrt(e),
}
CURRICULA = ("none", "rotational", "gradual")


@dataclass(frozen=True)
class LayerSkipDecode(DecodeConfig, owner="LayerSkip"):
    """LayerSkip's decoding settings: every kind's, and where the draft exits the target."""

    # Draft with the target's first exit_layer layers (0: the exit layer the drafter was trained
    # for). Early-exit training trains every exit, so the fastest one on the hardware at hand is
    # a decoding choice (scripts/tune.py measures it).
    exit_layer: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_integer(self, "exit_layer", 0)


@dataclass
class LayerSkipConfig:
    # E: the draft runs the first E layers (then the final norm and LM head); 0: a quarter of
    # the target's layers (at least 1), resolved against the target when training starts.
    exit_layer: int = 0
    # Layer dropout: the largest skip probability p_max (0: off) and how it grows with depth.
    layer_dropout: float = 0.1
    dropout_scale: str = "exp"
    # Early-exit loss after these layer counts (1..L-1; the last layer always trains); empty:
    # after every `early_exit_every`-th layer. The exit layer E is always among them.
    early_exit_layers: list[int] = field(default_factory=list)
    early_exit_every: int = 1
    # Each exit's weight: EXIT_SCALES[early_exit_scale](e), times e_scale for the non-final
    # exits, normalised to sum to 1 over the exits trained at a step.
    early_exit_scale: str = "l"
    e_scale: float = 1.0
    # The share of each non-final exit's loss taken against the model's own final-layer
    # distribution at the same position (a soft target, no gradient through it) rather than the
    # next token: 0 is LayerSkip's labels only. A draft is judged by agreeing with the final
    # layer, not with the data, so self-distilled exits spend their few layers on what the
    # model itself will predict; the final layer always trains on the labels. The target is
    # the final layer of the forward that trains, so a sample's layer dropout shortens it too.
    exit_distill: float = 0.0
    # none: every exit at every step; rotational: the non-final exits take turns, one group of
    # every `rotation_period`-th exit per step; gradual: exits join from the deepest to the
    # shallowest, evenly over the first `gradual_fraction` of training.
    curriculum: str = "none"
    rotation_period: int = 2
    gradual_fraction: float = 0.5
    # LoRA adapters instead of full fine-tuning (lora.rank > 0).
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        choices = (
            ("dropout_scale", self.dropout_scale, DROPOUT_SCALES),
            ("early_exit_scale", self.early_exit_scale, EXIT_SCALES),
            ("curriculum", self.curriculum, CURRICULA),
        )
        for name, value, allowed in choices:
            if value not in allowed:
                raise ValueError(f"drafter.{name} must be one of {sorted(allowed)}; got {value!r}")
        if not 0 <= self.layer_dropout < 1:
            raise ValueError(f"drafter.layer_dropout must be in [0, 1); got {self.layer_dropout}")
        if self.exit_layer < 0 or self.early_exit_every < 1 or self.rotation_period < 1:
            raise ValueError(
                "drafter.exit_layer must be >= 0 (0: a quarter of the layers), "
                "early_exit_every and rotation_period >= 1"
            )
        if self.e_scale <= 0 or not 0 <= self.gradual_fraction <= 1:
            raise ValueError("drafter.e_scale must be > 0 and gradual_fraction in [0, 1]")
        if not 0 <= self.exit_distill <= 1:
            raise ValueError(
                f"drafter.exit_distill must be in [0, 1] (0: the labels only, 1: the final "
                f"layer's distribution only); got {self.exit_distill}"
            )

    def resolve(self, num_layers: int) -> LayerSkipConfig:
        """Check the layer counts against a target of `num_layers` layers and fill exit_layer."""
        if num_layers < 2:
            raise ValueError(
                f"LayerSkip needs a target with at least 2 layers (one to draft, one to verify); "
                f"this one has {num_layers}"
            )
        if self.exit_layer == 0:
            self.exit_layer = max(1, num_layers // 4)
        if not 1 <= self.exit_layer < num_layers:
            raise ValueError(
                f"drafter.exit_layer {self.exit_layer} must be in 1..{num_layers - 1} for this "
                f"{num_layers}-layer target: the draft needs a layer, verification at least one"
            )
        bad = [e for e in self.early_exit_layers if not 1 <= e < num_layers]
        if bad:
            raise ValueError(
                f"drafter.early_exit_layers {bad} are not in 1..{num_layers - 1} (the last layer, "
                f"{num_layers}, always trains)"
            )
        return self

    def exits(self, num_layers: int) -> list[int]:
        """Every exit the loss may train, shallowest first, the last layer included."""
        chosen = set(self.early_exit_layers) or set(
            range(self.early_exit_every, num_layers, self.early_exit_every)
        )
        return sorted(chosen | {self.exit_layer, num_layers})


def dropout_rates(num_layers: int, p_max: float, scale: str) -> list[float]:
    """Skip probability of each layer: p_max * scale(l / (L - 1))."""
    fn = DROPOUT_SCALES[scale]
    return [p_max * fn(i / (num_layers - 1)) for i in range(num_layers)]


def exit_weights(exits: list[int], num_layers: int, scale: str, e_scale: float) -> dict[int, float]:
    """Normalised loss weight of each exit (the last layer's without e_scale)."""
    fn = EXIT_SCALES[scale]
    raw = {e: fn(e) * (1.0 if e == num_layers else e_scale) for e in exits}
    total = sum(raw.values())
    return {e: w / total for e, w in raw.items()}


def active_exits(cfg: LayerSkipConfig, num_layers: int, step: int, max_steps: int) -> list[int]:
    """The exits the loss trains at `step` (0-based) of `max_steps`, under the curriculum."""
    exits = cfg.exits(num_layers)
    early = exits[:-1]
    if cfg.curriculum == "rotational":
        early = [
            e for i, e in enumerate(early) if i % cfg.rotation_period == step % cfg.rotation_period
        ]
    elif cfg.curriculum == "gradual":
        horizon = cfg.gradual_fraction * max_steps
        early = [e for e in early if step >= horizon * (num_layers - e) / num_layers]
    return [*early, num_layers]


def weights_digest(model: nn.Module) -> str:
    """A short hash of a model's weights (every tensor, sampled at a stride of at most 4096
    values each, fp32): what a fully fine-tuned target is told apart from its base by."""
    state = model.state_dict()
    return adapter_hash({n: t.reshape(-1)[:: max(1, t.numel() // 4096)] for n, t in state.items()})


# --- the drafter ----------------------------------------------------------------------------------


class LayerSkipDrafter(Drafter):
    """The fine-tuned target as its own drafter. `hf_model` is the model (what is saved: a plain
    HF folder); with LoRA, `peft` is its peft wrapper while training (the Target holds it:
    Target.attach_lora)."""

    kind = "layerskip"
    title = "LayerSkip"
    drafts_trees = False  # tree_top_k > 1 is ignored: it drafts chains
    config_class = LayerSkipConfig
    # the loss runs the model itself (the trainer hands it no target output)
    runs_target = True
    # decoding uses the target's own weights: load_drafter loads no second copy
    uses_target_weights = True
    decode_class = LayerSkipDecode

    def __init__(self, config: LayerSkipConfig, hf_model, target=None) -> None:
        super().__init__()
        self.hf_model = hf_model
        self.config = config.resolve(hf_model.config.num_hidden_layers)
        self.num_layers = hf_model.config.num_hidden_layers
        self.tuned = target  # the Target fine-tuned in place, where training built it
        self._step, self._max_steps = 0, 1

    @classmethod
    def build(cls, config: LayerSkipConfig, target) -> LayerSkipDrafter:
        """For training: the target's own model becomes trainable in place (full fine-tuning),
        or gets LoRA adapters (lora.rank > 0); no second copy of the weights."""
        llama_parts(target.model)  # a clear error before training for other layouts
        if config.lora.rank > 0:
            target.attach_lora(config.lora)
            return cls(config, target.model, target)
        for p in target.model.parameters():
            p.requires_grad_(True)
        return cls(config, target.model)

    @property
    def peft(self):
        """The LoRA's peft model while training with lora.rank > 0, else None."""
        return self.tuned.adapter if self.tuned is not None else None

    @classmethod
    def from_checkpoint(cls, config: LayerSkipConfig, target, hf_model) -> LayerSkipDrafter:
        return cls(config, target.model if hf_model is None else hf_model)

    @classmethod
    def sharding_problem(cls, config: LayerSkipConfig) -> str | None:
        return (
            "LayerSkip fine-tunes the target itself: shard the whole run with DeepSpeed ZeRO-3 "
            "instead (configs/accelerate/deepspeed_zero3.yaml)"
        )

    def as_hf_model(self):
        return self.hf_model

    def prepare_batch(self, batch: dict, target, generator, shared: torch.Generator) -> dict:
        """The trainer's hook before each micro-batch: each sample's layer-dropout decisions
        (batch["layer_skip"], (layers, batch) bool), drawn from a generator seeded by the step's
        seed (the same on every process) and the sample's index in the training set, so they do
        not depend on how the global batch is split into processes and micro-batches."""
        if self.config.layer_dropout > 0 and "example_index" in batch:
            step_seed = shared.initial_seed()
            draws = torch.stack([
                torch.rand(self.num_layers, generator=torch.Generator().manual_seed(
                    (step_seed * 1_000_003 + int(i)) % (2**63 - 1)
                ))
                for i in batch["example_index"].tolist()
            ], dim=1)  # fmt: skip
            batch["layer_skip"] = (draws < self._rates()[:, None]).to(batch["input_ids"].device)
        return batch

    def _rates(self) -> torch.Tensor:
        c = self.config
        return torch.tensor(dropout_rates(self.num_layers, c.layer_dropout, c.dropout_scale))

    def begin_step(self, step: int, max_steps: int) -> None:
        """Called by the trainer before each training step: the curriculum follows it."""
        self._step, self._max_steps = step, max(1, max_steps)

    def trained_fingerprint(self, target) -> dict:
        """The fine-tuned model's own fingerprint: the base's, with the trained weights' hash as
        its `adapter` (save_drafter writes it into the saved model's config.json, so
        load_target(folder) gives the same fingerprint back)."""
        digest = peft_hash(self.peft) if self.peft is not None else weights_digest(self.hf_model)
        fingerprint = {**target.fingerprint, "adapter": digest}
        served = weights_hash(self.hf_model)  # full fine-tuning may have moved the embedding
        if served is not None and "weights" in fingerprint:
            fingerprint["weights"] = served
        return fingerprint

    def model_to_save(self):
        """The plain HF model a checkpoint holds: the model itself, or with LoRA a merged copy
        (the adapter is also saved, in adapter/, by `write_extra`)."""
        if self.peft is None:
            return self.hf_model
        import copy

        return copy.deepcopy(self.peft).merge_and_unload()

    def write_extra(self, folder) -> None:
        if self.peft is not None:
            self.peft.save_pretrained(str(folder / "adapter"))

    def draft_exit(self, decode: LayerSkipDecode) -> int:
        """The exit layer a draft with `decode` runs to: decode.exit_layer, else the trained one."""
        exit_layer = decode.exit_layer or self.config.exit_layer
        if not 1 <= exit_layer < self.num_layers:
            raise ValueError(
                f"exit_layer={exit_layer} is not in 1..{self.num_layers - 1} for this "
                f"{self.num_layers}-layer target: the draft needs a layer, verification at least one"
            )
        return exit_layer

    def check_decode(self, decode: LayerSkipDecode) -> None:
        self.draft_exit(decode)

    @classmethod
    def served_agreement(
        cls, decode: Mapping, alphas: Sequence[float], measured: Mapping | None
    ) -> list[float]:
        """At an exit layer other than the one trained for (a tuned exit_layer), the top-1
        agreement with the final layer measured there after training (the run's
        target_quality.json, `exit_agreement.after`), taken for every depth since it was
        measured at the first only."""
        exit_layer = decode.get("exit_layer", 0)
        per_exit = (measured or {}).get("exit_agreement", {}).get("after", {})
        if exit_layer and str(exit_layer) in per_exit:
            return [per_exit[str(exit_layer)]["agreement"]] * decode["gamma"]
        return list(alphas)

    def resolved_decode(self, decode: LayerSkipDecode) -> LayerSkipDecode:
        return decode.replace(exit_layer=self.draft_exit(decode))

    def candidate_exits(self) -> list[int]:
        """The exit layers a draft may stop at that training taught to: every one the loss
        trains (drafter.early_exit_layers, or every early_exit_every-th, and exit_layer), the
        last layer left out. Tuning races them and the end of a run measures each (on a 30-layer
        target each costs an LM head over the held-out tokens)."""
        return [e for e in self.config.exits(self.num_layers) if e < self.num_layers]

    def search_space(self, target) -> dict[str, list]:
        return {"exit_layer": self.candidate_exits()}

    def transformers_baseline(self, decode: DecodeConfig):
        # the target drafting with its own first layers: transformers' early-exit assisted
        # generation, with the same exit and a constant gamma (it recomputes the early layers);
        # set per call, since another spec of the same folder (another gamma) shares the model
        settings = dict(
            num_assistant_tokens=decode.gamma, num_assistant_tokens_schedule="constant",
            assistant_confidence_threshold=0.0,
        )  # fmt: skip
        return "hf_early_exit", settings, {"assistant_early_exit": self.draft_exit(decode)}

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        ignored = super().ignored_settings(decode)
        if decode.draft_weights == "int8":
            ignored.append(
                "draft_weights=int8 is ignored by LayerSkip: its draft is the target's own layers"
            )
        return ignored

    # --- loss --------------------------------------------------------------------------------

    def exit_states(
        self, batch: Mapping[str, torch.Tensor], exits: list[int]
    ) -> dict[int, torch.Tensor]:
        """Hidden states after each exit's layer count (final-normed), with layer dropout while
        training: {e: (batch, seq, H)}."""
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        embed, layers, norm, rotary_emb, _ = llama_parts(self.hf_model)
        config = self.hf_model.config
        ids = batch["input_ids"]
        hidden = embed(ids)
        # packed rows (data.pack): positions restart at each document, and the masks keep each
        # document to itself (specdraft/attention.py, model_inputs)
        inputs = model_inputs(batch)
        positions = inputs["position_ids"]
        if positions is None:
            positions = torch.arange(ids.shape[1], device=ids.device)[None]
        # the masks the model's own forward builds, one per layer type: a sliding-window layer
        # trains on its window, as it computes when served
        layout = AttentionLayout.of(config)
        build = {FULL: create_causal_mask, SLIDING: create_sliding_window_causal_mask}
        masks = {
            kind: build[kind](
                config=config, inputs_embeds=hidden, attention_mask=inputs["attention_mask"],
                cache=None, position_ids=positions,
            )
            for kind in set(layout.layer_types)
        }  # fmt: skip
        skip = None
        if self.training and self.config.layer_dropout > 0:
            skipped = batch.get("layer_skip")  # drawn per sample by prepare_batch
            if skipped is None:  # outside the trainer: torch's generator
                draws = torch.rand(self.num_layers, ids.shape[0], device=ids.device)
                skipped = draws < self._rates().to(ids.device)[:, None]
            skip = {i: skipped[i] for i in range(self.num_layers) if bool(skipped[i].any())}
        states = run_layers(
            enumerate(layers), hidden, mask=lambda i: layout.layer_mask(masks, i),
            positions=positions, rotary=layer_rotary(rotary_emb, layout, hidden, positions),
            skip=skip, keep={e - 1 for e in exits},
        )  # fmt: skip
        return {e: norm(states[e - 1]) for e in exits}

    def loss(
        self, batch: Mapping[str, torch.Tensor], target_out=None
    ) -> tuple[torch.Tensor, Metrics]:
        """The weighted early-exit cross-entropy summed over the loss tokens (position t
        predicts t + 1 where loss_mask[t + 1]); with exit_distill d, a non-final exit's is
        (1 - d) * CE(labels) + d * CE(the final layer's distribution, detached). The shared LM
        head runs inside specdraft/losses.py, `loss_chunk_tokens` positions at a time, once per
        exit: no exit's (tokens, vocab) logits exist whole."""
        if self.training:
            exits = active_exits(self.config, self.num_layers, self._step, self._max_steps)
        else:
            exits = self.config.exits(self.num_layers)
        weights = exit_weights(
            exits, self.num_layers, self.config.early_exit_scale, self.config.e_scale
        )
        states = self.exit_states(batch, exits)
        keep = batch["loss_mask"][:, 1:].bool()
        labels = batch["input_ids"][:, 1:][keep]
        lm_head = partial(final_logits, self.hf_model)  # soft-capped as the model caps
        loss = states[exits[-1]].new_zeros((), dtype=torch.float32)
        metrics: Metrics = {}
        last, distill = exits[-1], self.config.exit_distill
        final = states[last][:, :-1][keep]  # (tokens, hidden)
        for e in exits:
            soft = e != last and distill > 0
            scored = token_losses(
                final if e == last else states[e][:, :-1][keep], lm_head, labels=labels,
                target=final.detach() if soft else None, target_head=lm_head,
                divergence="soft_ce", chunk_tokens=self.loss_chunk_tokens,
            )  # fmt: skip
            ce = scored.ce
            metrics[f"loss_exit{e}"] = sum_and_count(ce)
            if soft:
                metrics[f"distill_exit{e}"] = sum_and_count(scored.divergence)
                ce = (1 - distill) * ce + distill * scored.divergence
            loss = loss + weights[e] * ce.sum()
        return loss, metrics

    @torch.no_grad()
    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, ...]:
        """(alpha summed, greedy agreement summed, count) per draft depth 1..gamma: the exit
        layer's distribution q against the model's own final p at each loss position; a chain
        drafter's depths get the same estimate (as the distilled draft's)."""
        e, last = self.draft_exit(decode), self.num_layers
        logits = self._loss_logits(batch, self.exit_states(batch, [e, last]))
        return tuple(x.repeat(decode.gamma) for x in agreement_sums(logits(last), logits(e)))

    def _loss_logits(self, batch: Mapping[str, torch.Tensor], states: dict[int, torch.Tensor]):
        """exit e -> its (n, vocab) float32 logits at the batch's n loss positions, through the
        shared final norm's output and LM head (soft-capped as the model caps)."""
        keep = batch["loss_mask"][:, 1:].bool()
        return lambda e: final_logits(self.hf_model, states[e][:, :-1][keep]).float()

    @torch.no_grad()
    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """The chain's logits after every position: the exit layer's at c + i - 1 are depth
        i's after a context ending at c (the early layers' cache then holds the batch's tokens,
        as the shared cache does)."""
        e = self.draft_exit(decode)
        state = self.exit_states(batch, [e])[e]
        return final_logits(self.hf_model, state)  # (batch, seq, vocab): position-wise

    @torch.no_grad()
    def agreement_per_exit(self, batch: Mapping[str, torch.Tensor]) -> dict[int, torch.Tensor]:
        """For every candidate exit e (`candidate_exits`): (top-1 agreements with the final
        layer, summed sampled acceptance alpha, positions) over the batch's loss positions, as a
        (3,) tensor: how well each would draft, without layer dropout."""
        exits = self.candidate_exits()
        training = self.training
        self.eval()
        try:
            states = self.exit_states(batch, [*exits, self.num_layers])
        finally:
            self.train(training)
        logits = self._loss_logits(batch, states)
        final, out = logits(self.num_layers), {}
        for e in exits:  # one exit's logits at a time
            alpha, agree, count = agreement_sums(final, logits(e))
            out[e] = torch.stack([agree, alpha, count])
        return out

    # --- decoding ----------------------------------------------------------------------------

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> LayerSkipSession:
        return LayerSkipSession(*self._session_args(target, decode), sampling, generator)

    def _session_args(self, target, decode: DecodeConfig) -> tuple[nn.Module, int, DecodeConfig]:
        """A session's model, exit layer and settings (the kind's own class) on `target`, which
        must be this drafter's own model."""
        if target.model is not self.hf_model:
            raise ValueError(
                "a LayerSkip drafter decodes with its own fine-tuned model as the target: load "
                "the target from the drafter's folder (evaluate.py --target FOLDER)"
            )
        decode = self.decode_settings(decode)
        return target.model, self.draft_exit(decode), decode

    def row_sessions(
        self,
        target,
        batch_size: int,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> RowSessions:
        """A batch drafts row by row, each row's early layers on a cache of its own
        (LayerSkipRowSession); the loop verifies the batch with the full forward."""
        args = self._session_args(target, decode)
        return RowSessions(
            [LayerSkipRowSession(*args, sampling, generator) for _ in range(batch_size)]
        )
