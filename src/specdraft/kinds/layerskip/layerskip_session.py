"""Running a Llama-style model a range of layers at a time, and LayerSkip's sessions: drafting
one sequence on the loop's own KV cache (LayerSkipSession) or a row of a batch on a cache of
its own (LayerSkipRowSession); the drafter is kinds/layerskip/layerskip.py."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from transformers import DynamicCache

from specdraft.attention import AttentionLayout, causal_masks
from specdraft.core import DraftContext, DraftTree, TargetOutput, kv_bytes
from specdraft.drafters.sessions import DraftSession
from specdraft.drafting import draft_chain
from specdraft.targets.target import (
    TargetError,
    final_logits,
    layer_rotary,
    llama_parts,
)

# --- running a Llama-style model a range of layers at a time ----------------------------------


def run_layers(
    layers,
    hidden: torch.Tensor,
    *,
    mask: Callable[[int], torch.Tensor | None],
    positions: torch.Tensor,
    rotary: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    cache=None,
    skip: Mapping[int, torch.Tensor] | None = None,
    keep: set[int] = frozenset(),
) -> dict[int, torch.Tensor]:
    """Run `layers` (an (index, layer) sequence) over hidden (batch, seq, H), layer i seeing
    the attention mask `mask(i)` and the rotary table `rotary(i)` (its own layer type's:
    sliding-window layers their window, Gemma-3's local layers their rope).

    skip: per layer index, a (batch,) bool of the samples that skip it: they do not run it (the
    others run as a sub-batch). Returns the hidden state after each layer index in `keep`, and
    under -1 the state after the last layer.
    """
    out: dict[int, torch.Tensor] = {}
    for index, layer in layers:
        skipped = None if skip is None else skip.get(index)
        layer_mask, table = mask(index), rotary(index)
        if skipped is None or not bool(skipped.any()):
            hidden = layer(
                hidden, attention_mask=layer_mask, position_ids=positions, cache=cache,
                use_cache=cache is not None, position_embeddings=table,
            )  # fmt: skip
        elif not bool(skipped.all()):  # the rows that run it, as a sub-batch
            run = (~skipped).nonzero().flatten()
            hidden = hidden.index_copy(
                0, run, _sub_layer(layer, hidden, run, layer_mask, positions, table)
            )
        elif torch.is_grad_enabled():
            # every row skips it: it still runs on one row, its output weighted by zero, so its
            # parameters take part in every process's step (DDP's gradient reduction and
            # ZeRO-3's gathering expect the same layers on every process)
            first = torch.zeros(1, dtype=torch.long, device=hidden.device)
            hidden = (
                hidden + 0 * _sub_layer(layer, hidden, first, layer_mask, positions, table).sum()
            )
        if index in keep:
            out[index] = hidden
    out[-1] = hidden
    return out


def _sub_layer(layer, hidden, rows, mask, positions, rotary) -> torch.Tensor:
    """The layer over the batch rows `rows` only (its mask, positions and rotary sliced alike)."""
    batch = hidden.shape[0]

    def rows_of(t):
        return t.index_select(0, rows) if isinstance(t, torch.Tensor) and t.shape[0] == batch else t

    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TargetError(
            f"layer dropout slices the attention mask per sample, and this attention "
            f"implementation builds a {type(mask).__name__}: load the target with "
            "attn_implementation='sdpa' or 'eager'"
        )
    return layer(
        hidden.index_select(0, rows), attention_mask=rows_of(mask), position_ids=rows_of(positions),
        position_embeddings=tuple(rows_of(t) for t in rotary),
    )  # fmt: skip


class LayerSkipSession(DraftSession):
    """One generate call's self-speculative drafting, on the loop's own KV cache (`bind_cache`).

    A proposal feeds the pending tokens and each drafted token but the last through layers
    [0, E) (their entries go into the cache's first E layers) and reads the exit-layer logits.
    `verify` then feeds the last drafted token through the same layers and runs layers [E, L)
    over every new token from the saved exit-layer states: the early layers never run twice.
    A tree this session did not draft (a copy) is verified by the loop's full forward.
    """

    capture_layers: tuple[int, ...] = ()
    drafts_on_target_cache = True

    def __init__(self, model, exit_layer: int, decode, sampling, generator) -> None:
        self.embed, self.layers, self.norm, self.rotary, _ = llama_parts(model)
        self.model, self.layout = model, AttentionLayout.of(model.config)
        self.exit = exit_layer
        self.decode, self.sampling, self.generator = decode, sampling, generator
        self.dtype = self.embed.weight.dtype
        self.cache = None
        self._tree: DraftTree | None = None
        self._states: list[torch.Tensor] = []  # exit-layer states of the fed new tokens
        self._cached = 0  # what every layer of the cache held at the last proposal

    def bind_cache(self, cache) -> None:
        self.cache = cache

    def _early(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Feed ids (1, n) at positions start.. through layers [0, E): their exit-layer states."""
        hidden = self.embed(ids)
        self._states.append(self._run(hidden, start, range(self.exit)))
        return self._states[-1]

    def _run(self, hidden: torch.Tensor, start: int, indices: range) -> torch.Tensor:
        n = hidden.shape[1]
        positions = torch.arange(start, start + n, device=hidden.device)[None]
        past = self.cache.get_seq_length(indices[0])
        masks = causal_masks(self.layout, past, n, self.dtype, hidden.device)
        return run_layers(
            [(i, self.layers[i]) for i in indices], hidden,
            mask=lambda i: self.layout.layer_mask(masks, i), positions=positions,
            rotary=layer_rotary(self.rotary, self.layout, hidden, positions),
            cache=self.cache,
        )[-1]  # fmt: skip

    def _logits(self, state: torch.Tensor) -> torch.Tensor:
        return final_logits(self.model, self.norm(state))

    def propose(self, context: DraftContext) -> DraftTree:
        # what every layer holds: the tokens the loop verified
        return self._draft(context, self.cache.get_seq_length(self.exit))

    def _draft(self, context: DraftContext, cached: int) -> DraftTree:
        """Draft after the context, the cache's early layers cropped to its first `cached`
        tokens (no early entries for tokens nothing verified)."""
        seq = context.tokens
        length = seq.shape[1]
        for layer in self.cache.layers[: self.exit]:
            extra = layer.get_seq_length() - cached
            if extra > 0:
                layer.crop(-extra)
        self._states, self._cached = [], cached
        depth = min(self.decode.gamma, context.max_depth)
        state = self._early(seq[:, cached:], cached)
        tree = draft_chain(
            self._logits(state[:, -1]),
            lambda token, i: self._logits(self._early(token, length + i)[:, -1]),
            depth=depth,
            sampling=self.sampling,
            generator=self.generator,
            stop_below=self.decode.stop_below,
        )
        self._tree = tree
        return tree

    def verify(self, tree: DraftTree, logits_to_keep: int) -> TargetOutput | None:
        """The verification forward of this session's own proposal (None for any other tree):
        logits (1, logits_to_keep, vocab) for the last pending token and each node."""
        if tree is not self._tree:
            return None
        self._tree = None
        fed = sum(s.shape[1] for s in self._states)
        if len(tree):
            self._early(tree.tokens[:, -1:], self._cached + fed)
        states = torch.cat(self._states, dim=1)
        late = range(self.exit, len(self.layers))
        final = self._run(states, self._cached, late)
        return TargetOutput(logits=self._logits(final[:, -logits_to_keep:]), cache=self.cache)

    def accept(self, tree: DraftTree, path: list[int], hidden_states=None) -> None:
        pass  # the loop compacts the shared cache

    def extra_memory_bytes(self) -> int:
        return 0  # the draft's cache entries are the target's own


class LayerSkipRowSession(LayerSkipSession):
    """One row of a batch (generate with batch > 1): the same drafting through layers [0, E),
    on a cache of its own, and verification by the loop's full forward over the batch. The
    early layers then run twice for a verified token (once drafting, once verifying) and their
    entries are held twice, where the one-sequence session shares the loop's cache; its
    drafts, and so the output, are the same."""

    drafts_on_target_cache = False

    def __init__(self, model, exit_layer: int, decode, sampling, generator) -> None:
        super().__init__(model, exit_layer, decode, sampling, generator)
        self.cache = DynamicCache()
        self._fed = torch.empty(0, dtype=torch.long)  # the tokens whose entries it holds

    def propose(self, context: DraftContext) -> DraftTree:
        seq = context.tokens[0].to(self._fed.device)
        n = min(len(seq), len(self._fed))
        same = int((seq[:n] == self._fed[:n]).long().cumprod(0).sum())  # still what was fed
        tree = self._draft(context, same)
        self._fed = torch.cat([seq, tree.tokens[0, :-1].to(seq.device)])
        return tree

    def verify(self, tree: DraftTree, logits_to_keep: int) -> None:
        return None  # the loop's full forward

    def extra_memory_bytes(self) -> int:
        return kv_bytes(self.cache)
