"""One decoder layer run for drafting: few kernel calls and a KV cache written in place.

A drafter that runs one layer per drafted token (an EAGLE head) is a small-matrix, one-token
workload: on a CPU every weight streams from cache memory once per token and each of the ~60
framework calls around the products costs microseconds. `LeanLayer` runs the same layer from
the same weights with one fused q/k/v product, one fused gate/up product, the RMSNorm weights
folded into the products after them, a rotary table computed once, and preallocated key/value
buffers that a rejected draft leaves by moving a length instead of copying the cache. With
`DraftLinear`'s int8 weights the products read a quarter of the bytes, which is what pays on a
CPU. `benchmarks/bench_head_cost.py` times a head pass through the HF modules, lean in fp32 and
lean with int8 weights, side by side (its figures for the current demo target are still to be
recorded in BENCHMARKS.md).

It covers Llama, Qwen2 (q/k/v biases), Qwen3 (per-head q/k norms) and Mistral without a sliding
window, and EAGLE's reference layers (kinds/eagle/eagle.py: EAGLE-3's, fed cat(embedding, feature)
and norming each half, and EAGLE-1's without an input norm), with static rotary types; every
RMSNorm is Llama's exact one, computed in float32, so in fp32 drafting computes what the modules
compute: `decode_layer(layer, rotary)` returns a `LeanLayer` for those
(`lean_supported`), else a `ModuleLayer` that calls the layer itself with a DynamicCache behind
the same interface, so another family is slower, never wrong. int8 weights need a CPU and
inputs in 16-wide blocks; elsewhere DraftLinear keeps full weights. tests/drafters/test_lean.py
checks that both give the module's own outputs.

`LayerWeights` reads the weights when it is built: build it again after they change (EAGLE heads
key theirs on the parameters' versions, see EagleDrafter.drafting_weights).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specdraft.batch import CacheColumns
from specdraft.core import float_mask
from specdraft.drafters.base import warn_once

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_QK_NORMS = {"q_norm", "k_norm"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


# Families whose decoder layer LeanLayer reproduces. Others share the layout but not the maths
# (Granite scales residual branches, Ernie 4.5 and Helium rotate interleaved pairs, Gemma's norm
# scales by 1 + weight), so the layout alone is not enough.
LEAN_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
# Rotary types whose table depends on the position only; dynamic and longrope change with the
# sequence length, which a table computed once cannot follow.
_STATIC_ROPE = {"default", "linear", "llama3", "yarn"}


def lean_supported(layer: nn.Module, rotary: nn.Module | None = None) -> bool:
    """True when `layer` is a decoder layer of LEAN_FAMILIES with exactly the Llama layout, no
    sliding window, and (when given) a rotary module of a static type that rotates each
    (i, i + head_dim / 2) pair by one angle (probed at two positions)."""
    module = type(layer).__module__
    llama_maths = getattr(type(layer), "lean_family", None) == "llama"  # EAGLE-3's layer
    if not llama_maths and not any(
        module == f"transformers.models.{f}.modeling_{f}" for f in LEAN_FAMILIES
    ):
        return False
    if rotary is not None and getattr(rotary, "rope_type", "default") not in _STATIC_ROPE:
        return False
    if rotary is not None:
        try:  # one angle per (i, i + head_dim / 2) pair, as LeanLayer rotates them
            rotary_table(rotary, 2, next(rotary.buffers(), torch.empty(0)).device)
        except ValueError:
            return False
    children = {name for name, _ in layer.named_children()}
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if children != _LAYER_PARTS | ({"hidden_norm"} if _two_inputs(layer) else set()):
        return False
    if attn is None or mlp is None:
        return False
    attn_parts = {name for name, _ in attn.named_children()}
    if not (_ATTN_PARTS <= attn_parts <= _ATTN_PARTS | _QK_NORMS):
        return False
    if {name for name, _ in mlp.named_children()} | {"act_fn"} != _MLP_PARTS:
        return False
    config = getattr(attn, "config", None)
    if getattr(attn, "sliding_window", None) or getattr(config, "sliding_window", None):
        return False  # Mistral's default window: LeanLayer has no windowed mask
    if hasattr(layer, "residual_multiplier") or getattr(config, "residual_multiplier", 1.0) != 1:
        return False
    norms = [layer.post_attention_layernorm]
    norms += [getattr(attn, n) for n in _QK_NORMS if n in attn_parts]
    if _two_inputs(layer):
        norms.append(layer.hidden_norm)
    if not isinstance(layer.input_layernorm, nn.Identity):  # the reference EAGLE-1 layer's is
        norms.append(layer.input_layernorm)
    return all(is_llama_rms_norm(n) for n in norms)


def _two_inputs(layer: nn.Module) -> bool:
    """A layer fed cat(embedding, feature), normed apart (EAGLE-3's reference layer)."""
    return getattr(layer, "two_inputs", False) is True


def is_llama_rms_norm(norm: nn.Module) -> bool:
    name = type(norm).__name__
    return (
        name.endswith("RMSNorm")
        and not name.startswith("Gemma")
        and hasattr(norm, "variance_epsilon")
        and getattr(norm, "weight", None) is not None
    )


def decode_layer(
    layer: nn.Module,
    rotary: nn.Module,
    capacity: int = 256,
    *,
    weights: LayerWeights | None = None,
    rows: int = 1,
):
    """A `LeanLayer` for `rows` sequences where `lean_supported(layer, rotary)` (from `weights`
    when given, built from the layer otherwise), else a `ModuleLayer` around the layer itself."""
    if lean_supported(layer, rotary):
        return LeanLayer(weights or LayerWeights(layer), rotary, capacity, rows)
    return ModuleLayer(layer, rotary)


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm without its weight (folded into the next product): x / sqrt(mean(x^2) +
    eps) computed in float32 and returned in x's dtype, as LlamaRMSNorm computes it before its
    weight, so drafting computes what the head's modules compute."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), eps=eps)
    return F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class DraftLinear:
    """y = x W^T + b for drafting, W either as given ("full") or as int8 with one scale per
    output row ("int8"; the product runs in bf16 through torch's weight-only int8 kernel).

    `in_scale` (in_features,) is folded into W's columns: a preceding RMSNorm's weight, so the
    norm itself costs no multiply. On a CPU a drafting step streams every weight once per token,
    so int8 weights cut the bytes a head's matrix products read 4x (benchmarks/bench_head_cost.py
    measures what that buys in time); the draft changes slightly and verification keeps the
    output exact.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
        *,
        in_scale: torch.Tensor | None = None,
        int8: bool = False,
    ) -> None:
        with torch.no_grad():
            w = weight.detach()
            # a parameter used as it is costs no memory; folded, fused or int8 weights are copies
            self.shared = isinstance(weight, nn.Parameter) and in_scale is None and not int8
            if in_scale is not None:
                w = w * in_scale.detach().to(w.dtype)[None, :]
            self.bias = None if bias is None else bias.detach()
            self.dtype = w.dtype
            # the int8 kernel wants whole 16-wide blocks of inputs; other widths keep full weights
            self.int8 = int8 and int8_supported(w.device) and w.shape[1] % 16 == 0
            if self.int8:
                wf = w.float()
                # the scale the kernel multiplies by is bf16: quantise against that same value
                scale = (wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0).bfloat16()  # (out,)
                q = torch.round(wf / scale.float()[:, None]).clamp(-127, 127)
                self.weight, self.scale = q.to(torch.int8).contiguous(), scale
                # added in the product's dtype, which stays bf16: a large bias (Qwen2's q/k)
                # loses ~|b| / 512 absolutely, like the product itself; only drafts change
                if self.bias is not None:
                    self.bias = self.bias.to(torch.bfloat16)
            else:
                self.weight = w if in_scale is None else w.contiguous()
        self.out_features = self.weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """(..., in) -> (..., out), in the product's dtype: the weights' for full weights, bf16
        for int8 (callers add it to fp32 or convert it; a conversion is a call of its own)."""
        if not self.int8:
            return F.linear(x.to(self.dtype), self.weight, self.bias)
        shape = x.shape
        y = torch.ops.aten._weight_int8pack_mm(
            x.reshape(-1, shape[-1]).to(torch.bfloat16).contiguous(), self.weight, self.scale
        )
        y = y.view(*shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias

    def memory_bytes(self) -> int:
        """Bytes held beyond the parameters it was built from (0 when it uses one as it is)."""
        if self.shared:
            return 0
        extra = 0 if not self.int8 else self.scale.numel() * self.scale.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


def int8_supported(device: torch.device) -> bool:
    """Whether DraftLinear's int8 path runs on `device` (CPU builds of torch >= 2.3)."""
    return device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int8pack_mm")


def use_int8(draft_weights: str, device: torch.device, who: str) -> bool:
    """Whether drafting should run int8 copies: asked for (`draft_weights`) and possible on
    `device`; asked for elsewhere, one warning says `who` drafts with full weights instead."""
    if draft_weights != "int8":
        return False
    if not int8_supported(device):
        warn_once(f"draft_weights=int8 runs on CPU only; drafting on {device} with {who}")
        return False
    return True


class LayerWeights:
    """A Llama-layout layer's weights as LeanLayer runs them: q/k/v fused and gate/up fused, the
    RMSNorm weights folded into the products after them, int8 copies when asked. Built once per
    set of weights (see EagleDrafter.drafting_weights) and shared by every decoding call."""

    @torch.no_grad()
    def __init__(self, layer: nn.Module, *, int8: bool = False) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        weight = attn.q_proj.weight
        self.device, self.dtype = weight.device, weight.dtype
        self.head_dim = int(attn.head_dim)
        self.q_size = attn.q_proj.out_features
        self.kv_size = attn.k_proj.out_features
        self.num_heads = self.q_size // self.head_dim
        self.num_kv_heads = self.kv_size // self.head_dim
        self.scaling = float(attn.scaling)
        projections = (attn.q_proj, attn.k_proj, attn.v_proj)
        norm_in, post = layer.input_layernorm, layer.post_attention_layernorm
        # the input's norms: Llama's one; none (the reference EAGLE-1 layer); or EAGLE-3's
        # reference layer, fed cat(embedding, feature) and norming each half with its own weight
        self.eps_in = None if isinstance(norm_in, nn.Identity) else norm_in.variance_epsilon
        self.split = self.eps_hidden = self.hidden_weight = None
        in_scale = None if self.eps_in is None else norm_in.weight
        if _two_inputs(layer):
            self.split = norm_in.weight.shape[0]  # where the feature starts in the input
            self.eps_hidden = layer.hidden_norm.variance_epsilon
            in_scale = torch.cat([norm_in.weight, layer.hidden_norm.weight])
            if layer.norm_before_residual:  # the residual is the normed feature, weight and all
                self.hidden_weight = layer.hidden_norm.weight.detach()
        # q and k rows reordered so that each head's rotary pairs (i, i + head_dim / 2) sit side
        # by side: LeanLayer then rotates q and k with one complex multiply. q.k is a sum over
        # the head dims, so the same reordering of q and k leaves attention unchanged.
        half = self.head_dim // 2
        self.pair_order = torch.stack([torch.arange(half), torch.arange(half) + half], 1).flatten()
        heads = (self.q_size + self.kv_size) // self.head_dim
        rows = (torch.arange(heads)[:, None] * self.head_dim + self.pair_order).flatten()
        rows = torch.cat([rows, torch.arange(self.kv_size) + self.q_size + self.kv_size])
        bias = _fused_bias(projections)
        self.qkv = DraftLinear(
            torch.cat([p.weight for p in projections])[rows.to(self.device)],
            None if bias is None else bias[rows.to(self.device)],
            in_scale=in_scale, int8=int8,
        )  # fmt: skip
        self.o = DraftLinear(attn.o_proj.weight, attn.o_proj.bias, int8=int8)
        gate, up = mlp.gate_proj, mlp.up_proj
        self.gate_up = DraftLinear(
            torch.cat([gate.weight, up.weight]), _fused_bias((gate, up)),
            in_scale=post.weight, int8=int8,
        )  # fmt: skip
        self.down = DraftLinear(mlp.down_proj.weight, mlp.down_proj.bias, int8=int8)
        self.act = mlp.act_fn
        self.intermediate = gate.out_features
        self.eps_post = post.variance_epsilon
        self.q_norm = _norm_params(getattr(attn, "q_norm", None), self.pair_order)
        self.k_norm = _norm_params(getattr(attn, "k_norm", None), self.pair_order)

    def memory_bytes(self) -> int:
        """Bytes held beyond the module's own parameters (the fused and int8 copies)."""
        return sum(lin.memory_bytes() for lin in (self.qkv, self.o, self.gate_up, self.down))


class LeanLayer:
    """A Llama-layout decoder layer with its own in-place KV cache for `rows` sequences.

    Call it with (rows, n, hidden) inputs ((rows, n, 2 hidden) for EAGLE-3's reference layer),
    their position ids and which cached entries each may see; it appends the n new keys/values
    of every row after the `length` columns already held and returns the layer's (rows, n,
    hidden) output. `crop(m)` keeps the first m columns; `gather` and `select_rows` move columns
    and rows as specdraft/batch.py's BatchCache asks, so rows of a batch that hold different
    tokens share the buffers.
    """

    def __init__(
        self, weights: LayerWeights, rotary: nn.Module, capacity: int = 256, rows: int = 1
    ) -> None:
        self.w = weights
        self.device, self.dtype = weights.device, weights.dtype
        self.num_kv_heads, self.head_dim = weights.num_kv_heads, weights.head_dim
        self.rotary = rotary
        self.rows = rows
        self.length = 0
        self.keys = self.values = self._rot = None
        self._grow(max(1, capacity))

    # -- storage --------------------------------------------------------------------------------

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` entries (keys, values and rotary rows); keeps what is held."""
        shape = (self.rows, self.num_kv_heads, capacity, self.head_dim)
        keys = torch.empty(shape, device=self.device, dtype=self.dtype)
        values = torch.empty(shape, device=self.device, dtype=self.dtype)
        if self.keys is not None:
            keys[:, :, : self.length] = self.keys[:, :, : self.length]
            values[:, :, : self.length] = self.values[:, :, : self.length]
        self.keys, self.values = keys, values
        # the rotary table for positions 0 .. capacity - 1, from the model's own rotary module
        # (so any rope scaling it implements is honoured), as e^(i angle) per rotary pair
        self._rot = rotary_table(self.rotary, capacity, self.device)  # (capacity, hd / 2)

    @property
    def capacity(self) -> int:
        return self.keys.shape[2]

    def crop(self, length: int) -> None:
        """Keep the first `length` cached columns."""
        self.length = min(self.length, length)

    def gather(self, index: torch.Tensor, start: int) -> None:
        """Columns [start, length) replaced by, for each row r, the columns start + index[r]
        (index (rows, w)): BatchCache's `keep` and `compact`."""
        width = index.shape[1]
        index = index[:, None, :, None].expand(self.rows, self.num_kv_heads, width, self.head_dim)
        for buffer in (self.keys, self.values):
            picked = buffer[:, :, start : self.length].gather(2, index)
            buffer[:, :, start : start + width] = picked
        self.length = start + width

    def select_rows(self, index: torch.Tensor) -> None:
        """Only the rows `index` stay (rows that finished leave the batch)."""
        self.keys = self.keys.index_select(0, index)
        self.values = self.values.index_select(0, index)
        self.rows = index.numel()

    def memory_bytes(self) -> int:
        """The KV buffers (the weights are accounted by LayerWeights)."""
        return 2 * self.keys.numel() * self.keys.element_size()

    # -- forward --------------------------------------------------------------------------------

    @torch.no_grad()
    def __call__(
        self,
        x: torch.Tensor,
        positions: int | list[int] | torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(rows, n, hidden) -> (rows, n, hidden).

        positions: the n position ids of every row (an int: consecutive from it), or (rows, n)
        per row. visible: True (or 0.0 in a float mask) where a new entry may attend to a
        column, (n, length + n) for every row alike or (rows, n, length + n) / (rows, 1, n,
        length + n) per row; None: every new entry sees every column and the new entries
        causally (one entry: everything).
        """
        rows, n = x.shape[:2]
        start, end = self.length, self.length + n
        if isinstance(positions, int):
            top = positions + n
        else:
            positions = torch.as_tensor(positions, device=self.device)
            if positions.shape[-1] != n:
                raise ValueError(f"position ids of shape {tuple(positions.shape)} for {n} inputs")
            top = int(positions.max()) + 1
        if max(end, top) > self.capacity:
            self._grow(2 * max(end, top))
        rot = self._rot[positions:top] if isinstance(positions, int) else self._rot[positions]
        w = self.w
        hd, nq, nkv, q_size, kv_size = w.head_dim, w.num_heads, w.num_kv_heads, w.q_size, w.kv_size

        x = x.to(self.dtype)  # the residual stream stays in the layer's dtype
        if w.split is not None:  # EAGLE-3: x = cat(embedding, feature), each half normed
            emb, feature = x[..., : w.split], x[..., w.split :]
            normed = rms(feature, w.eps_hidden)
            x_in = torch.cat([rms(emb, w.eps_in), normed], dim=-1)
            x = feature if w.hidden_weight is None else normed * w.hidden_weight
        else:
            x_in = x if w.eps_in is None else rms(x, w.eps_in)
        qkv = w.qkv(x_in)  # (rows, n, q + 2 kv), the norms' weights folded in
        qk = qkv[..., : q_size + kv_size].float().view(rows, n, nq + nkv, hd)
        if w.q_norm is not None:  # Qwen3: per-head norms before the rotation
            qk = torch.cat([F.rms_norm(qk[:, :, :nq], (hd,), *w.q_norm),
                            F.rms_norm(qk[:, :, nq:], (hd,), *w.k_norm)], dim=2)  # fmt: skip
        # q and k rotated in one go: their rows pair the rotary halves (LayerWeights)
        pairs = torch.view_as_complex(qk.view(rows, n, nq + nkv, hd // 2, 2)) * rot.unsqueeze(-2)
        qk = torch.view_as_real(pairs).view(rows, n, nq + nkv, hd).to(self.dtype)
        self.keys[:, :, start:end] = qk[:, :, nq:].transpose(1, 2)
        self.values[:, :, start:end] = (
            qkv[..., q_size + kv_size :].view(rows, n, nkv, hd).transpose(1, 2)
        )
        if visible is None and n > 1:
            visible = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        elif visible is not None:
            visible = visible.to(self.device)
            if visible.dim() == 3:  # per row: one mask for every head
                visible = visible[:, None]
        attn = F.scaled_dot_product_attention(
            qk[:, :, :nq].transpose(1, 2),  # (rows, heads, n, hd)
            self.keys[:, :, :end],
            self.values[:, :, :end],
            attn_mask=visible,
            scale=w.scaling,
            enable_gqa=nq != nkv,
        )  # (rows, heads, n, hd)
        self.length = end
        x = x + w.o(attn.transpose(1, 2).reshape(rows, n, q_size))  # (a bf16 product promotes)
        h = w.gate_up(rms(x, w.eps_post))
        h = w.act(h[..., : w.intermediate]) * h[..., w.intermediate :]
        return x + w.down(h)


class ModuleLayer(CacheColumns):
    """The same interface around the layer module itself and a DynamicCache: for layer layouts
    LeanLayer does not reproduce."""

    def __init__(self, layer: nn.Module, rotary: nn.Module) -> None:
        super().__init__(DynamicCache())
        self.layer, self.rotary = layer, rotary
        weight = next(layer.parameters())
        self.device, self.dtype = weight.device, weight.dtype

    @torch.no_grad()
    def __call__(
        self,
        x: torch.Tensor,
        positions: int | list[int] | torch.Tensor,
        visible: torch.Tensor | None = None,
    ) -> torch.Tensor:
        rows, n, past = x.shape[0], x.shape[1], self.length
        if isinstance(positions, int):
            positions = torch.arange(positions, positions + n, device=self.device)
        positions = torch.as_tensor(positions, device=self.device).expand(rows, n)
        if visible is None:
            visible = torch.ones(n, past + n, dtype=torch.bool).tril(past)
        visible = visible.to(self.device)
        mask = float_mask(visible, x.dtype) if visible.dtype == torch.bool else visible
        mask = mask.reshape(-1, 1, n, past + n)  # (1 or rows, 1, n, columns)
        out = self.layer(
            x, attention_mask=mask, position_ids=positions, cache=self.cache,
            use_cache=True, position_embeddings=self.rotary(x, positions),
        )  # fmt: skip
        return out[0] if isinstance(out, tuple) else out


def rotary_table(rotary: nn.Module, length: int, device: torch.device) -> torch.Tensor:
    """(length, head_dim / 2) complex64: e^(i angle) of each rotary pair at positions 0 ..
    length - 1, from the model's rotary module (its cos/sin hold each angle twice, once per
    half, with any attention scaling applied to both)."""
    positions = torch.arange(length, device=device)[None]
    with torch.no_grad():
        cos, sin = rotary(torch.empty(0, device=device, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    cos, sin = cos[0].float(), sin[0].float()
    if not (
        torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    ):
        raise ValueError(
            f"{type(rotary).__name__} does not rotate (i, i + head_dim / 2) pairs by one angle; "
            "LeanLayer cannot run it (lean_supported should have refused this layer)"
        )
    return torch.complex(cos[:, :half], sin[:, :half])


def _fused_bias(linears) -> torch.Tensor | None:
    """The biases of linears whose outputs are concatenated (zeros for one without), or None."""
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([
        lin.bias.detach() if lin.bias is not None
        else torch.zeros(lin.out_features, dtype=lin.weight.dtype, device=lin.weight.device)
        for lin in linears
    ])  # fmt: skip


def _norm_params(norm: nn.Module | None, order: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """A per-head norm's weight (in the reordered head dims) and epsilon, or None."""
    if norm is None:
        return None
    # float: LeanLayer normalises q and k in fp32 before rotating them
    return norm.weight.detach()[order.to(norm.weight.device)].float(), norm.variance_epsilon


class SharedWeights:
    """Drafting weights built once and shared by every session until a parameter changes: the
    key holds the parameters themselves with their storage and version. Writes through `.data`
    or fused optimizers do not bump versions, so owners also `clear()` on train/eval switches
    (the trainer switches modes)."""

    def __init__(self) -> None:
        self._entry: tuple | None = None

    def get(self, params: list[torch.Tensor], int8: bool, build):
        """The cached weights for these parameters and int8 setting, else `build()` cached."""
        key = (int8, [(id(p), p.data_ptr(), p._version) for p in params])
        if self._entry is None or self._entry[0] != key:
            # the parameters are held too, so an id in the key cannot be reused by another tensor
            self._entry = (key, params, build())
        return self._entry[2]

    def clear(self) -> None:
        self._entry = None
