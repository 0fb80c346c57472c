"""Block drafters' sampling through the loop (DFlash, and DSpark's block drafted through its
Markov head): output follows the target's distribution when both first tokens come from one
drafted block (chi-square), and a verifier that keeps every draft fails the same check (the
test's power)."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import chi_square_p_value, first_two_joint, make_target, tiny_llama

from specdraft.core import SamplingSettings
from specdraft.inference import generate
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = [pytest.mark.exact, pytest.mark.usefixtures("one_thread")]

V = 6
SAMPLES = 1500
FALSE_ALARM = 1e-3


def accept_every_draft(tree, p, generator):
    """Lossy: keeps the whole drafted chain whatever the target says (the test's power)."""
    path = list(range(len(tree)))
    return path, int(torch.multinomial(p[len(tree)], 1, generator=generator))


def dflash(target):
    return DFlashDrafter.build(DFlashConfig(block_size=3), target)


def dspark(target):
    return DSparkDrafter.build(DSparkConfig(block_size=2, markov_rank=3), target)


@pytest.mark.parametrize(
    ("build", "lossy", "tree_top_k"),
    [(dflash, False, 1), (dflash, False, 2), (dflash, True, 1), (dspark, False, 1),
     (dspark, True, 1)],
    ids=["dflash-exact", "dflash-exact-tree", "dflash-accept-every-draft", "dspark-exact",
         "dspark-accept-every-draft"],
)  # fmt: skip
def test_sampled_output_follows_the_target(build, lossy, tree_top_k, monkeypatch):
    """Chi-square on the joint of the first two tokens, both drafted by one block (gamma 2): as a
    chain or as the tree of the slots' sampled candidates; DSpark's through the Markov head, so
    the second slot's q depends on the first slot's draw. A verifier that keeps every draft fails
    the same check."""
    import importlib

    if lossy:
        loop = importlib.import_module("specdraft.inference.generate")
        monkeypatch.setattr(loop, "verify_sampling", accept_every_draft)
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    torch.manual_seed(6)
    drafter = build(target).eval()
    with torch.no_grad():  # an untrained drafter that still drafts varied tokens
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.5)
        if build is dspark:
            drafter.markov_head.markov_w2.weight.mul_(4)  # a bias that matters
    prompt = [1, 2, 3]
    counts = torch.zeros(V, V)
    drafted = accepted = 0
    # the lossy verifier is caught with far fewer samples, and more only add power
    for seed in range(SAMPLES if not lossy else SAMPLES // 4):
        out = generate(target, prompt, drafter, max_new_tokens=3, temperature=1.3, seed=seed,
                       gamma=2, tree_top_k=tree_top_k, tree_budget=4)  # fmt: skip
        y1, y2 = out.tokens[0, :2].tolist()
        counts[y1, y2] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert drafted > 0 and accepted > 0
    settings = SamplingSettings(temperature=1.3)
    exact = first_two_joint(target, prompt, settings)
    p_value = chi_square_p_value(counts.flatten(), exact.flatten())
    assert p_value < FALSE_ALARM if lossy else p_value > FALSE_ALARM
