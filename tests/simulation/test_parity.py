"""Training predicts serving: at temperature 0 the simulation of serving through a drafter's
training path (served.served_drafts walked by metrics.simulate_serving) on the target's own
greedy continuation gives the loop's statistics exactly, for every kind, chains and Medusa's
tree; and scripts/parity.py's comparison finds planted train/serve mismatches and names them."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import KINDS, build, fitted

from specdraft.core import DecodeConfig
from specdraft.drafters import lean
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, EagleSession
from specdraft.simulation.serving_parity import (
    example_batch,
    first_difference,
    replay_serving,
    serve,
    simulate,
    training_path_drafts,
)

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module", params=KINDS)
def drafter(request, kind_drafter):
    return kind_drafter(request.param)


def test_simulated_equals_served_at_temperature_0(random_target, examples, drafter):
    settings = (
        DecodeConfig(gamma=3),
        DecodeConfig(gamma=4, stop_below=0.4),
        DecodeConfig(gamma=3, lookup_ngram=1, lookup_gamma=5),  # copies where the context repeats
    )
    for decode in settings:
        decode = drafter.decode_settings(decode)
        simulated = simulate(random_target, drafter, examples, decode)
        served = serve(random_target, drafter, examples, decode)
        for sim, real in zip(simulated, served, strict=True):
            assert sim.tau == real.tau
            assert (sim.reached_at, sim.accepted_at) == (real.reached_at, real.accepted_at)
            assert sim.emitted_per_pass == real.emitted_per_pass
            assert sim.copied_passes == real.copied_passes
        assert sum(s.drafted for s in served) > 0 and sum(s.accepted for s in served) > 0
        if decode.lookup_ngram:
            assert 0 < sum(s.copied_passes for s in served) < sum(s.target_passes for s in served)


def test_medusa_trees_simulated_equal_served(random_target, examples):
    """Medusa's tree, as its session builds it from the heads' measured accuracies."""
    heads = build("medusa", random_target, examples)
    for decode in (
        DecodeConfig(gamma=3, tree_top_k=3, tree_budget=8),
        DecodeConfig(gamma=2, tree_top_k=2),
    ):
        decode = heads.decode_settings(decode)
        simulated = simulate(random_target, heads, examples, decode)
        served = serve(random_target, heads, examples, decode)
        for sim, real in zip(simulated, served, strict=True):
            assert (sim.tau, sim.reached_at, sim.accepted_at) == (
                real.tau,
                real.reached_at,
                real.accepted_at,
            )
            assert sim.drafted == real.drafted
        assert sum(s.accepted for s in served) > 0


def test_a_correct_drafter_is_in_parity(random_target, examples, drafter):
    decode = drafter.decode_settings(DecodeConfig(gamma=3, lookup_ngram=1))
    assert first_difference(random_target, drafter, examples[0], decode) is None


@pytest.fixture(scope="module")
def eagle1(random_target, examples):
    return build("eagle1", random_target, examples)


def test_a_wrong_capture_layer_is_named(random_target, examples, monkeypatch):
    """An EAGLE-3 head served the final normed state (layer 2) where it trained on layer 1."""
    head = build("eagle3", random_target, examples)
    init = EagleSession.__init__

    def planted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.capture_layers = [2, 2, 2]

    monkeypatch.setattr(EagleSession, "__init__", planted)
    decode = DecodeConfig(gamma=3)
    found = first_difference(random_target, head, examples[0], decode)
    assert found == (
        "captured hidden states: serving captures target layers [2, 2, 2], training reads [1, 1, 1]"
    )


def test_a_scale_inside_the_drafter_is_named(random_target, examples, eagle1, monkeypatch):
    """The head's input features scaled when served (as a norm or an embedding scale missing on
    one path would): what it was handed agrees, its drafts do not."""
    step = EagleSession._step

    def planted(self, tokens, features, positions, visible=None):
        return step(self, tokens, features * 3, positions, visible)

    monkeypatch.setattr(EagleSession, "_step", planted)
    decode = DecodeConfig(gamma=3)
    sim, real = (f(random_target, eagle1, examples, decode) for f in (simulate, serve))
    assert [s.tau for s in sim] != [s.tau for s in real]
    found = first_difference(random_target, eagle1, examples[0], decode)
    assert found.startswith("the drafter's drafts after position")
    assert "computes differently" in found


@pytest.fixture(scope="module")
def eagle3(random_target, examples):
    """An EAGLE-3 head with the reference layer's normed residual, fitted until most of its
    first drafts are accepted (a mismatch must change accepted drafts to show)."""
    config = EagleConfig(version="eagle3", ttt_steps=2, norm_before_residual=True)
    return fitted(EagleDrafter.build(config, random_target), random_target, examples, steps=100)


def _planted_position_offset(head, monkeypatch):
    """Every one-token feed (each drafted level) one position further on than it sits."""
    step = EagleSession._step

    def planted(self, tokens, features, positions, visible=None):
        level = tokens.shape[1] == 1 and not isinstance(positions, torch.Tensor)
        return step(self, tokens, features, positions + int(level), visible)

    monkeypatch.setattr(EagleSession, "_step", planted)


def _planted_raw_residual(head, monkeypatch):
    """Served with the raw feature as the layer's residual where it trained on the normed one
    (an engine that ignores norm_before_residual)."""
    init = lean.LayerWeights.__init__

    def planted(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.hidden_weight = None

    monkeypatch.setattr(lean.LayerWeights, "__init__", planted)
    # an empty cache of drafting weights while planted; the head's own comes back after
    monkeypatch.setattr(head, "_drafting", lean.SharedWeights())


@pytest.mark.parametrize(
    "plant", [_planted_position_offset, _planted_raw_residual], ids=["position-offset", "residual"]
)
def test_a_mismatch_inside_the_served_head_is_named(
    random_target, examples, eagle3, monkeypatch, plant
):
    """A drafted level's position off by one, or the residual not normed: what the head was
    handed agrees, its drafts do not, and the check says so."""
    decode = DecodeConfig(gamma=3)
    honest = [s.tau for s in serve(random_target, eagle3, examples, decode)]
    plant(eagle3, monkeypatch)
    sim, real = (f(random_target, eagle3, examples, decode) for f in (simulate, serve))
    assert [s.tau for s in sim] == honest != [s.tau for s in real]
    found = [first_difference(random_target, eagle3, e, decode) for e in examples]
    named = [f for f in found if f is not None]
    assert named and all(f.startswith("the drafter's drafts after position") for f in named)
    assert all("the captured inputs agree" in f for f in named)


def test_a_scaled_embedding_in_the_serving_target_is_named(
    random_target, examples, eagle3, monkeypatch
):
    """The target's token embedding scaled in the loop's forwards only (as a Gemma-style
    normalizer applied by one implementation and not the other): the hidden states the head is
    handed differ from those it trained on, named by layer and position."""
    forward = type(random_target).forward_with_grad
    embed = random_target.model.get_input_embeddings()

    def planted(self, input_ids, **kwargs):
        if kwargs.get("cache") is None:  # training's forward over the whole sequence
            return forward(self, input_ids, **kwargs)
        hook = embed.register_forward_hook(lambda module, args, out: out * 1.5)
        try:
            return forward(self, input_ids, **kwargs)
        finally:
            hook.remove()

    monkeypatch.setattr(type(random_target), "forward_with_grad", planted)
    found = first_difference(random_target, eagle3, examples[0], DecodeConfig(gamma=3))
    assert found.startswith("captured hidden states, target layer 1, position 0: served")
    assert "differ by up to" in found


def test_a_replayed_session_that_drafts_otherwise_is_named(
    random_target, examples, eagle3, monkeypatch
):
    """Settings simulated by replaying the serving session (int8 drafting weights): where the
    replay drafts otherwise than the loop after the same context, the check names that draft,
    beside what the loop drafted."""

    from specdraft.simulation import serving_parity

    verified = serving_parity._verified_states

    def planted(*args):  # the replay hands the session other hidden states than the loop
        return {k: v.roll(1, dims=-1) for k, v in verified(*args).items()}

    monkeypatch.setattr(serving_parity, "_verified_states", planted)
    decode = DecodeConfig(gamma=3, draft_weights="int8")
    found = [first_difference(random_target, eagle3, e, decode) for e in examples]
    named = [f for f in found if f is not None]
    assert named and all(f.startswith("the serving session's drafts after position") for f in named)
    assert all("replayed on the continuation" in f for f in named)


@pytest.mark.parametrize(
    ("kind", "settings"),
    [("eagle3", dict(gamma=3, tree_top_k=3, tree_budget=8)),
     ("eagle1", dict(gamma=2, tree_top_k=2, lookup_ngram=1)),
     ("distill", dict(gamma=3, tree_top_k=2, tree_budget=6)),
     ("distill", dict(gamma=2, dynamic_gamma=True)),
     ("eagle3", dict(gamma=3, draft_weights="int8")),
     ("medusa", dict(gamma=3, tree_top_k=2, draft_weights="int8"))],
    ids=["eagle3-dynamic-tree", "eagle1-tree-copying", "two-model-tree", "dynamic-gamma",
         "eagle3-int8", "medusa-tree-int8"],
)  # fmt: skip
def test_the_serving_session_replayed_equals_served(
    random_target, examples, kind_drafter, kind, settings
):
    """Settings the training path has no served drafts for (EAGLE-2's dynamic tree, the two-model
    tree, dynamic gamma), or computes otherwise than serving (int8 drafting weights, which its
    full-precision modules do not round), are simulated by walking the serving session on the
    continuations (serving_parity.replay_serving): the loop's statistics exactly, with no target pass
    per step."""
    drafter = kind_drafter(kind)
    decode = drafter.decode_settings(None, **settings)
    batch = example_batch(examples[0], random_target.device)
    target_out = random_target.forward(batch["input_ids"], capture_layers=drafter.capture_layers)
    assert training_path_drafts(drafter, batch, target_out, decode) is None  # the replay's
    simulated = simulate(random_target, drafter, examples, decode)
    served = serve(random_target, drafter, examples, decode)
    for sim, real in zip(simulated, served, strict=True):
        assert (sim.tau, sim.reached_at, sim.accepted_at) == (
            real.tau,
            real.reached_at,
            real.accepted_at,
        )
        assert (sim.drafted, sim.copied_passes) == (real.drafted, real.copied_passes)
    assert sum(s.accepted for s in served) > 0


def test_a_session_on_the_target_cache_is_not_replayed(random_target, examples, kind_drafter):
    """LayerSkip drafts on the loop's own KV cache, which only the target's passes keep: the
    replay says it cannot (its chains have the training path's served drafts)."""
    drafter = kind_drafter("layerskip")
    batch = example_batch(examples[0], random_target.device)
    target_out = random_target.forward(batch["input_ids"])
    decode = drafter.decode_settings(DecodeConfig(gamma=3))
    assert replay_serving(random_target, drafter, batch, target_out, decode) is None
