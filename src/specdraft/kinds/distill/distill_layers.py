"""The two-model draft's student run for drafting: drafters/lean.py's layers stacked into a
whole small causal LM (`LeanModel`, maybe with int8 weights), and the same interface around the
student's own modules (`ModuleModel`) for the layouts lean does not reproduce and for trees."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdraft.batch import CacheColumns
from specdraft.drafters.lean import (
    DraftLinear,
    LayerWeights,
    LeanLayer,
    is_llama_rms_norm,
    lean_supported,
    rms,
)


def lean_model_supported(model: nn.Module) -> bool:
    """True when `model` is an HF causal LM whose every decoder layer `lean_supported` admits,
    with a Llama RMSNorm before a bias-free LM head and a plain embedding: LeanModel runs it."""
    base = getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    rotary, norm = getattr(base, "rotary_emb", None), getattr(base, "norm", None)
    if layers is None or rotary is None or norm is None or not is_llama_rms_norm(norm):
        return False
    head = model.get_output_embeddings()
    return (
        isinstance(model.get_input_embeddings(), nn.Embedding)
        and isinstance(head, nn.Linear)
        and head.bias is None
        and all(lean_supported(layer, rotary) for layer in layers)
    )


class ModelWeights:
    """A causal LM's weights as LeanModel runs them: each layer's LayerWeights, and the LM head
    with the final norm's weight folded in (int8 copies when asked)."""

    @torch.no_grad()
    def __init__(self, model: nn.Module, *, int8: bool = False) -> None:
        base = model.model
        self.embed = model.get_input_embeddings().weight.detach()
        self.rotary = base.rotary_emb
        self.layers = [LayerWeights(layer, int8=int8) for layer in base.layers]
        self.eps = base.norm.variance_epsilon
        head = model.get_output_embeddings()
        self.output = DraftLinear(head.weight, in_scale=base.norm.weight, int8=int8)

    def memory_bytes(self) -> int:
        """Bytes held beyond the model's own parameters (fused, folded and int8 copies)."""
        return sum(w.memory_bytes() for w in self.layers) + self.output.memory_bytes()


class LeanModel:
    """A small causal LM run for drafting: LeanLayers with in-place KV caches for `rows`
    sequences, called with new token ids and returns each row's last position's logits. The
    layers' columns move together (`crop`, `gather`, `select_rows`: specdraft/batch.py's
    BatchCache drives them for a batch whose rows hold different tokens)."""

    def __init__(self, weights: ModelWeights, capacity: int = 256, rows: int = 1) -> None:
        self.w = weights
        self.layers = [LeanLayer(w, weights.rotary, capacity, rows) for w in weights.layers]

    @property
    def length(self) -> int:
        return self.layers[0].length

    def crop(self, length: int) -> None:
        for layer in self.layers:
            layer.crop(length)

    def gather(self, index: torch.Tensor, start: int) -> None:
        for layer in self.layers:
            layer.gather(index, start)

    def select_rows(self, index: torch.Tensor) -> None:
        for layer in self.layers:
            layer.select_rows(index)

    def memory_bytes(self) -> int:
        """The KV buffers (the weights are accounted by ModelWeights)."""
        return sum(layer.memory_bytes() for layer in self.layers)

    @torch.no_grad()
    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        every: bool = False,
    ) -> torch.Tensor:
        """(rows, n) token ids -> (rows, vocab) logits after the last of them ((rows, n, vocab)
        after each with `every`). positions and visible as LeanLayer takes them; None:
        consecutive from the cache's length, causally after every column."""
        x = F.embedding(ids, self.w.embed)
        where = self.length if positions is None else positions
        for layer in self.layers:
            x = layer(x, where, visible)
        return self.w.output(rms(x if every else x[:, -1], self.w.eps))


class ModuleModel(CacheColumns):
    """LeanModel's interface around a causal LM's own modules and a DynamicCache whose every
    layer keeps every key (a sliding layer's window is then the mask's): for students
    drafters/lean.py does not reproduce, and for trees."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(DynamicCache())
        self.model = model

    @torch.no_grad()
    def __call__(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor | None = None,
        visible: torch.Tensor | None = None,
        every: bool = False,
    ) -> torch.Tensor:
        """LeanModel's call; `visible` the attention mask the model takes when given (a float
        (rows, 1, n, columns) mask, or attention.py's per-layer masks for a sliding model)."""
        out = self.model(
            input_ids=ids, attention_mask=visible, position_ids=positions, cache=self.cache,
            use_cache=True, logits_to_keep=0 if every else 1,
        )  # fmt: skip
        return out.logits if every else out.logits[:, -1]
