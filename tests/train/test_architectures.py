"""Every kind on the architectures people train drafters for: tiny random Llama (tied
embeddings), Qwen2, Phi-3, OLMo-2, Qwen3, Qwen3-MoE, Mistral (sliding window), Gemma-2 (alternating windows, soft-capping) and Gemma-3 (a pattern of
local layers with their own rope) targets, saved as model folders with the tiny demo target's
tokenizer; each kind trained 3 steps through its trainer (sequences longer than the
window), then greedy decoding on prompts past the window against the model's own greedy
decoding, and the EAGLE-3 and Medusa heads exported and read back. (The untied Llama is the
tiny demo target the rest of the suite uses.)

Before: two-model training failed on Qwen3, Qwen3-MoE and Gemma (seeded layers of another
head_dim), LayerSkip training on Gemma-3 (its rotary takes a layer type), and decoding failed
for every kind on the sliding-window targets once past the window.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoTokenizer,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from specdraft.formats.export_registry import export_drafter
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference import generate
from specdraft.targets.target import load_target
from specdraft.train.entry import main as train_main

pytestmark = pytest.mark.slow

WINDOW = 16
ARCHITECTURES = [
    "llama_tied", "qwen2", "phi3", "olmo2", "qwen3", "qwen3_moe", "mistral", "gemma2", "gemma3",
]  # fmt: skip


def _model(name: str, vocab: int):
    torch.manual_seed(0)
    common = dict(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=512, head_dim=24,
        initializer_range=0.2, tie_word_embeddings=False,
    )  # fmt: skip
    if name == "llama_tied":
        return LlamaForCausalLM(LlamaConfig(**{**common, "tie_word_embeddings": True}))
    if name == "qwen2":  # q/k/v biases
        return Qwen2ForCausalLM(Qwen2Config(**common))
    if name == "phi3":  # fused qkv and gate/up projections
        return Phi3ForCausalLM(Phi3Config(**common, pad_token_id=0))
    if name == "olmo2":  # norms after attention and MLP, q/k norms
        return Olmo2ForCausalLM(Olmo2Config(**common, pad_token_id=0))
    if name == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**common))
    if name == "qwen3_moe":
        return Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
        )
    if name == "mistral":
        return MistralForCausalLM(MistralConfig(**common, sliding_window=WINDOW))
    if name == "gemma2":
        return Gemma2ForCausalLM(
            Gemma2Config(
                **common, sliding_window=WINDOW, final_logit_softcapping=5.0,
                attn_logit_softcapping=10.0,
            )
        )  # fmt: skip
    return Gemma3ForCausalLM(
        Gemma3TextConfig(**common, sliding_window=WINDOW, sliding_window_pattern=2)
    )


@pytest.fixture(scope="module", params=ARCHITECTURES)
def architecture(request, tiny_target_path, tmp_path_factory):
    """(name, the model folder) of a tiny random target of one architecture."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_path)
    model = _model(request.param, len(tokenizer)).eval()
    model.generation_config.eos_token_id = None  # decode the whole length, past the window
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return request.param, str(folder)


KINDS = {
    "eagle3": (
        "eagle",
        ["drafter.feature_layers=[1,2,3]", "drafter.ttt_steps=2", "drafter.draft_vocab_size=128"],
    ),
    "medusa": ("medusa", ["drafter.num_heads=2"]),
    "layerskip": ("layerskip", ["drafter.exit_layer=2", "drafter.layer_dropout=0.0"]),
    "distill": ("distill", ["drafter.num_layers=1"]),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_each_kind_trains_decodes_exactly_and_exports(architecture, kind, tmp_path):
    name, folder = architecture
    trained, args = KINDS[kind]
    out = tmp_path / "run"
    code = train_main(trained, [
        f"target={folder}", f"output_dir={out}", "max_steps=3", "micro_batch_size=2",
        "eval_every=0", "save_every=0", "data.max_samples=12", f"data.max_length={2 * WINDOW}",
        "warmup_steps=1", "lr=1e-3", "eval_loop.enabled=false", "decode.gamma=3", *args,
    ])  # fmt: skip
    assert code == 0, f"{name}: {kind} training failed"
    final = out / "final"
    target = load_target(str(final) if kind == "layerskip" else folder)
    drafter = load_drafter(final, target)
    decode = load_decoding(final)
    prompt = target.tokenizer("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]
    assert len(prompt) + 24 > WINDOW
    plain = target.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False)
    expected = plain[0, len(prompt) :].tolist()
    for settings in ({}, {"tree_top_k": 2}) if kind != "layerskip" else ({},):
        ours = generate(target, prompt, drafter, max_new_tokens=24, decode=decode, **settings)
        assert ours.tokens[0].tolist() == expected, f"{name}: {kind} {settings}"
        assert ours.stats.drafted > 0, f"{name}: {kind} {settings}"
    fmt = {"eagle3": "speculators", "medusa": "medusa"}.get(kind)
    if fmt is None:
        return
    exported = export_drafter(
        drafter, tmp_path / fmt, fmt, base_model_name_or_path=folder, decode=decode
    )
    back = load_drafter(exported, target)
    again = generate(target, prompt, back, max_new_tokens=24, decode=load_decoding(exported))
    assert again.tokens[0].tolist() == expected, f"{name}: {kind} read back from {fmt}"
