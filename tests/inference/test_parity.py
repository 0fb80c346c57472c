"""Training predicts serving: at temperature 0 the simulation of serving through a drafter's
training path (Drafter.served_drafts walked by metrics.simulate_serving) on the target's own
greedy continuation gives the loop's statistics exactly, for every kind, chains and Medusa's
tree; and scripts/parity.py's comparison finds planted train/serve mismatches and names them."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import fitted_medusa_heads, perturbed

from specdraft.core import DecodeConfig
from specdraft.drafters.dflash import DFlashConfig, DFlashDrafter
from specdraft.drafters.distill import DistillDrafter
from specdraft.drafters.eagle import EagleConfig, EagleDrafter, EagleSession
from specdraft.drafters.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.drafters.peagle import PEagleConfig, PEagleDrafter
from specdraft.inference.continuations import served_examples
from specdraft.inference.parity import first_difference, serve, simulate

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

PROMPTS = [[5, 17, 42, 99, 7, 230], [100, 3, 250, 7], [33, 33, 8, 301, 12, 6, 90]]
NEW = 24


def fitted(drafter, target, examples, steps: int = 25):
    """`drafter` fitted for a few Adam steps to the target's own continuations, so that its drafts
    are accepted often but not always."""
    torch.manual_seed(0)
    n = min(len(e.input_ids) for e in examples)
    ids = torch.tensor([e.input_ids[:n] for e in examples])
    ones = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": ones, "loss_mask": ones}
    out = target.forward(ids, capture_layers=drafter.capture_layers)
    opt = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=3e-3)
    for step in range(steps):
        b = dict(batch, example_index=torch.arange(len(ids)))
        b = drafter.prepare_batch(b, target, None, torch.Generator().manual_seed(step))
        loss, _ = drafter(b, out)
        opt.zero_grad()
        (loss / drafter.loss_tokens(b).clamp(min=1)).backward()
        opt.step()
    return drafter.eval()


@pytest.fixture(scope="module")
def examples(random_target, tmp_path_factory):
    prompts = [torch.tensor([p]) for p in PROMPTS]
    return served_examples(random_target, prompts, NEW, cache_dir=tmp_path_factory.mktemp("c"))


def build(kind: str, target, examples):
    torch.manual_seed(0)
    if kind == "distill":
        return DistillDrafter(perturbed(target.model, scale=0.05, seed=1))
    if kind == "layerskip":
        return LayerSkipDrafter(LayerSkipConfig(exit_layer=1), target.model).eval()
    if kind == "medusa":
        return fitted_medusa_heads(target, dict(num_heads=3), prompts=PROMPTS)
    if kind in ("eagle3", "eagle1"):
        cfg = EagleConfig(version=kind, ttt_steps=2)
        return fitted(EagleDrafter.build(cfg, target), target, examples)
    if kind == "peagle":
        cfg = PEagleConfig(num_depths=3, down_sample_ratio=1.0)
        return fitted(PEagleDrafter.build(cfg, target), target, examples)
    return fitted(
        DFlashDrafter.build(DFlashConfig(block_size=4, anchors=8), target), target, examples
    )


KINDS = ["distill", "layerskip", "medusa", "eagle3", "eagle1", "peagle", "dflash"]


@pytest.fixture(scope="module", params=KINDS)
def drafter(request, random_target, examples):
    return build(request.param, random_target, examples)


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
