"""The T = 1 estimate of training predicts serving (simulation/serving_parity.py, sampled_tau_on): the
loop's walk in expectation over each draft's chance of acceptance given the tokens emitted."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import KINDS, PROMPTS, build, perturbed

from specdraft.core import DecodeConfig, DraftTree, SamplingSettings
from specdraft.drafters.position_tree import TreeShape, _child_acceptance, sampled_tree
from specdraft.drafters.served import sampled_reach, served_drafts
from specdraft.inference.metrics import expected_passes, simulate_serving
from specdraft.inference.verify import verify_sampling
from specdraft.kinds.distill.distill import DistillDrafter
from specdraft.simulation.serving_parity import example_batch, sampled_tau_on, served_sampled_tau

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py says why


@pytest.mark.parametrize("kind", KINDS)
def test_the_walk_in_expectation_of_sure_outcomes_is_the_greedy_walk(
    random_target, examples, kind_drafter, kind
):
    """Where every draft's chance is 0 or 1 (greedy agreement), the expected passes are the
    passes simulate_serving counts, step for step, stop rule and the end of the output included."""
    drafter = kind_drafter(kind)
    for decode in (DecodeConfig(gamma=3), DecodeConfig(gamma=4, stop_below=0.4)):
        decode = drafter.decode_settings(decode)
        for example in examples:
            batch = example_batch(example, random_target.device)
            target_out = random_target.forward(
                batch["input_ids"], capture_layers=list(drafter.capture_layers)
            )
            drafts = served_drafts(drafter, batch, target_out, decode)
            deepest = drafts.accepted[..., -1:]  # (1, seq, 1): what the longest draft accepts
            reach = (deepest >= torch.arange(1, drafts.gamma + 1)).float()
            walked = simulate_serving(drafts, batch, decode, drafter.drafts_after_prefill)
            expected = expected_passes(reach, batch, drafter.drafts_after_prefill)
            assert [(s.new_tokens, float(s.target_passes)) for s in walked] == expected


@pytest.mark.parametrize("gamma, topk", [(3, 1), (3, 2)], ids=["chain", "tree"])
def test_a_lossy_acceptance_rule_has_no_sampled_walk(
    random_target, examples, kind_drafter, gamma, topk
):
    """Medusa's typical acceptance is not lossless (DecodeConfig.lossless): the walk in
    expectation assumes the loop emits what the target samples, so it gives None there, for
    chains and trees, and a reach where the same heads verify exactly."""
    drafter = kind_drafter("medusa")
    batch = example_batch(examples[0], random_target.device)
    target_out = random_target.forward(
        batch["input_ids"], capture_layers=list(drafter.capture_layers)
    )
    exact = drafter.decode_settings(DecodeConfig(gamma=gamma, tree_top_k=topk))
    typical = exact.replace(acceptance="typical")
    assert exact.lossless and not typical.lossless
    assert sampled_reach(drafter, batch, target_out, typical) is None
    assert sampled_reach(drafter, batch, target_out, exact) is not None


def test_a_childs_chance_given_the_token_is_the_loops(random_target):
    """Children drawn without replacement and verified by recursive rejection, as the loop
    does it (sampled_tree, verify_sampling): how often child m is accepted holding x, over
    how often x is emitted, is _child_acceptance's figure for every child and token."""
    torch.manual_seed(0)
    V, width, trials = 8, 3, 20000
    logits = torch.randn(1, V) * 1.5  # the drafter's
    p = torch.randn(V).mul(1.5).softmax(-1)  # the target's at the root
    shape = TreeShape.from_paths([(0,), (1,), (2,)])
    sampling = SamplingSettings(temperature=1.0)
    generator = torch.Generator().manual_seed(1)
    hits = torch.zeros(width, V)
    emitted = torch.zeros(V)
    for _ in range(trials):
        tree: DraftTree = sampled_tree(logits, shape, sampling, None, generator)
        rows = torch.cat([p[None], p[None].expand(len(tree), V)])  # below: never read
        path, token = verify_sampling(tree, rows, generator)
        if path:
            x = int(tree.tokens[0, path[0]])
            hits[path[0], x] += 1
            emitted[x] += 1
        else:
            emitted[token] += 1
    q = logits[0].softmax(-1)
    for x in range(V):
        if p[x] < 0.05:  # too rare to count well
            continue
        chance = _child_acceptance(q, p, x, width, 4096, torch.Generator().manual_seed(2))
        counted = hits[:, x] / (trials * p[x])
        assert torch.tensor(chance) == pytest.approx(counted, abs=0.03)
        assert emitted[x] / trials == pytest.approx(float(p[x]), abs=0.015)  # lossless


def test_a_drafter_that_is_the_target_is_expected_to_serve_what_it_serves(random_target):
    """A drafter that is the target accepts every draft (q = p): the expected walk is then
    the loop's, pass for pass, on the continuation it samples with the same seed."""
    prompts = [torch.tensor([p]) for p in PROMPTS]
    same = DistillDrafter(copy.deepcopy(random_target.model))
    decode = DecodeConfig(gamma=4)
    estimate = sampled_tau_on(random_target, same, prompts, 16, decode, seed=0)
    served = served_sampled_tau(random_target, same, prompts, 16, decode, seed=0)
    assert estimate == pytest.approx(served, rel=1e-9)
    other = DistillDrafter(perturbed(random_target.model, scale=0.05, seed=1))
    assert 1 < sampled_tau_on(random_target, other, prompts, 16, decode) < estimate


def test_medusa_trees_at_temperature_1_accept_more_than_their_chains(random_target, examples):
    """The tree the heads are served with at T = 1 holds the chain's first child and more
    children beside it: its expected tau is above the chain's on the same continuations."""
    heads = build("medusa", random_target, examples)
    prompts = [torch.tensor([p]) for p in PROMPTS]
    chain = sampled_tau_on(random_target, heads, prompts, 16, DecodeConfig(gamma=3))
    tree = sampled_tau_on(
        random_target, heads, prompts, 16, DecodeConfig(gamma=3, tree_top_k=3, tree_budget=12)
    )
    assert 1 < chain < tree
