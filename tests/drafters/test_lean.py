"""LeanLayer gives the decoder layer's own outputs, call after call, for every Llama-layout family
it claims; layouts it does not claim fall back to the module itself."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from specdraft.drafters.lean import (
    DraftLinear,
    LayerWeights,
    LeanLayer,
    ModuleLayer,
    decode_layer,
    lean_supported,
)
from specdraft.kinds.eagle.eagle_layers import (
    Eagle3Layer,
    eagle1_reference_layer,
    llama_layer_config,
)

SMALL = dict(
    vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
    num_attention_heads=4, max_position_embeddings=128,
)  # fmt: skip

FAMILIES = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL, num_key_value_heads=4)),
    "llama-gqa-rope-scaled": lambda: LlamaForCausalLM(
        LlamaConfig(
            **SMALL,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
        )
    ),
    "qwen2-bias": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL, num_key_value_heads=2)),
    "qwen3-qk-norm": lambda: Qwen3ForCausalLM(
        Qwen3Config(**SMALL, num_key_value_heads=2, head_dim=16)
    ),
    "mistral": lambda: MistralForCausalLM(
        MistralConfig(**SMALL, num_key_value_heads=2, sliding_window=None)
    ),
}


def eagle_layer(name: str):
    """EAGLE's reference layers in a module holding them as a model holds its first layer."""
    config = llama_layer_config(LlamaConfig(**SMALL, num_key_value_heads=2))
    if name == "eagle1":
        layer = eagle1_reference_layer(config)
    else:
        layer = Eagle3Layer(config, norm_before_residual=name == "eagle3-norm-before-residual")
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.layers = torch.nn.ModuleList([layer])
    model.model.rotary_emb = LlamaRotaryEmbedding(config)
    return model


# EAGLE's reference layers: EAGLE-3's reads cat(embedding, feature), 2 x 64 wide
FAMILIES.update({
    "eagle3-reference": lambda: eagle_layer("eagle3"),
    "eagle3-reference-norm-before-residual": lambda: eagle_layer("eagle3-norm-before-residual"),
    "eagle1-reference-no-input-norm": lambda: eagle_layer("eagle1"),
})  # fmt: skip


def width(family: str) -> int:
    return 128 if family.startswith("eagle3") else 64


def parts(model):
    torch.manual_seed(0)
    for p in model.parameters():  # random biases and norm weights too, so each one matters
        torch.nn.init.normal_(p, std=0.2)
    return model.model.layers[0].eval(), model.model.rotary_emb


def run(layer_impl, x_chunks):
    """Feed chunks as drafting does: a causal prompt, a chain step, a tree level with shared
    positions and a custom mask, then drop the tree and continue."""
    outs = [layer_impl(x_chunks[0], 0)]  # 6 tokens at positions 0..5, causal
    outs.append(layer_impl(x_chunks[1], 6))  # one token sees everything
    visible = torch.tensor([[True] * 7 + [True, False, False], [True] * 7 + [False, True, False],
                            [True] * 5 + [False, False] + [False, False, True]])  # fmt: skip
    outs.append(layer_impl(x_chunks[2], torch.tensor([7, 7, 5]), visible))
    layer_impl.crop(7)
    outs.append(layer_impl(x_chunks[3], 7))  # two tokens, causal after the cache
    return outs


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lean_layer_equals_the_module(family):
    layer, rotary = parts(FAMILIES[family]())
    assert lean_supported(layer)
    torch.manual_seed(1)
    chunks = [torch.randn(1, n, width(family)) for n in (6, 1, 3, 2)]
    lean = LeanLayer(
        LayerWeights(layer), rotary, capacity=4
    )  # small: the buffers must grow on the way
    module = ModuleLayer(layer, rotary)
    for a, b in zip(run(lean, chunks), run(module, chunks), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert lean.length == module.length == 9
    assert lean.capacity >= 9


@pytest.mark.parametrize("mode", ["int8", "bf16"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_lean_layer_with_int8_weights_or_in_bf16_stays_close(family, mode):
    """The drafting paths that trade exactness for speed (int8 weights with bf16 products, or a
    bf16 head as on a GPU) still give the layer's update within a few percent."""
    layer, rotary = parts(FAMILIES[family]())
    dtype = torch.bfloat16 if mode == "bf16" else torch.float32
    layer.to(dtype)
    torch.manual_seed(1)
    chunks = [torch.randn(1, n, width(family), dtype=dtype) for n in (6, 1, 3, 2)]
    lean = LeanLayer(LayerWeights(layer, int8=mode == "int8"), rotary, capacity=4)
    reference = ModuleLayer(layer, rotary)
    for x, a, b in zip(chunks, run(lean, chunks), run(reference, chunks), strict=True):
        assert a.dtype == dtype
        x = x[..., -64:]  # the residual stream (EAGLE-3's: the feature, the input's second half)
        if family.endswith("norm-before-residual"):
            x = layer.hidden_norm(x)
        update, expected = (a - x).float(), (b - x).float()  # the residual would hide errors
        assert (update - expected).norm() / expected.norm() < 0.03


def test_int8_products_stay_close_and_odd_widths_keep_full_weights():
    torch.manual_seed(2)
    weight = torch.nn.Parameter(torch.randn(48, 64))
    exact, x = DraftLinear(weight), torch.randn(3, 64)
    approx = DraftLinear(weight, int8=True)
    assert approx.int8 and exact.shared and exact.memory_bytes() == 0
    assert (approx(x) - exact(x)).norm() / exact(x).norm() < 0.02
    odd = DraftLinear(torch.randn(8, 40), int8=True)  # the int8 kernel wants 16-wide blocks
    assert not odd.int8 and odd(torch.randn(2, 40)).shape == (2, 8)


@pytest.mark.parametrize("impl", ["lean", "module"])
def test_rows_of_one_layer_compute_what_each_row_computes_alone(impl):
    """Two rows in one layer's buffers, as BatchCache moves them (a step whose columns each row
    keeps differently: `gather`; a row leaving: `select_rows`), with per-row positions and
    masks that hide each row's holes, give each row's outputs alone."""
    layer, rotary = parts(FAMILIES["llama"]())

    def make(rows):
        return LeanLayer(LayerWeights(layer), rotary, 4, rows) if impl == "lean" else (
            ModuleLayer(layer, rotary))  # fmt: skip

    both, alone = make(2), [make(1), make(1)]
    torch.manual_seed(3)
    x = torch.randn(2, 5, 64)
    out = both(x, 0)  # 5 tokens each, no holes
    for r in range(2):
        torch.testing.assert_close(out[r], alone[r](x[r : r + 1], 0)[0], rtol=1e-5, atol=1e-5)
    y = torch.randn(2, 3, 64)
    both(y, 5)  # 3 more each; row 0 keeps all three, row 1 the third (then two holes)
    both.gather(torch.tensor([[0, 1, 2], [2, 0, 0]]), 5)
    alone[0](y[:1], 5)
    alone[1](y[1:, 2:], 7)
    assert both.length == 8 and alone[1].length == 6
    z = torch.randn(2, 1, 64)
    holes = torch.tensor([[True] * 8 + [True], [True] * 6 + [False, False, True]])
    out = both(z, torch.tensor([[8], [8]]), holes[:, None])
    torch.testing.assert_close(out[0], alone[0](z[:1], 8)[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out[1], alone[1](z[1:], 8)[0], rtol=1e-5, atol=1e-5)
    both.select_rows(torch.tensor([1]))  # row 0 finished
    w = torch.randn(1, 2, 64)
    seen = torch.tensor([[True] * 6 + [False, False, True, True, False],
                         [True] * 6 + [False, False, True, True, True]])  # fmt: skip
    out = both(w, torch.tensor([[9, 10]]), seen[None])
    torch.testing.assert_close(out, alone[1](w, 9), rtol=1e-5, atol=1e-5)


def test_unknown_layouts_fall_back_to_the_module():
    layer, rotary = parts(
        GemmaForCausalLM(GemmaConfig(**SMALL, num_key_value_heads=4, head_dim=16))
    )
    assert not lean_supported(layer)  # Gemma's RMSNorm scales by 1 + weight
    assert isinstance(decode_layer(layer, rotary), ModuleLayer)
    windowed, rot = parts(MistralForCausalLM(MistralConfig(**SMALL, sliding_window=4)))
    assert isinstance(decode_layer(windowed, rot), ModuleLayer)
    # the Llama layout with other maths: residual multipliers (Granite)
    granite, rot = parts(GraniteForCausalLM(GraniteConfig(**SMALL, residual_multiplier=0.2)))
    assert not lean_supported(granite, rot)
    # a rotary table that depends on the sequence length cannot be computed once
    llama = LlamaConfig(**SMALL, rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                  "rope_theta": 10000.0})  # fmt: skip
    layer, rot = parts(LlamaForCausalLM(llama))
    assert lean_supported(layer) and not lean_supported(layer, rot)
    assert isinstance(decode_layer(layer, rot), ModuleLayer)
