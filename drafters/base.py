"""The small types every drafter kind shares with the inference loop.

A drafter is an `nn.Module` holding weights only. Generation state lives in a per-call session
(`Drafter.new_session`), which the loop drives with two calls per step:

    tree = session.propose(context)        # draft a tree after the context's last token
    session.accept(tree, path, hidden)     # after the target's pass: the accepted nodes

`accept` lets a session keep its own KV cache on the accepted path without recomputing it. A chain
is a tree with one child per node, so both go through the same code. The shared types (DraftTree,
DraftContext, DecodeConfig, SamplingSettings) and drafting pieces live in specdraft/core.py.

A trainable kind is called as `drafter(batch, target_out) -> (loss_sum, metrics)`: the sum over
the micro-batch's scored tokens of each token's loss, and per logged figure a (sum, count) pair.
The count the sum is over comes from `drafter.loss_tokens(batch)`, from the batch alone, because
the trainer must know the global batch's count before its first backward: it all-reduces the
counts of every micro-batch on every process and divides, so the step's loss is exactly the mean
over the global batch's scored tokens, however it is split (as transformers' num_items_in_batch).
"""

from __future__ import annotations

import hashlib
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings


@runtime_checkable
class DraftSession(Protocol):
    """Per-call drafting state (caches, adaptive gamma); built by `Drafter.new_session`."""

    # The target hidden-state ids `accept` needs (a drafter fed by the target's features, like
    # EAGLE); empty for the others. The loop captures them in every verification forward.
    capture_layers: Sequence[int]

    def propose(self, context: DraftContext) -> DraftTree: ...

    def accept(
        self,
        tree: DraftTree,
        path: list[int],
        hidden_states: Mapping[int, torch.Tensor] | None = None,
    ) -> None:
        """Called after EVERY verification forward: the first (the prompt, with no tree), the
        ones after this session's proposals, and the ones that verified a tree some other
        drafter proposed (the copying hybrid's), so `tree` may not be this session's own.
        `path`: the accepted node indices of `tree`, root to leaf (maybe []). `hidden_states`
        (only when capture_layers is not empty): that forward's hidden states at those layers,
        each (batch, pending + n, hidden), the pending tokens first, then the tree's n nodes in
        node order.
        """
        ...

    def extra_memory_bytes(self) -> int:
        """Bytes of drafting state beyond the weights (the drafter's KV cache), now."""
        ...


class Drafter(nn.Module):
    """Base of every trained drafter kind: weights on the module, state in sessions."""

    kind: str = ""
    # The decoding settings the drafter is served with unless a caller overrides them: saved in
    # its checkpoint (`decode` section of its training config) and read back by load_drafter.
    decode: DecodeConfig = DecodeConfig()
    # Prefixes of saved weight names that only training uses (none by default; see Medusa).
    training_only_prefixes: tuple[str, ...] = ()
    # Config values of keys added since a checkpoint was written, by their meaning then:
    # load_drafter fills them in where a saved config lacks them.
    legacy_defaults: ClassVar[dict] = {}

    def new_session(
        self,
        target,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> DraftSession:
        raise NotImplementedError

    def loss_tokens(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """How many tokens the micro-batch's loss sum is over (a float scalar): by default every
        token the loss mask scores, each predicted from the position before it. A kind whose
        first prediction is further ahead (EAGLE and Medusa-1 score token t + 2 from position
        t) counts its own; a token it counts but cannot score adds 0 to the sum."""
        return batch["loss_mask"][:, 1:].sum().float()

    def ignored_settings(self, decode: DecodeConfig) -> list[str]:
        """What in `decode` this kind cannot honour, each said in a sentence (the loop warns
        once per sentence and drafts without it). Here what no kind honours; kinds add theirs."""
        if decode.lookup_gamma and not decode.lookup_ngram:
            return [
                f"lookup_gamma={decode.lookup_gamma} is ignored without copying: it caps copied "
                "drafts, and lookup_ngram=0 copies nothing (set lookup_ngram, e.g. 3)"
            ]
        return []

    def num_extra_parameters(self, target) -> int:
        """Parameters this drafter adds on top of the target (shared tensors not counted)."""
        target_params = {p.data_ptr() for p in target.model.parameters()}
        return sum(p.numel() for p in self.parameters() if p.data_ptr() not in target_params)


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


def attach_lora(target, config: LoraConfig):
    """Put trainable LoRA adapters into `target`'s model in place and return the peft model;
    the base weights stay frozen. A module name that matches nothing is a clear error."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in target.model.named_modules()}
    missing = sorted(set(config.target_modules) - present)
    if missing:
        raise ValueError(
            f"lora.target_modules {missing} match no layer of the target {target.name!r}; its "
            f"linear layers include {sorted(n for n in present if n.endswith('proj'))[:8]}"
        )
    peft_config = PeftLoraConfig(
        r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
        target_modules=list(config.target_modules), bias="none", task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(target.model, peft_config)


def adapter_hash(state: Mapping[str, torch.Tensor]) -> str:
    """A short hash of an adapter's weights (peft's saved names, fp32 values): what a target
    fine-tuned through it is told apart from its base by (the target fingerprint's `adapter`)."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].detach().float().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


# A loss's logged figures: name -> (sum, count) over the micro-batch.
Metrics = dict[str, tuple[torch.Tensor, torch.Tensor]]


def figure(values: torch.Tensor, keep: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """(sum, count) of `values` where the bool `keep` is set (all when None), detached, for a
    loss's metrics."""
    values = values.detach().float()
    if keep is None:
        return values.sum(), values.new_tensor(float(values.numel()))
    return values.where(keep, 0).sum(), keep.float().sum()


def warn_once(message: str) -> None:
    """A drafting fallback's warning (a setting ignored, full weights instead of int8), once per
    process rather than once per generate call."""
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(message, stacklevel=3)


_WARNED: set[str] = set()


def vocab_mismatch_error(what: str, drafter_vocab: int, target) -> ValueError:
    return ValueError(
        f"{what} has a vocabulary of {drafter_vocab} tokens but the target {target.name!r} has "
        f"{target.vocab_size}: speculative decoding needs the draft to share the target's "
        "tokenizer. Use a draft trained with this target's tokenizer (e.g. one distilled from it)."
    )
