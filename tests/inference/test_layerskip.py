"""LayerSkip's self-speculative decoding: its first E layers draft, the rest verify on the
shared KV cache, and the output is the target's (greedy: token for token; sampled: its
distribution)."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import chi_square_p_value, make_target, tiny_llama

from specdraft.drafters.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.inference import generate


def self_drafter(target, exit_layer: int) -> LayerSkipDrafter:
    return LayerSkipDrafter(LayerSkipConfig(exit_layer=exit_layer), target.model).eval()


@pytest.fixture(scope="module")
def deep_target():
    """A random 4-layer target with varied greedy output."""
    return make_target(tiny_llama(384, seed=7, layers=4))


@pytest.mark.parametrize("exit_layer", [1, 3])
@pytest.mark.parametrize("lookup", [0, 2])
def test_greedy_equals_plain_greedy(deep_target, exit_layer, lookup):
    drafter = self_drafter(deep_target, exit_layer)
    plain = generate(deep_target, [5, 6, 7, 8, 5, 6], None, max_new_tokens=40)
    for gamma, stop in ((1, 0.0), (4, 0.0), (6, 0.2)):
        out = generate(
            deep_target, [5, 6, 7, 8, 5, 6], drafter, max_new_tokens=40, gamma=gamma,
            stop_below=stop, lookup_ngram=lookup,
        )  # fmt: skip
        assert out.tokens.tolist() == plain.tokens.tolist()
        assert out.stats.drafted > 0
        assert out.stats.drafter_kv_bytes == 0  # the draft's cache entries are the target's


def test_the_early_layers_run_once_per_token(deep_target, monkeypatch):
    """Every layer sees each position once: the draft's early-layer work is reused, not redone
    by verification (the shared cache ends exactly as long as the sequence)."""
    drafter = self_drafter(deep_target, 2)
    calls = {i: 0 for i in range(4)}
    for i, layer in enumerate(deep_target.model.model.layers):
        original = layer.forward

        def counted(hidden, *args, _i=i, _f=original, **kwargs):
            calls[_i] += hidden.shape[1]
            return _f(hidden, *args, **kwargs)

        monkeypatch.setattr(layer, "forward", counted)
    prompt = [5, 6, 7, 8]
    out = generate(deep_target, prompt, drafter, max_new_tokens=30, gamma=4)
    # each position of the final sequence, and every rejected draft token, passed each layer
    # exactly once: the early layers saw no more tokens than the late ones
    assert calls[0] == calls[1] and calls[2] == calls[3]
    assert calls[0] == calls[2]
    assert calls[0] >= len(prompt) + out.tokens.shape[1] - 1


def test_sampled_output_follows_the_target():
    target = make_target(tiny_llama(6, seed=3, hidden=16, layers=2, init=0.5))
    drafter = self_drafter(target, 1)
    counts = torch.zeros(6, 6)
    drafted = accepted = 0
    for seed in range(1500):
        out = generate(target, [1, 2, 3], drafter, max_new_tokens=3, temperature=1.3, seed=seed,
                       gamma=2)  # fmt: skip
        y1, y2 = out.tokens[0, :2].tolist()
        counts[y1, y2] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert drafted > 0 and accepted > 0
    from specdraft.core import SamplingSettings, process_logits

    settings = SamplingSettings(temperature=1.3)
    with torch.no_grad():
        first = process_logits(target.model(torch.tensor([[1, 2, 3]])).logits[0, -1], settings)
        nxt = torch.stack(
            [target.model(torch.tensor([[1, 2, 3, y]])).logits[0, -1] for y in range(6)]
        )
    exact = first[:, None] * process_logits(nxt, settings)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > 1e-3


def test_another_model_as_target_is_refused(deep_target):
    other = make_target(tiny_llama(384, seed=8, layers=4))
    with pytest.raises(ValueError, match="its own fine-tuned model"):
        generate(other, [1, 2], self_drafter(deep_target, 2), max_new_tokens=4)
