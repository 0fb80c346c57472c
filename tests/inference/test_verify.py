"""Acceptance rules: greedy matches the target's argmax path, and speculative sampling emits
exactly the target's distribution (chains, trees of sampled or deterministic children, with and
without top-p), checked by a chi-square test that is also shown to catch a lossy sampler."""

from __future__ import annotations

import functools

import pytest
import torch
from spec_helpers import chi_square_p_value

from specdraft.core import DraftTree, SamplingSettings, path_to
from specdraft.drafting import process_logits
from specdraft.inference.verify import verify_greedy, verify_sampling

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

# -- greedy ------------------------------------------------------------------------------------


def test_greedy_chain_accepts_the_agreeing_prefix_then_corrects():
    chain = DraftTree.chain(torch.tensor([[7, 8, 9]]))
    assert verify_greedy(chain, [7, 8, 5, 1]) == ([0, 1], 5)  # third draft wrong: corrected to 5
    assert verify_greedy(chain, [7, 8, 9, 4]) == ([0, 1, 2], 4)  # all accepted: bonus 4
    assert verify_greedy(chain, [3, 8, 9, 4]) == ([], 3)


def test_greedy_tree_follows_the_matching_branch():
    #   root -> 0:a(1) 1:b(2);  0 -> 2:c(3);  1 -> 3:d(4) 4:e(5)
    tree = DraftTree(torch.tensor([[1, 2, 3, 4, 5]]), [-1, -1, 0, 1, 1], [1, 1, 2, 2, 2])
    # the target wants 2 at the root, 5 after it, 6 after that
    target = [2, 9, 5, 9, 9, 6]
    assert verify_greedy(tree, target) == ([1, 4], 6)


# -- logits processing ----------------------------------------------------------------------


def test_process_logits_temperature_top_k_top_p():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = process_logits(logits, SamplingSettings(temperature=1.0))
    torch.testing.assert_close(p, logits.softmax(-1))
    p = process_logits(logits, SamplingSettings(temperature=2.0))
    torch.testing.assert_close(p, (logits / 2).softmax(-1))
    p = process_logits(logits, SamplingSettings(temperature=1.0, top_k=2))
    torch.testing.assert_close(p, torch.cat([torch.tensor([2.0, 1.0]).softmax(-1), torch.zeros(2)]))
    full = logits.softmax(-1)  # [0.644, 0.237, 0.087, 0.032]
    p = process_logits(logits, SamplingSettings(temperature=1.0, top_p=0.85))
    assert (p > 0).tolist() == [True, True, False, False]  # 0.644 < 0.85 <= 0.881
    torch.testing.assert_close(p[:2], full[:2] / full[:2].sum())
    p = process_logits(logits, SamplingSettings(temperature=1.0, top_p=0.5))
    assert (p > 0).tolist() == [True, False, False, False]


# -- lossless sampling: a statistical test -------------------------------------------------------
#
# A toy target and a toy draft over V = 4 tokens give a distribution for every context. We emit
# two tokens by speculative sampling (as the loop does: verify, emit, draft again if needed) many
# times and compare the joint of (y1, y2) with the target's p(y1) p(y2 | y1) by a chi-square test.
# FALSE_ALARM is the chance that a correct sampler fails one test; seeds are fixed, so each test's
# outcome is reproducible.

V = 4
TRIALS = 6000
FALSE_ALARM = 1e-3


@functools.cache
def toy_logits(salt: int, context: tuple[int, ...]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(hash((salt, *context)) % 2**31)
    return torch.randn(V, generator=gen) * 1.5


@functools.cache
def p_of(context: tuple[int, ...], top_p: float) -> torch.Tensor:
    return process_logits(toy_logits(0, context), SamplingSettings(temperature=1.0, top_p=top_p))


@functools.cache
def q_of(context: tuple[int, ...]) -> torch.Tensor:
    return toy_logits(1, context).softmax(-1)  # no top-p: q has mass where p has none


def draft_chain(context, gen):
    tokens, qs = [], []
    for _ in range(2):
        q = q_of(context + tuple(tokens))
        tokens.append(int(torch.multinomial(q, 1, generator=gen)))
        qs.append(q)
    return DraftTree.chain(torch.tensor([tokens]), torch.stack(qs)[None])


def draft_sampled_tree(context, gen):
    """Three root children drawn i.i.d. from q (repeats allowed), each with one drawn child."""
    tokens, parents, depths, qs = [], [], [], []
    q0 = q_of(context)
    for _ in range(3):
        tokens.append(int(torch.multinomial(q0, 1, generator=gen)))
        parents.append(-1), depths.append(1), qs.append(q0)
    for parent in range(3):
        q1 = q_of((*context, tokens[parent]))
        tokens.append(int(torch.multinomial(q1, 1, generator=gen)))
        parents.append(parent), depths.append(2), qs.append(q1)
    return DraftTree(torch.tensor([tokens]), parents, depths, torch.stack(qs)[None])


def draft_topk_tree(context, gen):
    """Deterministic: the draft's top 2 at the root, each with its top child (point masses)."""
    first = q_of(context).topk(2).indices.tolist()
    second = [int(q_of((*context, t)).argmax()) for t in first]
    return DraftTree(torch.tensor([first + second]), [-1, -1, 0, 1], [1, 1, 2, 2], None)


def emit_two(draft, top_p: float, gen: torch.Generator, verify=verify_sampling) -> tuple[int, int]:
    emitted: list[int] = []
    while len(emitted) < 2:
        context = tuple(emitted)
        tree = draft(context, gen)
        tokens = tree.tokens[0].tolist()
        rows = [p_of(context, top_p)] + [
            p_of(context + tuple(tokens[i] for i in path_to(n, tree.parents)), top_p)
            for n in range(len(tree))
        ]
        path, nxt = verify(tree, torch.stack(rows), gen)
        emitted += [tokens[i] for i in path] + [nxt]
    return emitted[0], emitted[1]


def joint_counts(draft, top_p, seed, verify=verify_sampling):
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V)
    for _ in range(TRIALS):
        y1, y2 = emit_two(draft, top_p, gen, verify)
        counts[y1, y2] += 1
    exact = p_of((), top_p)[:, None] * torch.stack([p_of((y,), top_p) for y in range(V)])
    return counts, exact


@pytest.mark.parametrize("top_p", [1.0, 0.8])
@pytest.mark.parametrize("draft", [draft_chain, draft_sampled_tree, draft_topk_tree])
def test_speculative_sampling_emits_the_target_distribution(draft, top_p):
    counts, exact = joint_counts(draft, top_p, seed=1234)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > FALSE_ALARM


def accept_every_draft(tree, p, gen):
    """A lossy verifier (keeps the draft whatever the target says), to show the test's power."""
    path = path_to(len(tree) - 1, tree.parents)
    return path, int(torch.multinomial(p[len(tree)], 1, generator=gen))


def correct_from_p_not_residual(tree, p, gen):
    """A subtly lossy verifier: after a rejection it samples from p instead of the residual."""
    path, nxt = verify_sampling(tree, p, gen)
    node = path[-1] if path else -1
    if node in tree.parents:  # some child was rejected here
        nxt = int(torch.multinomial(p[node + 1], 1, generator=gen))
    return path, nxt


@pytest.mark.parametrize("lossy", [accept_every_draft, correct_from_p_not_residual])
def test_the_statistical_test_catches_a_lossy_sampler(lossy):
    counts, exact = joint_counts(draft_chain, 1.0, seed=1234, verify=lossy)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) < FALSE_ALARM


def test_sampling_is_reproducible_for_a_seed():
    draws = [
        [emit_two(draft_chain, 1.0, torch.Generator().manual_seed(s)) for s in range(20)]
        for _ in range(2)
    ]
    assert draws[0] == draws[1]
    assert len(set(draws[0])) > 1


@pytest.mark.parametrize("sampled", [True, False], ids=["q", "point-masses"])
def test_the_vectorised_chain_returns_exactly_what_the_tree_walk_returns(sampled):
    """Chains are verified on the device with one host sync; for every seed the result must be
    the tree walk's, token for token (same uniforms, same comparisons, same residual)."""
    from specdraft.inference.verify import _verify_chain, _verify_tree

    torch.manual_seed(0)
    vocab, agree, reject = 7, 0, 0
    for case in range(300):
        n = case % 5  # empty chains too
        p = torch.softmax(torch.randn(n + 1, vocab) * 2, -1)
        # a draft close to the target at most positions, so both outcomes occur often
        q = torch.softmax(p[:n].log() + torch.randn(n, vocab), -1)[None] if sampled else None
        tokens = torch.multinomial(p[:n], 1).T if n else torch.zeros(1, 0, dtype=torch.long)
        if sampled and n:
            tokens = torch.multinomial(q[0], 1).T
            if case % 7 == 0:  # a token the draft gives no mass must never be accepted
                q[0, 0], tokens[0, 0] = 0.0, 0
                q[0, 0, 1] = 1.0
        tree = DraftTree.chain(tokens, q)
        chain = _verify_chain(tree, p, torch.Generator().manual_seed(case))
        walk = _verify_tree(tree, p, torch.Generator().manual_seed(case))
        assert chain == walk, (case, chain, walk)
        agree += len(chain[0])
        reject += len(chain[0]) < n
    assert agree > 100 and reject > 50  # both outcomes are compared, many times
