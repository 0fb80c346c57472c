"""Medusa's typical acceptance, stated as lossy: the walk's rule on hand-made distributions, greedy
output unchanged at temperature 0, runs at T > 0 marked lossy (and caught by the same chi-square
check that passes lossless sampling), the mean log-likelihood that measures the drift, the report
marking, and clear errors for settings it cannot honour."""

from __future__ import annotations

import math

import pytest
import torch
from spec_helpers import MEDUSA_PROMPTS, chi_square_p_value, fitted_medusa_heads
from test_joint import CASES, FALSE_ALARM, exact_joint, sample_joint, target  # noqa: F401

from specdraft.core import DecodeConfig, DraftTree, SamplingSettings
from specdraft.drafting import process_logits
from specdraft.inference import generate
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaDecode
from specdraft.kinds.medusa.medusa_session import verify_typical
from specdraft.measuring.evaluation import EvalSpec
from specdraft.measuring.evaluation_report import make_report, markdown
from specdraft.measuring.measure import Run, loop_decoder, measure

PROMPTS = MEDUSA_PROMPTS
CHAIN = dict(gamma=3)
TREE = dict(gamma=3, tree_top_k=3, tree_budget=8)


def threshold(p: list[float], epsilon: float, delta: float) -> float:
    """min(epsilon, delta * exp(-H(p))), written out in float64."""
    entropy = -sum(x * math.log(x) for x in p if x > 0)
    return min(epsilon, delta * math.exp(-entropy))


def tree_of(tokens: list[int], parents: list[int]) -> DraftTree:
    depths: list[int] = []
    for parent in parents:
        depths.append(1 if parent < 0 else depths[parent] + 1)
    return DraftTree(torch.tensor([tokens]), parents, depths)


# --- the walk's rule, on hand-made p ------------------------------------------------------------

V = 8
# Nodes 0, 1, 2 below the root; 3 below 0; 4, 5 below 1; 6 below 5.
WALK_TREE = tree_of(tokens=[0, 2, 1, 1, 3, 0, 4], parents=[-1, -1, -1, 0, 1, 1, 5])
P_ROOT = [0.04, 0.3, 0.36, 0.3, 0, 0, 0, 0]  # node 0 (token 0) below, 1 and 2 above
P_NODE1 = [0.5, 0.3, 0.1, 0.05, 0.05, 0, 0, 0]  # node 4 (token 3) below, node 5 (token 0) above
P_NODE5 = [0, 0, 0, 0, 0.08, 0.2, 0.3, 0.42]  # node 6 (token 4) below: the walk ends at node 5
UNIFORM = [1 / V] * V


def walk_p() -> torch.Tensor:
    """(n + 1, V): row 0 the root's, row 1 + i node i's; node 0's child (token 1) would pass, but
    node 0 itself does not."""
    rows = [P_ROOT, UNIFORM, P_NODE1, UNIFORM, UNIFORM, UNIFORM, P_NODE5, UNIFORM]
    return torch.tensor(rows)


def test_the_hand_made_thresholds_are_not_borderline():
    """The cases below are decided by a clear margin, with delta's term the smaller one."""
    root, node1, node5 = (threshold(p, 0.09, 0.3) for p in (P_ROOT, P_NODE1, P_NODE5))
    assert all(t < 0.09 - 1e-3 for t in (root, node1, node5))  # delta * exp(-H) decides
    assert root - 0.04 > 0.04 and root + 0.2 < 0.3  # nodes 0 / 1, 2 at the root
    assert node1 - 0.03 > 0.05 and node1 < 0.5  # nodes 4 / 5 below node 1
    assert node5 - 0.005 > 0.08  # node 6 below node 5


def test_the_walk_takes_the_longest_passing_path():
    """At the root nodes 1 (p 0.36) and 2 (p 0.3) pass, and node 1 leads on to node 5 (node 4
    fails): [1, 5]; a rejected node's subtree (node 0's child 3) is never entered; node 6 fails.
    Between equally long paths the more likely child wins, and a longer path beats a more
    likely first step."""
    path, _ = verify_typical(WALK_TREE, walk_p(), None, epsilon=0.09, delta=0.3)
    assert path == [1, 5]
    # the root's children alone: nodes 0 (token 1, p 0.3) and 1 (token 2, p 0.36) pass, 1 wins
    flat = tree_of(tokens=[1, 2, 0], parents=[-1, -1, -1])
    path, _ = verify_typical(flat, walk_p()[:4], None, epsilon=0.09, delta=0.3)
    assert path == [1]
    # give the less likely token 1 the passing child: its path is longer and wins
    deeper = tree_of(tokens=[2, 1, 0], parents=[-1, -1, 1])
    p = torch.tensor([P_ROOT, UNIFORM, P_NODE1, UNIFORM])
    path, _ = verify_typical(deeper, p, None, epsilon=0.09, delta=0.3)
    assert path == [1, 2]


def longest_passing_path(rows, tokens, parents, eps, delta, decided_by) -> list[int]:
    """The rule written out: the longest root-to-node path of passing nodes, ties to the more
    likely child at the first place the paths part (float64)."""

    def best_from(node: int) -> list[int]:
        row = rows[node + 1]
        thr = threshold(row, eps, delta)
        decided_by["epsilon" if thr == eps else "delta"] += 1
        kids = [c for c, parent in enumerate(parents) if parent == node]
        assert all(abs(row[tokens[c]] - thr) > 1e-5 for c in kids)  # no float32 coin flips
        options = [[c, *best_from(c)] for c in kids if row[tokens[c]] > thr]
        return max(options, key=lambda o: (len(o), row[tokens[o[0]]]), default=[])

    return best_from(-1)


def test_the_token_after_the_path_is_drawn_from_p_at_the_last_accepted_node():
    """Over many draws, the token after [1, 5] follows node 5's row (chi-square), which alone
    gives tokens 5..7 any mass; with nothing accepted, it follows the root's row."""
    p = walk_p()
    counts = torch.zeros(V)
    for seed in range(2000):
        gen = torch.Generator().manual_seed(seed)
        path, nxt = verify_typical(WALK_TREE, p, gen, epsilon=0.09, delta=0.3)
        assert path == [1, 5]
        counts[nxt] += 1
    assert chi_square_p_value(counts, p[6]) > 1e-3
    rejected = tree_of(tokens=[0], parents=[-1])  # token 0 has p 0.04 at the root: below
    counts = torch.zeros(V)
    for seed in range(2000):
        path, nxt = verify_typical(rejected, p[:2], torch.Generator().manual_seed(seed),
                                   epsilon=0.09, delta=0.3)  # fmt: skip
        assert path == []
        counts[nxt] += 1
    assert chi_square_p_value(counts, p[0]) > 1e-3


def test_epsilon_caps_the_threshold_where_the_target_is_confident():
    """p = (0.85, 0.08, 0.07): delta * exp(-H) = 0.177, so epsilon decides token 1 (p 0.08)."""
    p = torch.tensor([[0.85, 0.08, 0.07], [1 / 3] * 3])
    one = tree_of(tokens=[1], parents=[-1])
    assert threshold([0.85, 0.08, 0.07], 1.0, 0.3) == pytest.approx(0.177, abs=1e-3)
    assert verify_typical(one, p, None, epsilon=0.09, delta=0.3)[0] == []
    assert verify_typical(one, p, None, epsilon=0.07, delta=0.3)[0] == [0]
    # where the target is unsure, delta's term decides: 16 equal tokens, threshold 0.3 / 16
    flat = torch.full((2, 16), 1 / 16)
    assert verify_typical(one, flat, None, epsilon=0.09, delta=0.3)[0] == [0]  # 0.0625 > 0.019
    assert verify_typical(one, flat, None, epsilon=0.09, delta=1.0)[0] == []  # 0.0625 = 1/16


def test_the_walk_matches_the_rule_on_random_distributions():
    """Random two-level trees and p rows (peaked and flat, with top-k zeros), checked against the
    rule computed independently in float64; both of the threshold's terms get to decide, and
    the longest path is not always the first passing child's."""
    gen = torch.Generator().manual_seed(0)
    decided_by = {"epsilon": 0, "delta": 0}
    longer_than_first = 0  # trials where the longest path does not start at the first passer
    for trial in range(200):
        parents = [-1] * V + [i for i in range(V) for _ in range(2)]
        tokens = torch.randperm(V, generator=gen).tolist()
        tokens += torch.randint(0, V, (2 * V,), generator=gen).tolist()
        scale = [0.5, 2.0, 4.0][trial % 3]
        logits = torch.randn(len(parents) + 1, V, generator=gen) * scale
        p = process_logits(logits, SamplingSettings(temperature=1.0, top_k=6))
        eps, delta = [(0.09, 0.3), (0.2, 0.5), (0.05, 1.0)][trial % 3]
        rows = p.double().tolist()
        expected = longest_passing_path(rows, tokens, parents, eps, delta, decided_by)
        thr = threshold(rows[0], eps, delta)
        first = next((c for c in range(V) if rows[0][tokens[c]] > thr), None)
        longer_than_first += bool(expected) and expected[0] != first
        path, _ = verify_typical(tree_of(tokens, parents), p, gen, epsilon=eps, delta=delta)
        assert path == expected
    assert min(decided_by.values()) > 20
    assert longer_than_first > 10


# --- through the loop ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def heads(random_target) -> MedusaDrafter:
    """Heads fitted to the target's greedy text after PROMPTS: drafts are accepted sometimes,
    and rejected."""
    return fitted_medusa_heads(random_target, dict(num_heads=3))


@pytest.mark.parametrize("decoding", [CHAIN, TREE], ids=["chain", "tree"])
def test_at_temperature_0_typical_is_greedy_decoding(random_target, heads, decoding):
    accepted = drafted = 0
    for prompt in PROMPTS:
        plain = generate(random_target, prompt, max_new_tokens=32)
        typical = generate(random_target, prompt, heads, max_new_tokens=32,
                           acceptance="typical", **decoding)  # fmt: skip
        assert typical.tokens.tolist() == plain.tokens.tolist()
        assert not typical.stats.lossy and typical.stats.mean_log_p is None
        accepted, drafted = accepted + typical.stats.accepted, drafted + typical.stats.drafted
    assert 0 < accepted < drafted  # not vacuous


@pytest.mark.parametrize("decoding", [CHAIN, TREE], ids=["chain", "tree"])
def test_at_temperature_above_0_typical_runs_and_is_marked_lossy(random_target, heads, decoding):
    for acceptance in ("exact", "typical"):
        accepted = 0
        for prompt in PROMPTS:
            out = generate(random_target, prompt, heads, max_new_tokens=24, temperature=0.7,
                           acceptance=acceptance, **decoding)  # fmt: skip
            assert out.tokens.shape == (1, 24)
            assert out.stats.lossy == (acceptance == "typical")
            assert out.stats.to_dict()["lossy"] == out.stats.lossy
            assert out.stats.mean_log_p is not None and out.stats.log_p_tokens == 24
            accepted += out.stats.accepted
        assert accepted > 0


@pytest.mark.parametrize(
    "options",
    [dict(acceptance="typical", **TREE), dict(acceptance="typical", **CHAIN), dict(**CHAIN)],
    ids=["typical-tree", "typical-chain", "exact-chain"],
)
def test_mean_log_p_is_the_targets_log_likelihood_of_the_output(random_target, heads, options):
    """Recomputed with one plain forward over prompt + output, each position's logits processed
    as the loop processes them (temperature and top-k here)."""
    sampling = SamplingSettings(temperature=0.8, top_k=40)
    prompt = PROMPTS[0]
    out = generate(random_target, prompt, heads, max_new_tokens=32, temperature=0.8, top_k=40,
                   seed=3, **options)  # fmt: skip
    new = out.tokens[0]
    ids = torch.tensor([prompt + new.tolist()])
    with torch.no_grad():
        logits = random_target.model(ids).logits[0, len(prompt) - 1 : -1]  # (32, vocab)
    p = process_logits(logits, sampling)
    direct = p.gather(-1, new[:, None]).log().mean().item()
    assert out.stats.accepted > 0  # emitted tokens came from draft paths, not only the root
    assert out.stats.mean_log_p == pytest.approx(direct, abs=1e-4)


def test_the_joint_check_catches_typical_acceptance(target, monkeypatch):  # noqa: F811
    """ "Lossy" is not a formality: test_joint.py's chi-square check of the first three tokens,
    which lossless verification of these Medusa trees passes, fails typical acceptance."""
    kind, decoding, sampling = CASES["medusa-tree"]
    counts, seen = sample_joint(target, kind, {**decoding, "acceptance": "typical"}, sampling)
    assert seen["accepted_2"] > 0
    assert chi_square_p_value(counts, exact_joint(target, sampling)) < FALSE_ALARM


def test_the_report_marks_lossy_runs(random_target, heads):
    spec = EvalSpec(max_new_tokens=12, temperature=0.7, seed=0, prompts="test")
    options = dict(max_new_tokens=12, temperature=0.7, seed=0)
    decoding = MedusaDecode(**TREE)
    runs = [
        Run("ar", "ar", loop_decoder(random_target, None, **options)),
        Run("heads", "medusa", loop_decoder(random_target, heads, decode=decoding, **options)),
        Run("heads:acceptance=typical", "medusa", loop_decoder(
            random_target, heads, decode=decoding.replace(acceptance="typical"), **options)),
    ]  # fmt: skip
    measure(runs, [torch.tensor([p]) for p in PROMPTS], random_target)
    report = make_report(spec, random_target, runs)
    rows = report["runs"]
    assert [r["lossy"] for r in rows] == [False, False, True]
    assert [r["label"] for r in rows] == ["ar", "heads", "medusa#1 (lossy)"]
    assert all(isinstance(r["mean_log_p"], float) for r in rows)
    md = markdown(report)
    assert "| mean log p | lossy |" in md
    assert md.count("| no |") == 2 and md.count("| yes |") == 1
    assert "**Lossy** (typical acceptance): medusa#1 (lossy)." in md


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["typical_epsilon", "typical_delta"])
@pytest.mark.parametrize("value", [0, 0.0, 1.5, -0.1])
def test_thresholds_outside_0_1_are_refused(random_target, heads, key, value):
    with pytest.raises(ValueError, match=rf"{key} must be a number in \(0, 1\]; got"):
        MedusaDecode(**{key: value})
    with pytest.raises(ValueError, match=rf"{key} must be a number in \(0, 1\]"):
        generate(random_target, [1, 2], heads, max_new_tokens=2, acceptance="typical",
                 **{key: value})  # fmt: skip
    MedusaDecode(**{key: 1.0})  # 1 itself is allowed


def test_typical_acceptance_needs_a_medusa_drafter(random_target, drafts):
    eagle = EagleDrafter.build(EagleConfig(), random_target).eval()
    for drafter, kind in [(eagle, "EAGLE "), (drafts["partial"], "two-model "),
                          ("prompt_lookup", "prompt_lookup ")]:  # fmt: skip
        for temperature in (0.0, 0.7):
            with pytest.raises(ValueError, match=(
                rf"acceptance='typical' is a Medusa drafter's decoding setting, which this {kind}"
                r"drafter does not take: drop acceptance, or use a Medusa drafter"
            )):  # fmt: skip
                generate(random_target, [1, 2], drafter, max_new_tokens=2,
                         temperature=temperature, acceptance="typical")  # fmt: skip
        with pytest.raises(ValueError, match="acceptance='typical' is a Medusa drafter's"):
            decode = MedusaDecode(acceptance="typical")
            generate(random_target, [1, 2], drafter, max_new_tokens=2, decode=decode)
    for settings in (dict(acceptance="typical"), dict(decode=MedusaDecode(acceptance="typical"))):
        with pytest.raises(ValueError, match=(
            r"acceptance='typical' needs a Medusa drafter, and plain decoding \(drafter=None\) "
            r"drafts nothing: pass a Medusa drafter, or drop acceptance"
        )):  # fmt: skip
            generate(random_target, [1, 2], None, max_new_tokens=2, **settings)
    # settings of the kind's own left at their defaults are no error (an older checkpoint's)
    assert EagleDrafter.decode_settings(MedusaDecode()) == DecodeConfig()


def test_lossless_sampling_is_untouched_by_the_typical_settings(random_target, heads):
    """acceptance=exact ignores the thresholds: the same tokens whatever they are."""
    runs = [
        generate(random_target, PROMPTS[1], heads, max_new_tokens=16, temperature=0.9, seed=5,
                 typical_epsilon=eps, typical_delta=delta, **TREE).tokens.tolist()
        for eps, delta in [(0.09, 0.3), (1.0, 1.0), (0.01, 0.01)]
    ]  # fmt: skip
    assert runs[0] == runs[1] == runs[2]
