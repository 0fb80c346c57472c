"""The loop on targets whose layers slide over a window: Mistral (every layer), Gemma-2
(alternating, soft-capped logits and attention), Gemma-3 (a pattern of local layers with their
own rope) and Qwen2 with use_sliding_window (full layers, then sliding ones). Prompt plus output
run past every window, where each of these failed before the cache kept every layer's keys
("`crop` was called, but the current layer does not track past states") and tree masks took
each layer's window ("The size of tensor a (9) must match the size of tensor b (14)").
"""

from __future__ import annotations

import pytest
import torch
from spec_helpers import WINDOW, chi_square_p_value, make_target, perturbed, sliding_model
from transformers import DynamicCache

from specdraft.attention import AttentionLayout, causal_masks
from specdraft.core import DraftTree
from specdraft.inference import generate
from specdraft.inference.tree import tree_attention
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.targets.target import final_logits

pytestmark = pytest.mark.exact

V, PROMPT, NEW = 64, 12, 20
ARCHITECTURES = ["mistral", "gemma2", "gemma3", "qwen2"]


@pytest.fixture(scope="module", params=ARCHITECTURES)
def sliding(request):
    model = sliding_model(request.param)
    assert AttentionLayout.of(model.config).slides
    return request.param, make_target(model)


def plain_greedy(model, prompt: torch.Tensor, n: int) -> list[int]:
    return model.generate(prompt, max_new_tokens=n, do_sample=False)[0, prompt.shape[1] :].tolist()


def test_every_kind_decodes_exactly_past_the_window(sliding):
    name, target = sliding
    torch.manual_seed(1)
    prompt = torch.randint(3, V, (1, PROMPT))
    expected = plain_greedy(target.model, prompt, NEW)
    close = perturbed(target.model, 0.05, seed=1)  # a two-model draft that mostly agrees
    drafters = {
        "plain": (None, {}),
        "prompt lookup": ("prompt_lookup", {}),
        "two-model chain": (close, {}),
        "two-model tree": (close, {"tree_top_k": 2, "tree_budget": 6}),
        "layerskip": (LayerSkipDrafter(LayerSkipConfig(exit_layer=2), target.model).eval(), {}),
        "eagle-1 tree": (
            EagleDrafter.build(EagleConfig(version="eagle1"), target).eval(),
            {"tree_top_k": 2},
        ),
        "medusa tree": (
            MedusaDrafter.build(MedusaConfig(num_heads=3, num_layers=1), target).eval(),
            {"tree_top_k": 2},
        ),
    }
    for label, (drafter, settings) in drafters.items():
        out = generate(target, prompt, drafter, max_new_tokens=NEW, **settings)
        assert out.tokens[0].tolist() == expected, f"{name}: {label}"
        if drafter not in (None, "prompt_lookup"):
            assert out.stats.drafted > 0, f"{name}: {label}"
        if label in ("two-model chain", "two-model tree", "layerskip"):
            assert out.stats.accepted > 0, f"{name}: {label}"


@pytest.mark.parametrize("name", ["mistral", "gemma2"])
def test_a_tree_node_sees_what_its_path_decoded_alone_sees(name):
    """Each node's logits from one tree forward past the window equal the model's own forward
    over the context plus the node's path: the window is applied per node, by its position.
    (With the window left out of the tree mask, the nodes see keys their path alone would not,
    and this fails.)"""
    model = sliding_model(name)
    target = make_target(model)
    torch.manual_seed(2)
    context = torch.randint(3, V, (1, 3 * WINDOW))
    # a root with two children, the first with a child of its own
    tree = DraftTree(tokens=torch.tensor([[5, 6, 7]]), parents=[-1, -1, 0], depths=[1, 1, 2])
    past, pending = context.shape[1] - 1, 1
    with torch.no_grad():
        cache = DynamicCache()  # every layer keeps every key, as the loop's cache does
        target.forward(context[:, :past], use_cache=True, cache=cache)
        mask, positions = tree_attention(
            tree, past, pending, model.dtype, target.device, target.attention
        )
        inputs = torch.cat([context[:, past:], tree.tokens], dim=1)
        out = target.forward(inputs, attention_mask=mask, position_ids=positions, cache=cache)
        paths = [[5], [6], [5, 7]]
        for node, path in enumerate(paths):
            alone = model(torch.cat([context, torch.tensor([path])], dim=1)).logits[0, -1]
            torch.testing.assert_close(out.logits[0, 1 + node], alone, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_layerskip_trains_on_what_the_model_computes(name):
    """The training path's final-layer logits equal the model's own forward on sequences longer
    than every window: each layer sees its own type's mask (its window), Gemma-3's local layers
    their own rope, and Gemma-2's logits are soft-capped. Before, the exits ran under one full
    causal mask and agreed with the model on the argmax about 45% of the time."""
    model = sliding_model(name)
    drafter = LayerSkipDrafter(LayerSkipConfig(exit_layer=2, layer_dropout=0.0), model).eval()
    torch.manual_seed(3)
    ids = torch.randint(3, V, (2, 5 * WINDOW))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": ids > 0}
    with torch.no_grad():
        final = drafter.exit_states(batch, [4])[4]
        torch.testing.assert_close(final_logits(model, final), model(ids).logits)


def test_causal_masks_slide_by_position():
    layout = AttentionLayout.of(sliding_model("gemma2").config)
    assert layout.per_type and layout.windows == {"full_attention": None, "sliding_attention": 8}
    masks = causal_masks(layout, past=10, new=2, dtype=torch.float32, device="cpu")
    full, slide = masks["full_attention"][0, 0], masks["sliding_attention"][0, 0]
    assert (full[0, :11] == 0).all() and full[0, 11] < 0  # causal
    # the query at position 10 sees keys 3..10, the one at 11 keys 4..11
    assert (slide[0, 3:11] == 0).all() and (slide[0, :3] < 0).all()
    assert (slide[1, 4:12] == 0).all() and (slide[1, :4] < 0).all()


SAMPLES, FALSE_ALARM = 1500, 1e-3


def test_sampling_on_a_soft_capped_sliding_target_keeps_its_distribution():
    """Chi-square on the first two tokens after a prompt longer than the window, on Gemma-2
    (soft-capped logits, alternating windows of 2), through LayerSkip (which verifies with the
    target's own late layers, so it must cap its logits as the model does) and a two-model
    tree."""
    vocab = 6
    model = sliding_model("gemma2", vocab=vocab, window=2, layers=2)
    target = make_target(model)
    prompt = [1, 2, 3, 4]
    with torch.no_grad():
        first = torch.softmax(model(torch.tensor([prompt])).logits[0, -1], -1)
        second = torch.softmax(
            torch.stack([model(torch.tensor([[*prompt, y]])).logits[0, -1] for y in range(vocab)]),
            -1,
        )
    exact = (first[:, None] * second).flatten()
    drafters = {
        "layerskip": (LayerSkipDrafter(LayerSkipConfig(exit_layer=1), model).eval(), {}),
        "two-model tree": (perturbed(model, 0.3, seed=4), {"tree_top_k": 2}),
    }
    for label, (drafter, settings) in drafters.items():
        counts = torch.zeros(vocab, vocab)
        accepted = 0
        for seed in range(SAMPLES):
            out = generate(
                target, prompt, drafter, max_new_tokens=3, temperature=1.0, seed=seed, gamma=2,
                **settings,
            )  # fmt: skip
            y1, y2 = out.tokens[0, :2].tolist()
            counts[y1, y2] += 1
            accepted += out.stats.accepted
        assert accepted > 0, label
        assert chi_square_p_value(counts.flatten(), exact) > FALSE_ALARM, label


def test_an_eagle_head_for_gemma3_rotates_as_its_global_layers_do():
    """Gemma-3 keeps one rope per layer type; the head's Llama layer takes the full-attention
    layers' (it attends over the whole context), not a per-type dict a Llama config cannot
    read (before: "Unrecognized keys in rope_parameters" and the local layers' theta)."""
    model = sliding_model("gemma3")
    head = EagleDrafter.build(EagleConfig(), make_target(model))
    global_theta = model.config.rope_parameters["full_attention"]["rope_theta"]
    assert head.layer.self_attn.config.rope_parameters["rope_theta"] == global_theta


def test_an_attention_pattern_the_loop_cannot_reproduce_is_refused_at_load():
    """Chunked attention (Llama-4's local layers) is neither full nor sliding: one clear error
    when the target is built, never a wrong mask mid-decode."""
    from specdraft.targets.target import TargetError

    model = sliding_model("qwen2")
    model.config.layer_types = ["chunked_attention", *model.config.layer_types[1:]]
    with pytest.raises(TargetError, match=r"attention type \['chunked_attention'\]"):
        make_target(model)
