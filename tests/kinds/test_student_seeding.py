"""A two-model student seeded from the target's layers (drafter.init=target, the default) on
targets whose head_dim is not hidden / heads (Qwen3, Qwen3-MoE, Gemma) or whose layers mix
attention types. Before, the student's head_dim was recomputed as hidden / heads and seeding
failed with "Error(s) in loading state_dict for Qwen3DecoderLayer"."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import make_target, sliding_model
from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from specdraft.inference import generate
from specdraft.kinds.distill.distill import DistillConfig, build_student

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why

V = 64
COMMON = dict(
    vocab_size=V, hidden_size=32, num_hidden_layers=4, num_attention_heads=2,
    num_key_value_heads=1, intermediate_size=64, head_dim=24,
)  # fmt: skip


def model_of(name: str):
    torch.manual_seed(0)
    if name == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**COMMON))
    elif name == "qwen3_moe":
        config = Qwen3MoeConfig(
            **COMMON, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16
        )
        model = Qwen3MoeForCausalLM(config)
    else:
        model = sliding_model(name)
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "gemma2", "gemma3"])
def test_a_seeded_student_is_the_target_layers_it_copies(name):
    model = model_of(name)
    target = make_target(model)
    student = build_student(DistillConfig(num_layers=2, init_layers=[1, 2]), target).eval()
    assert student.config.head_dim == model.config.head_dim
    for mine, theirs in zip(student.model.layers, model.model.layers[1:3], strict=True):
        for (k, a), (_, b) in zip(
            mine.state_dict().items(), theirs.state_dict().items(), strict=True
        ):
            assert torch.equal(a, b), k
    types = getattr(model.config, "layer_types", None)
    if types is not None:  # each student layer attends as the layer that seeded it
        assert student.config.layer_types == [types[1], types[2]]
    prompt = torch.randint(3, V, (1, 12))
    out = generate(target, prompt, student, max_new_tokens=20)
    plain = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, 12:]
    assert out.tokens[0].tolist() == plain.tolist()
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_a_narrower_student_splits_its_own_width():
    target = make_target(model_of("qwen3"))
    student = build_student(DistillConfig(init="random", num_layers=1, hidden_size=16), target)
    assert student.config.hidden_size == 16
    assert student.config.head_dim * student.config.num_attention_heads == 16
