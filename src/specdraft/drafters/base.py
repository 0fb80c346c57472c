"""The Drafter contract every kind implements, and the kind registry.

A drafter is an `nn.Module` holding weights only. Generation state lives in a per-call session
(`Drafter.new_session`; drafters/sessions.py holds the session contracts the loop drives). The
shared types (DraftTree, DraftContext, DecodeConfig, SamplingSettings) live in specdraft/core.py,
the drafting pieces in specdraft/drafting.py.

A trainable kind is called as `drafter(batch, target_out) -> (loss_sum, metrics)`: the sum over
the micro-batch's scored tokens of each token's loss, and per logged figure a (sum, count) pair.
The count the sum is over comes from `drafter.loss_tokens(batch)`, from the batch alone, because
the trainer must know the global batch's count before its first backward: it all-reduces the
counts of every micro-batch on every process and divides, so the step's loss is exactly the mean
over the global batch's scored tokens, however it is split (as transformers' num_items_in_batch).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import ClassVar

import torch
from torch import nn

from specdraft.core import DecodeConfig, SamplingSettings
from specdraft.drafters.served import (
    ServedDrafts,
    greedy_confidence,
)
from specdraft.drafters.sessions import BatchSession, DraftSession, OneRow, RowSessions
from specdraft.drafting import DraftVocab
from specdraft.losses import DEFAULT_CHUNK_TOKENS

# kind -> class, filled as each kind's class is defined (Drafter.__init_subclass__).
_KINDS: dict[str, type[Drafter]] = {}
_BUILTIN_IMPORTED: list[bool] = []


@dataclass(frozen=True)
class CheckpointRecord:
    """What a drafter's checkpoint folder says beside the drafter's own tensors: how the kind
    lays its weights out (set on the class), and what the folder recorded (load_drafter fills it
    in; the trainer's evaluation reads a copy with its latest held-out statistics)."""

    # The fingerprint of the target the drafter was trained against (None: unknown).
    target_fingerprint: dict | None = None
    # Its held-out statistics (`heldout_summary`'s, as saved; Medusa's per-rank accuracies,
    # which shape its tree): read by its sessions and the simulation of serving.
    heldout: Mapping = field(default_factory=dict)
    # State-dict names copied from the target: recorded in the checkpoint, not stored.
    shared_with_target: tuple[str, ...] = ()
    # Prefixes of saved weight names that only training uses (Medusa-2's adapters).
    training_only_prefixes: tuple[str, ...] = ()

    def with_heldout(self, heldout: Mapping) -> CheckpointRecord:
        return replace(self, heldout=dict(heldout))


class Drafter(nn.Module):
    """Base of every trained drafter kind: weights on the module, state in sessions.

    A kind is one class in one file: it sets `kind` (which registers it), `config_class` and the
    hooks below that it needs; every hook the trainer, checkpoint, loop, tuner and evaluation
    call is declared here with its default, so no library code asks whether a drafter has one.
    """

    kind: ClassVar[str] = ""
    # The kind's config dataclass (saved in its checkpoint; read back by load_drafter).
    config_class: ClassVar[type | None] = None
    # A display name for messages ("Medusa", "LayerSkip"); the kind itself when empty.
    title: ClassVar[str] = ""
    # What its checkpoint records beside its own tensors: the kind's layout (a class-wide
    # CheckpointRecord) with what load_drafter read from the folder.
    checkpoint: CheckpointRecord = CheckpointRecord()
    # The session's first proposal, before the target has verified the prompt, is empty: a
    # drafter fed by the target's hidden states has none yet (EAGLE, Medusa, DFlash). The
    # simulation of serving starts the same way.
    drafts_after_prefill: ClassVar[bool] = False
    # True when tree_top_k > 1 drafts a tree (where stop_below, which ends chains, is ignored);
    # False for a kind that drafts chains only (LayerSkip).
    drafts_trees: ClassVar[bool] = True
    # The kind's one session, for a prompt alone and for the rows of a batch drafted together:
    # a BatchSession class built as session_class(drafter, target, rows, sampling=, decode=,
    # generator=). None: the kind builds a single sequence's session itself (`new_session`).
    session_class: ClassVar[type[BatchSession] | None] = None
    # What `session_class` drafts together for a batch: "chains" (a tree goes row by row),
    # "all", or "none" (every batch row by row, `row_sessions`).
    batch_drafts: ClassVar[str] = "none"
    # Target hidden-state ids the loss needs (the trainer captures them in the target forward).
    capture_layers: Sequence[int] = ()
    # True when the loss runs the target itself (Medusa-2's adapters, LayerSkip): the trainer
    # then hands it no target forward while training.
    runs_target: bool = False
    # Positions whose vocabulary-wide logits the loss computes at once (specdraft/losses.py);
    # 0: all of them. The trainer sets the run's `loss_chunk_tokens`.
    loss_chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    # False: the loss computes the target's logits itself, a chunk at a time, from the target's
    # final normed state (layer L), which the trainer then captures beside `capture_layers`;
    # its training forward keeps only the last position's logits, so the target's
    # (batch, seq, vocab) logits are never made. Evaluation's forward gives them all.
    reads_target_logits: bool = True
    # The drafter is the target itself (LayerSkip): load_drafter builds it on the target given,
    # whose fingerprint must be the folder's, and a folder of it is its own target.
    uses_target_weights: ClassVar[bool] = False
    # The kind a plain Hugging Face causal LM drafts as (a two-model draft): load_drafter reads a
    # plain HF folder as it, and generate wraps a PreTrainedModel in it.
    wraps_hf_models: ClassVar[bool] = False
    # The kind's decoding settings: DecodeConfig, or the kind's subclass of it holding the
    # settings only it takes (LayerSkip's exit layer, Medusa's acceptance rule). Another kind's
    # setting is an error naming its owner (DecodeConfig.of).
    decode_class: ClassVar[type[DecodeConfig]] = DecodeConfig

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if not kind:
            return
        known = _KINDS.get(kind)
        if known is not None and (known.__module__, known.__qualname__) != (
            cls.__module__,
            cls.__qualname__,
        ):
            raise TypeError(
                f"drafter kind {kind!r} is already {known.__module__}.{known.__qualname__}; "
                f"give {cls.__qualname__} a kind of its own"
            )
        _KINDS[kind] = cls

    # -- building and saving ------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, config, target, hf_model) -> Drafter:
        """Rebuild the module from its saved config (load_drafter then loads the weights);
        hf_model is the loaded HF model for a kind saved as one (`as_hf_model`), else None."""
        raise NotImplementedError(f"the {cls.kind} drafter cannot be loaded from a checkpoint")

    def as_hf_model(self):
        """The plain Hugging Face causal LM this drafter is (a two-model draft), or None. Its
        checkpoint is then that model's own folder, and transformers' assisted generation can
        run it as `assistant_model`."""
        return None

    def model_to_save(self):
        """The HF model written as the checkpoint folder (default: `as_hf_model`); None: the
        drafter's own tensors go to model.safetensors."""
        return self.as_hf_model()

    def write_extra(self, folder) -> None:
        """Write the kind's own files into a checkpoint folder being saved (Medusa-2's
        adapter); nothing by default."""

    def trained_fingerprint(self, target) -> dict:
        """The fingerprint saved with the drafter: the target's, or the fine-tuned target's
        for a kind that fine-tunes it (its adapter named)."""
        return target.fingerprint

    # -- training -----------------------------------------------------------------------------

    def forward(self, batch: Mapping[str, torch.Tensor], target_out):
        """The loss (DDP needs the forward to be it)."""
        return self.loss(batch, target_out)

    def loss(self, batch: Mapping[str, torch.Tensor], target_out) -> tuple[torch.Tensor, Metrics]:
        """(the sum over the micro-batch's scored tokens of each token's loss, metrics: name
        -> (sum, count)); `target_out` is the target's forward with `capture_layers`, or None
        when `runs_target`."""
        raise NotImplementedError(f"the {self.kind} drafter does not train")

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """How many tokens the micro-batch's loss sum is over (a float scalar): by default every
        token the loss mask scores, each predicted from the position before it. A kind whose
        first prediction is further ahead (EAGLE and Medusa-1 score token t + 2 from position
        t) counts its own; a token it counts but cannot score adds 0 to the sum."""
        return batch["loss_mask"][:, 1:].sum().float()

    def acceptance(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per draft depth 1..decode.gamma: (acceptance alpha summed, greedy agreement summed,
        count), on held-out data, for the simulated tau of training's evaluation; alpha at
        temperature 1 (sum_x min(p(x), q(x)) of the softmaxed logits)."""
        raise NotImplementedError(f"the {self.kind} drafter has no simulated acceptance")

    def served_logits(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> torch.Tensor | None:
        """(batch, seq, D, draft vocab), D <= decode.gamma: the logits a chain session draws
        from after every position of the batch, through the training path (the modules the
        loss runs, teacher-forced): [b, c, i] depth i + 1's after a context ending at c whose
        depths before it agreed with the batch. Or (batch, seq, vocab) for a model that drafts
        from its own next-token logits at each position, depth i + 1's after c being its
        logits at c + i (the two-model draft, LayerSkip's early exit), which spares a copy
        per depth of the whole vocabulary. None where this kind or `decode` has no such chain
        (the default; a dynamic gamma)."""
        return None

    def served_tree_drafts(
        self, batch: Mapping[str, torch.Tensor], target_out, decode: DecodeConfig
    ) -> ServedDrafts | None:
        """`served.served_drafts` for the tree `decode` serves: None by default (no simulation);
        a kind that simulates its trees (Medusa's, from the accuracies it carries) returns
        what greedy serving drafts after every position."""
        return None

    def chain_confidence(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        logits: torch.Tensor,
        decode: DecodeConfig,
    ) -> torch.Tensor:
        """(logits' shape but vocab) bool: whether a chain drafted from `served_logits`'
        `logits` (as the session processes them) goes on after each of its positions under
        decode.stop_below: by default its top probability is at least stop_below, as
        drafting.draft_chain decides; a kind with a rule of its own (DSpark's confidence head)
        overrides this."""
        return greedy_confidence(logits, decode.stop_below)

    def sampled_tree_reach(
        self,
        batch: Mapping[str, torch.Tensor],
        target_out,
        decode: DecodeConfig,
        temperature: float,
    ) -> torch.Tensor | None:
        """`served.sampled_reach` for the tree `decode` serves: None by default (no walk); a
        kind whose session samples position trees returns position_tree.tree_reach's."""
        return None

    def draft_vocab(self) -> DraftVocab | None:
        """The reduced vocabulary the kind drafts over (drafting.DraftVocab: its ids as the
        target's and back), for its sessions and the simulation of serving; None where it
        drafts over the target's vocabulary (the default)."""
        return None

    def prepare_batch(self, batch: dict, target, generator, shared) -> dict:
        """A training batch before its loss: swap data (on-policy) or draw per-sample randomness
        (`batch["example_index"]` holds each row's index in the training set); as it is here."""
        return batch

    def begin_step(self, step: int, max_steps: int) -> None:
        """Told the step before each one (a schedule inside the loss); nothing by default."""

    def param_groups(self) -> list[dict]:
        """The optimizer's groups, each may carry an lr_scale and a start_step."""
        return [{"params": list(self.parameters())}]

    def eval_statistics(self, batch: Mapping[str, torch.Tensor], target_out) -> dict:
        """Held-out sums (name -> tensor) the kind keeps from evaluation; none by default."""
        return {}

    def heldout_summary(self, sums: Mapping[str, torch.Tensor]) -> dict:
        """What the reduced `eval_statistics` of one evaluation leave for the checkpoint, in
        plain JSON values: the trainer saves the latest with every checkpoint
        (`save_drafter(heldout=...)`) and load_drafter hands it back as `heldout`. Nothing is
        written on the module; none by default."""
        return {}

    # -- decoding -----------------------------------------------------------------------------

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> DraftSession:
        """One sequence's drafting: `session_class`'s session of one row, driven as a
        DraftSession (`OneRow`); a kind without one builds its own."""
        if self.session_class is None:
            raise NotImplementedError(f"{type(self).__name__} names no session_class")
        return OneRow(
            self.session_class(self, target, 1, sampling=sampling, decode=decode,
                               generator=generator)
        )  # fmt: skip

    def new_batch_session(
        self,
        target,
        batch_size: int,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> BatchSession:
        """The drafting of a batch of `batch_size` sequences (generate with batch > 1): the
        kind's `session_class` where it drafts the rows together for `decode`
        (`drafts_batches_together`), else row by row (`row_sessions`). The one rule for every
        kind; a kind says what its session drafts together (`batch_drafts`)."""
        if not self.drafts_batches_together(decode):
            return self.row_sessions(
                target, batch_size, sampling=sampling, decode=decode, generator=generator
            )
        return self.session_class(
            self, target, batch_size, sampling=sampling, decode=decode, generator=generator
        )

    def drafts_batches_together(self, decode: DecodeConfig) -> bool:
        """Whether `new_batch_session` drafts the rows together for `decode` (one pass for the
        batch), unlike `row_sessions`: where it does not, batch_drafting changes nothing."""
        return self.batch_drafts == "all" or (self.batch_drafts == "chains" and decode.chain)

    def row_sessions(
        self,
        target,
        batch_size: int,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> RowSessions:
        """A batch drafted row by row (decode.batch_drafting=rows, or a kind with no batch
        session): one `new_session` per row by default."""
        sessions = [
            self.new_session(target, sampling=sampling, decode=decode, generator=generator)
            for _ in range(batch_size)
        ]
        return RowSessions(sessions)

    @classmethod
    def decode_settings(
        cls, settings: DecodeConfig | Mapping | None = None, **changes: object
    ) -> DecodeConfig:
        """`settings` (any kind's, a saved dict, or None for the defaults) with `changes` (None
        values ignored) as this kind's decode_class; ValueError naming another kind's setting
        that is on, its owner and this kind."""
        who = f"this {cls.title or cls.kind} drafter"
        decode = cls.decode_class.of(settings, who=who)
        values = {k: getattr(decode, k) for k in decode.setting_names()}
        values.update({k: v for k, v in changes.items() if v is not None})
        return cls.decode_class.of(values, who=who)

    def check_decode(self, decode: DecodeConfig) -> None:
        """Raise ValueError for a decoding setting out of this drafter's range (LayerSkip: an
        exit outside the target). Settings it only ignores are `ignored_settings`'."""

    def resolved_decode(self, decode: DecodeConfig) -> DecodeConfig:
        """`decode` with what "the drafter's own" stands for filled in (LayerSkip's exit_layer
        0: the trained exit), so tuning races and saves a value, not a placeholder."""
        return decode

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        """What in `decode` this kind cannot honour, each said in a sentence (the loop warns
        once per sentence and drafts without it). Here what no kind honours, and stop_below in
        the trees of a kind that drafts them (`drafts_trees`); kinds add theirs."""
        ignored = []
        if decode.lookup_gamma and not decode.lookup_ngram:
            ignored.append(
                f"lookup_gamma={decode.lookup_gamma} is ignored without copying: it caps copied "
                "drafts, and lookup_ngram=0 copies nothing (set lookup_ngram, e.g. 3)"
            )
        if not self.drafts_trees and not decode.chain:
            ignored.append(
                f"tree_top_k={decode.tree_top_k} is ignored by {self.title or self.kind}: it "
                "drafts chains"
            )
        if self.drafts_trees and not decode.chain and decode.stop_below > 0:
            ignored.append(
                f"stop_below is ignored by {self.title or self.kind} trees (tree_top_k > 1): it "
                "ends chains"
            )
        cap = self.depth_cap()
        if cap is not None and decode.gamma > cap[0]:
            ignored.append(
                f"gamma={decode.gamma} is capped at {cap[0]} by this {self.title or self.kind} "
                f"drafter: {cap[1]}"
            )
        return ignored

    def depth_cap(self) -> tuple[int, str] | None:
        """The deepest a draft of this drafter can be, and why (a kind whose one pass drafts a
        fixed number of positions: P-EAGLE, DFlash, Medusa); None: as deep as gamma asks. A
        deeper gamma is capped, said once by `ignored_settings`."""
        return None

    def transformers_baseline(self, decode: DecodeConfig) -> tuple[str, dict, dict] | None:
        """transformers' assisted generation doing what this drafter does with `decode`, for
        evaluation to measure beside it: (the baseline's name, generation-config values set on
        the target for each call, generate() keyword arguments), or None where it has none."""
        return None

    def search_space(self, target) -> dict[str, list]:
        """Values of this kind's own settings that tuning tries (LayerSkip: every exit)."""
        return {}

    @classmethod
    def served_agreement(
        cls, decode: Mapping, alphas: Sequence[float], measured: Mapping | None
    ) -> list[float]:
        """The greedy agreement per draft depth that training predicts for decoding with
        `decode` (settings as a dict, perhaps tuned away from those saved): by default `alphas`,
        the last evaluation's. A kind whose own setting changes what drafts (LayerSkip's exit
        layer) reads `measured`, what its run measured after training for each value of it
        (target_quality.json; None where there is none)."""
        return list(alphas)

    def predicted_tree_tau(self, decode: DecodeConfig) -> float | None:
        """Training's prediction of the greedy tau of the tree `decode` serves (tree_top_k > 1),
        from what its evaluation measured and saved with the drafter (Medusa: the tree's
        expected accepted length under its heads' accuracies); None where training predicts a
        chain's tau only, which is the default."""
        return None

    @classmethod
    def sharding_problem(cls, config) -> str | None:
        """Why this kind cannot train with the target sharded (target_sharding) under `config`
        (its drafter config), or None when it can: the target must be frozen."""
        return None

    @classmethod
    def packing_problem(cls, config) -> str | None:
        """Why this kind cannot train on packed rows (data.pack) under `config` (its drafter
        config), or None when it can: its loss keeps each document of a row to itself."""
        return None

    def num_extra_parameters(self, target) -> int:
        """Parameters this drafter adds on top of the target (shared tensors not counted)."""
        target_params = {p.data_ptr() for p in target.model.parameters()}
        return sum(p.numel() for p in self.parameters() if p.data_ptr() not in target_params)


def drafter_kinds() -> dict[str, type[Drafter]]:
    """Every registered kind, the built-in ones imported first: the drafter module of each folder
    of specdraft/kinds (kinds/KIND/KIND.py) and the loop's own prompt lookup. Each registers
    itself when its module is imported, so a kind defined anywhere else counts once it is."""
    if not _BUILTIN_IMPORTED:
        import importlib
        import pkgutil

        import specdraft.kinds as kinds

        importlib.import_module("specdraft.drafters.prompt_lookup")
        for folder in pkgutil.iter_modules(kinds.__path__):
            if folder.ispkg:
                importlib.import_module(f"{kinds.__name__}.{folder.name}.{folder.name}")
        _BUILTIN_IMPORTED.append(True)
    return dict(_KINDS)


def drafter_class(kind: str) -> type[Drafter]:
    """The class of a registered drafter kind; KeyError naming the known ones otherwise."""
    kinds = drafter_kinds()
    if kind not in kinds:
        raise KeyError(f"unknown drafter kind {kind!r}; known kinds: {', '.join(sorted(kinds))}")
    return kinds[kind]


def kinds_own_settings() -> list[str]:
    """The decoding settings some registered kind takes alone (its decode_class's own keys)."""
    return sorted(
        {k for cls in drafter_kinds().values() for k in cls.decode_class.own_setting_names()}
    )


def hf_model_kind() -> type[Drafter]:
    """The kind a plain Hugging Face causal LM drafts as (`wraps_hf_models`)."""
    found = [cls for cls in drafter_kinds().values() if cls.wraps_hf_models]
    if len(found) != 1:
        raise RuntimeError(f"exactly one drafter kind must wrap HF models; found {found}")
    return found[0]


@dataclass
class LoraConfig:
    """LoRA adapters (peft) on the target, for the kinds that fine-tune it (Medusa-2, LayerSkip).
    The target's own weights stay frozen; only the adapters train."""

    # Rank r of every adapter; 0: no adapters, the target stays frozen.
    rank: int = 0
    # Scale alpha: an adapter adds (alpha / r) * B A x.
    alpha: float = 16.0
    # Dropout on an adapter's input while training.
    dropout: float = 0.05
    # The target's linear layers that get an adapter (module names, as peft matches them).
    target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"lora.rank must be an integer >= 0 (0: off); got {self.rank!r}")
        if not self.alpha > 0:
            raise ValueError(f"lora.alpha must be > 0; got {self.alpha}")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"lora.dropout must be in [0, 1); got {self.dropout}")
        if self.rank and not self.target_modules:
            raise ValueError("lora.target_modules is empty: name the layers that get adapters")


# A loss's logged figures: name -> (sum, count) over the micro-batch.
Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]


def sum_and_count(
    values: torch.Tensor, keep: torch.Tensor | None = None
) -> tuple[torch.Tensor, ...]:
    """(sum, count) of `values` where the bool `keep` is set (all when None), detached, for a
    loss's metrics."""
    values = values.detach().float()
    if keep is None:
        return values.sum(), values.new_tensor(float(values.numel()))
    return values.where(keep, 0).sum(), keep.float().sum()


class DraftingWarning(UserWarning):
    """A drafting fallback: a setting the drafter ignores, full weights instead of int8."""


def warn_once(message: str) -> None:
    """Warn of a drafting fallback. Python's default warning filter shows each message once per
    place it is raised from (the loop's start, for these), so a script that calls generate per
    prompt hears it once; its own filters (`-W`, `warnings.simplefilter`) decide otherwise."""
    warnings.warn(message, DraftingWarning, stacklevel=3)


def vocab_mismatch_error(what: str, drafter_vocab: int, target) -> ValueError:
    return ValueError(
        f"{what} has a vocabulary of {drafter_vocab} tokens but the target {target.name!r} has "
        f"{target.vocab_size}: speculative decoding needs the draft to share the target's "
        "tokenizer. Use a draft trained with this target's tokenizer (e.g. one distilled from it)."
    )
