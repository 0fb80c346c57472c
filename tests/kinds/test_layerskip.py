"""LayerSkip's self-speculative decoding: its first E layers draft, the rest verify on the
shared KV cache, and the output is the target's (greedy: token for token; sampled: its
distribution)."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import chi_square_p_value, first_two_joint, make_target, tiny_llama

from specdraft.inference import generate
from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.kinds.layerskip.layerskip_session import LayerSkipSession

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]


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


@pytest.mark.parametrize("exit_layer", [1, 3])
def test_long_copies_between_own_drafts_stay_exact(deep_target, exit_layer, monkeypatch):
    """Copies of up to 8 tokens (lookup_gamma) verified by the full forward, between chains of 2
    drafted on the shared cache: output stays plain greedy."""
    from specdraft.inference.metrics import Stats

    prompt = [5, 17, 42, 99, 7, 230, 11, 12] * 3
    plain = generate(deep_target, prompt, None, max_new_tokens=40)
    depths = []
    record = Stats.record_step

    def spy(stats, drafted, depth, *args):
        depths.append(depth)
        return record(stats, drafted, depth, *args)

    monkeypatch.setattr(Stats, "record_step", spy)
    own = []  # whether each verification was the session's own (late layers only)
    verify = LayerSkipSession.verify
    monkeypatch.setattr(
        LayerSkipSession, "verify", lambda s, *a: own.append(v := verify(s, *a)) or v
    )
    drafter = self_drafter(deep_target, exit_layer)
    out = generate(
        deep_target, prompt, drafter, max_new_tokens=40, gamma=2, lookup_ngram=2, lookup_gamma=8
    )
    assert out.tokens.tolist() == plain.tokens.tolist()
    s = out.stats
    assert 0 < s.copied_passes < s.target_passes - 1  # copies, and drafts of its own
    assert max(depths) > 2
    # copying in front still lets the session verify its own drafts on the shared cache
    assert any(v is not None for v in own) and any(v is None for v in own)


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


def test_eos_inside_a_draft_and_a_chosen_exit_at_decode_time(deep_target, monkeypatch):
    """EOS and max_new_tokens falling inside an accepted draft end the output where plain
    decoding ends it; decode's exit_layer drafts from another exit of the same model."""
    prompt = [5, 6, 7, 8, 5, 6]
    drafter = self_drafter(deep_target, 2)
    plain = generate(deep_target, prompt, None, max_new_tokens=40).tokens[0].tolist()
    out = generate(deep_target, prompt, drafter, max_new_tokens=40, gamma=6)
    # an EOS token that the drafts reach, several tokens into the output
    eos = next(t for t in plain[6:] if plain.index(t) >= 6)
    monkeypatch.setattr(deep_target.model.generation_config, "eos_token_id", eos)
    plain_eos = generate(deep_target, prompt, None, max_new_tokens=40).tokens[0].tolist()
    assert plain_eos[-1] == eos and len(plain_eos) < len(plain)
    for gamma, n in ((6, 40), (5, 11), (3, 7)):
        ours = generate(deep_target, prompt, drafter, max_new_tokens=n, gamma=gamma)
        assert ours.tokens[0].tolist() == plain_eos[:n]
    assert out.stats.accepted > 0
    monkeypatch.undo()
    for exit_layer in (1, 3):
        other = generate(deep_target, prompt, drafter, max_new_tokens=40, exit_layer=exit_layer)
        assert other.tokens[0].tolist() == plain
    with pytest.raises(ValueError, match=r"exit_layer=4 is not in 1\.\.3"):
        generate(deep_target, prompt, drafter, max_new_tokens=4, exit_layer=4)
    with pytest.raises(
        ValueError,
        match="exit_layer=2 is a LayerSkip drafter's decoding setting, which this prompt_lookup drafter does not take",
    ):
        generate(deep_target, prompt, "prompt_lookup", max_new_tokens=4, exit_layer=2)


def test_the_shared_cache_after_compaction_is_plain_decodings(deep_target, monkeypatch):
    """After self-speculation (drafts rejected and accepted, every layer written by draft and
    verification alike), the one cache holds what one forward over the output computes."""
    from specdraft.kinds.layerskip import layerskip

    caches = []
    bind = layerskip.LayerSkipSession.bind_cache
    monkeypatch.setattr(
        layerskip.LayerSkipSession, "bind_cache", lambda s, c: (caches.append(c), bind(s, c))
    )
    out = generate(deep_target, [5, 6, 7, 8], self_drafter(deep_target, 2), max_new_tokens=30)
    assert out.stats.drafted > out.stats.accepted > 0  # both kinds of outcome happened
    (cache,) = caches
    seq = torch.cat([torch.tensor([[5, 6, 7, 8]]), out.tokens], dim=1)[:, :-1]  # last: pending
    with torch.no_grad():
        full = deep_target.model(seq, use_cache=True).past_key_values
    assert cache.get_seq_length() == seq.shape[1]
    for ours, plain in zip(cache.layers, full.layers, strict=True):
        assert ours.keys.shape == plain.keys.shape
        assert torch.allclose(ours.keys, plain.keys, atol=1e-5)
        assert torch.allclose(ours.values, plain.values, atol=1e-5)


def accept_every_draft(tree, p, generator):
    """Lossy: keeps the whole drafted chain whatever the target says."""
    from specdraft.inference.verify import verify_sampling

    path, _ = verify_sampling(tree, p, generator)
    path = list(range(len(tree)))
    return path, int(torch.multinomial(p[len(tree)], 1, generator=generator))


@pytest.mark.parametrize("lossy", [False, True], ids=["exact", "accept-every-draft"])
def test_sampled_output_follows_the_target(lossy, monkeypatch):
    """Two tokens sampled through self-speculation follow the target's joint distribution; a
    verifier that keeps every draft fails the same check (it has the power to catch one)."""
    import importlib

    if lossy:
        loop = importlib.import_module("specdraft.inference.generate")
        monkeypatch.setattr(loop, "verify_sampling", accept_every_draft)
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
    from specdraft.core import SamplingSettings

    settings = SamplingSettings(temperature=1.3)
    exact = first_two_joint(target, [1, 2, 3], settings)
    p_value = chi_square_p_value(counts.flatten(), exact.flatten())
    assert p_value < 1e-3 if lossy else p_value > 1e-3


def test_another_model_as_target_is_refused(deep_target):
    other = make_target(tiny_llama(384, seed=8, layers=4))
    with pytest.raises(ValueError, match="its own fine-tuned model"):
        generate(other, [1, 2], self_drafter(deep_target, 2), max_new_tokens=4)


def test_tuning_and_the_exit_table_cover_the_exits_training_taught(deep_target):
    trained = LayerSkipConfig(exit_layer=2, early_exit_layers=[1])
    drafter = LayerSkipDrafter(trained, deep_target.model)
    assert drafter.candidate_exits() == [1, 2]  # the last layer (4) is no draft
    assert drafter.search_space(deep_target) == {"exit_layer": [1, 2]}
    every = self_drafter(deep_target, 2)  # no early_exit_layers: every layer's exit trains
    assert every.candidate_exits() == [1, 2, 3]
