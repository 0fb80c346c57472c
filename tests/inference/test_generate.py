"""The loop end to end: greedy output equals transformers' greedy `generate` for every drafter
(identical, partly agreeing, unrelated; chains and trees; prompt lookup), EOS and max_new_tokens
inside a draft, one-token prompts; sampled output follows the target's distribution; bad input is
a clear error. Every run checks that drafting happened, so none passes vacuously."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from spec_helpers import chi_square_p_value, first_two_joint, make_target, perturbed, tiny_llama
from testkit import perturb

from specdraft.core import DraftContext
from specdraft.inference import generate
from specdraft.inference.metrics import Stats
from specdraft.kinds.distill.distill import DistillDrafter

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

PROMPT = [5, 17, 42, 99, 7, 230]


def hf_greedy(target, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = target.model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
@pytest.mark.parametrize("draft", ["copy", "partial", "random"])
def test_greedy_equals_plain_greedy(random_target, drafts, draft, topk):
    ref = hf_greedy(random_target, PROMPT, 24)
    out = generate(
        random_target, PROMPT, drafts[draft], max_new_tokens=24, gamma=4, tree_top_k=topk
    )
    assert out.tokens[0].tolist() == ref
    s = out.stats
    assert s.drafted > 0 and s.new_tokens == 24
    if draft != "random":
        assert s.accepted > 0
    if draft == "partial":
        assert s.accepted < s.drafted and s.target_passes < 24
    assert s.tau == pytest.approx(24 / s.target_passes)


@pytest.mark.parametrize("weights", ["full", "int8"])
def test_distilled_chains_draft_through_the_lean_model(random_target, drafts, weights):
    """A Llama-layout student drafts chains through drafters/lean.py, alone and in a batch
    (trees through the HF model): same greedy output, and a copy of the target is still always
    right (full weights)."""
    from specdraft.core import DecodeConfig, SamplingSettings
    from specdraft.kinds.distill.distill_layers import LeanModel

    ref = hf_greedy(random_target, PROMPT, 24)
    for name in ("copy", "partial"):
        drafter = DistillDrafter(drafts[name])
        out = generate(
            random_target, PROMPT, drafter, max_new_tokens=24, gamma=4, draft_weights=weights
        )
        assert out.tokens[0].tolist() == ref and out.stats.accepted > 0
        if name == "copy" and weights == "full":
            assert out.stats.accepted == out.stats.drafted
    prompts = [PROMPT, PROMPT[2:], [9, 3]]  # a batch: lean's rows with masks where rows differ
    batch = generate(random_target, prompts, drafter, max_new_tokens=16, draft_weights=weights)
    assert batch.rows() == [hf_greedy(random_target, p, 16) for p in prompts]
    assert batch.stats.drafted > 0 and batch.stats.accepted > 0
    greedy = SamplingSettings()
    decode = DecodeConfig(gamma=3, draft_weights=weights)
    session = drafter.new_session(random_target, sampling=greedy, decode=decode)
    session.propose(DraftContext(torch.tensor([PROMPT]), max_depth=3))
    assert isinstance(session.rows.student, LeanModel) and session.extra_memory_bytes() > 0
    batch = drafter.new_batch_session(random_target, 3, sampling=greedy, decode=decode)
    assert batch.weights is not None  # a batch's chains too
    tree = drafter.new_session(random_target, sampling=greedy, decode=decode.replace(tree_top_k=2))
    assert tree.rows.weights is None  # trees keep the HF model and its DynamicCache
    w = drafter.drafting_weights(weights == "int8")
    assert drafter.drafting_weights(weights == "int8") is w  # built once, shared
    assert w.layers[0].qkv.int8 == (weights == "int8")


@pytest.mark.parametrize("topk", [1, 2], ids=["chain", "tree"])
def test_a_tree_the_student_did_not_propose_leaves_only_the_context(random_target, drafts, topk):
    """DraftSession.accept may get another drafter's tree: the two-model session keeps none of
    its own drafts then, and drafts on as a fresh session would."""
    from specdraft.core import DecodeConfig, DraftTree, SamplingSettings

    drafter = DistillDrafter(drafts["partial"])
    decode = DecodeConfig(gamma=3, tree_top_k=topk)
    session = drafter.new_session(random_target, sampling=SamplingSettings(), decode=decode)
    assert len(session.propose(DraftContext(torch.tensor([PROMPT]), max_depth=4))) > 0
    session.accept(DraftTree.chain(torch.tensor([[1, 2]])), [0, 1])  # not its tree
    assert int(session.rows.cache.lengths[0]) == session.rows.student.length == len(PROMPT)
    longer = DraftContext(torch.tensor([[*PROMPT, 1, 2, 3]]), max_depth=4)
    fresh = drafter.new_session(random_target, sampling=SamplingSettings(), decode=decode)
    assert session.propose(longer).tokens.tolist() == fresh.propose(longer).tokens.tolist()


def test_a_copy_of_the_target_accepts_every_draft(random_target, drafts):
    gamma = 4
    out = generate(
        random_target, PROMPT, drafts["copy"], max_new_tokens=3 * (gamma + 1), gamma=gamma
    )
    s = out.stats
    assert out.tokens[0].tolist() == hf_greedy(random_target, PROMPT, 3 * (gamma + 1))
    assert s.tau == gamma + 1 and s.target_passes == 3
    assert s.accepted == s.drafted == 3 * gamma
    assert s.acceptance_per_position == [1.0] * gamma
    assert s.drafter_params > 0 and s.drafter_kv_bytes > 0


def test_plain_decoding_through_the_loop(random_target):
    out = generate(random_target, PROMPT, None, max_new_tokens=16)
    assert out.tokens[0].tolist() == hf_greedy(random_target, PROMPT, 16)
    assert out.stats.tau == 1.0 and out.stats.drafted == 0 and out.stats.target_passes == 16


def test_dynamic_gamma_is_still_exact(random_target, drafts):
    ref = hf_greedy(random_target, PROMPT, 30)
    for name in ("copy", "partial"):
        out = generate(random_target, PROMPT, drafts[name], max_new_tokens=30, dynamic_gamma=True)
        assert out.tokens[0].tolist() == ref
        assert out.stats.drafted > 0 and out.stats.accepted > 0
    # a draft that is always right grows gamma: later drafts are deeper than the first
    copy_run = generate(
        random_target, PROMPT, drafts["copy"], max_new_tokens=30, gamma=2, dynamic_gamma=True
    )
    assert len(copy_run.stats.acceptance_per_position) > 2


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_copying_before_a_two_model_draft_is_exact(random_target, drafts, topk):
    """lookup_ngram puts prompt lookup in front of any drafter: where the context repeats, the
    draft is copied (no draft-model pass); elsewhere the student drafts; its KV cache catches up
    on the copied tokens at its next proposal. Greedy output stays the target's."""
    prompt = PROMPT * 3  # a context that repeats
    ref = hf_greedy(random_target, prompt, 30)
    for name in ("partial", "random"):
        out = generate(
            random_target, prompt, drafts[name], max_new_tokens=30, gamma=4, tree_top_k=topk,
            lookup_ngram=2,
        )  # fmt: skip
        s = out.stats
        assert out.tokens[0].tolist() == ref
        assert s.copies and 0 < s.copied_passes < s.target_passes
        assert s.drafted > 0 and s.accepted > 0


def test_copies_run_to_lookup_gamma_while_the_drafter_drafts_gamma(random_target, drafts):
    """lookup_gamma caps copied drafts apart from the drafter's own chains: with gamma 2 the
    student drafts 2 tokens, while a copy of the repeating context runs up to 7; without it a
    copy stops at gamma like the student. Output stays the target's either way."""
    prompt = PROMPT * 3
    ref = hf_greedy(random_target, prompt, 30)
    depths = {}
    for lookup_gamma in (0, 7):
        steps = []
        record = Stats.record_step

        def spy(stats, drafted, depth, *args, _steps=steps, _record=record):
            _steps.append(depth)
            return _record(stats, drafted, depth, *args)

        with pytest.MonkeyPatch.context() as m:
            m.setattr(Stats, "record_step", spy)
            out = generate(
                random_target, prompt, drafts["partial"], max_new_tokens=30, gamma=2,
                lookup_ngram=2, lookup_gamma=lookup_gamma,
            )  # fmt: skip
        assert out.tokens[0].tolist() == ref and out.stats.copied_passes > 0
        depths[lookup_gamma] = max(steps)
    assert depths[0] == 2 and 2 < depths[7] <= 7


def test_prompt_lookup_is_exact_and_drafts_from_the_context(tiny_target):
    # the tiny demo target repeats itself, which is what prompt lookup feeds on
    prompt = tiny_target.tokenizer("def foo(x):\n    return x\n", return_tensors="pt").input_ids
    ref = tiny_target.model.generate(prompt, max_new_tokens=40, do_sample=False)
    out = generate(tiny_target, prompt, "prompt_lookup", max_new_tokens=40)
    assert out.tokens[0].tolist() == ref[0, prompt.shape[1] :].tolist()
    assert out.stats.drafted > 0 and out.stats.accepted > 0


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_max_new_tokens_inside_a_draft(random_target, drafts, topk):
    # gamma 5 with a perfect draft emits 6 per pass: 8 ends inside the second draft
    out = generate(
        random_target, PROMPT, drafts["copy"], max_new_tokens=8, gamma=5, tree_top_k=topk
    )
    assert out.tokens[0].tolist() == hf_greedy(random_target, PROMPT, 8)
    assert out.stats.new_tokens == 8 and out.stats.accepted > 0


@pytest.mark.parametrize("topk", [1, 3], ids=["chain", "tree"])
def test_eos_inside_a_draft_ends_the_output(random_target, drafts, topk):
    ref = hf_greedy(random_target, PROMPT, 20)
    eos = ref[8]  # falls inside the second draft of a perfect gamma-5 drafter
    first = ref.index(eos)
    config = random_target.model.generation_config
    config.eos_token_id = [383, eos]  # a list, as many chat models have
    try:
        out = generate(
            random_target, PROMPT, drafts["copy"], max_new_tokens=20, gamma=5, tree_top_k=topk
        )
        hf = hf_greedy(random_target, PROMPT, 20)
    finally:
        config.eos_token_id = None
    assert out.tokens[0].tolist() == ref[: first + 1] == hf[: first + 1]
    assert out.stats.drafted > 0 and out.stats.accepted > 0


@pytest.mark.parametrize("drafter", ["copy", "prompt_lookup"])
def test_one_token_prompt(random_target, drafts, drafter):
    draft = drafts.get(drafter, drafter)
    out = generate(random_target, [42], draft, max_new_tokens=20, gamma=3)
    assert out.tokens[0].tolist() == hf_greedy(random_target, [42], 20)
    assert out.stats.drafted > 0 and out.stats.accepted > 0


def test_the_trained_tiny_target_and_its_copy(tiny_target):
    ids = tiny_target.tokenizer("import os\n", return_tensors="pt").input_ids
    ref = tiny_target.model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1] :]
    out = generate(
        tiny_target,
        ids,
        DistillDrafter(copy.deepcopy(tiny_target.model)),
        max_new_tokens=12,
        gamma=3,
    )
    assert out.tokens[0].tolist() == ref.tolist()
    assert out.stats.drafted > 0 and out.stats.accepted > 0


# -- sampling ---------------------------------------------------------------------------------

V = 6
SAMPLES = 1500
FALSE_ALARM = 1e-3  # the chance that a correct sampler fails one test


@pytest.fixture(scope="module")
def small_vocab():
    """A random target over 6 tokens and two drafts: a noisy copy and an unrelated model."""
    target = make_target(tiny_llama(V, seed=3, hidden=16, layers=1, init=0.5))
    noisy = perturbed(target.model, 0.3, seed=4)
    return target, {"noisy": noisy, "other": tiny_llama(V, 5, 16, 1), "noisy-int8": noisy}


# Decoding settings a draft of small_vocab is run with beside those a test passes.
SETTINGS = {"noisy-int8": {"draft_weights": "int8"}}  # lean chains, int8 weights


def exact_joint(target, prompt, temperature, top_p, top_k) -> torch.Tensor:
    """(V, V) the target's probability of each first two tokens, after processing."""
    from specdraft.core import SamplingSettings

    settings = SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k)
    return first_two_joint(target, prompt, settings)


@pytest.mark.parametrize(
    ("draft", "topk", "top_p", "top_k", "lookup"),
    [
        ("noisy", 1, 1.0, 0, 0),
        ("noisy", 2, 1.0, 0, 0),
        ("other", 1, 0.8, 0, 0),
        ("noisy", 2, 0.8, 0, 0),
        ("noisy", 1, 1.0, 3, 0),
        ("noisy-int8", 1, 1.0, 0, 0),
        ("noisy", 1, 1.0, 0, 1),
    ],
    ids=["chain", "tree", "chain-top_p", "tree-top_p", "chain-top_k", "int8-chain", "lookup"],
)
def test_sampled_output_follows_the_target(small_vocab, draft, topk, top_p, top_k, lookup):
    """Chi-square on the joint of the first two tokens over SAMPLES seeds (FALSE_ALARM). Three
    tokens are asked for, so the first draft is two deep and both tokens can come from it. With
    lookup, prompt lookup copies where the context repeats and the two-model draft samples
    elsewhere."""
    target, drafts = small_vocab
    prompt = [1, 2, 3]
    counts = torch.zeros(V, V)
    drafted = accepted = copied = 0
    for seed in range(SAMPLES):
        out = generate(
            target,
            prompt,
            drafts[draft],
            max_new_tokens=3,
            temperature=1.3,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            gamma=2,
            tree_top_k=topk,
            lookup_ngram=lookup,
            **SETTINGS.get(draft, {}),
        )
        y1, y2 = out.tokens[0, :2].tolist()
        counts[y1, y2] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
        copied += out.stats.copied_passes
    assert drafted > 0 and accepted > 0
    assert (copied > 0) == (lookup > 0)
    exact = exact_joint(target, prompt, 1.3, top_p, top_k)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > FALSE_ALARM


@pytest.mark.parametrize(
    "options",
    [dict(tree_top_k=1, draft_weights="int8", stop_below=0.3), dict(tree_top_k=2, tree_budget=4),
     dict(tree_top_k=1, lookup_ngram=1)],
    ids=["stopping-int8-chain", "tree", "lookup-then-head"],
)  # fmt: skip
def test_sampled_output_through_an_eagle_head_follows_the_target(small_vocab, options):
    """The same chi-square through EAGLE drafting: a chain that stops after unsure positions and
    drafts with int8 weights (its q recorded per token), a dynamic tree (point-mass children),
    and a chain that copies from the context where it can (point masses) and samples otherwise."""
    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter

    target, _ = small_vocab
    torch.manual_seed(6)
    head = EagleDrafter.build(EagleConfig(), target).eval()
    perturb(head.parameters(), 0.5)  # an untrained head that still drafts varied tokens
    prompt = [1, 2, 3]
    counts = torch.zeros(V, V)
    drafted = accepted = 0
    for seed in range(SAMPLES):
        out = generate(
            target, prompt, head, max_new_tokens=3, temperature=1.3, seed=seed, gamma=2, **options
        )
        y1, y2 = out.tokens[0, :2].tolist()
        counts[y1, y2] += 1
        drafted, accepted = drafted + out.stats.drafted, accepted + out.stats.accepted
    assert drafted > 0 and accepted > 0
    exact = exact_joint(target, prompt, 1.3, 1.0, 0)
    assert chi_square_p_value(counts.flatten(), exact.flatten()) > FALSE_ALARM


def test_sampling_is_reproducible(random_target, drafts):
    runs = [
        generate(
            random_target, PROMPT, drafts["partial"], max_new_tokens=12, temperature=1.0, seed=s
        )
        .tokens[0]
        .tolist()
        for s in (7, 7, 8)
    ]
    assert runs[0] == runs[1] != runs[2]


# -- bad input --------------------------------------------------------------------------------


def test_bad_input_is_a_clear_error(random_target, drafts):
    t, d = random_target, drafts["copy"]
    cases = [
        (dict(input_ids=[]), "prompt is empty"),
        (dict(input_ids=list(range(1, 250)), max_new_tokens=10), "exceeds the target's 256"),
        (dict(max_new_tokens=0), "max_new_tokens must be"),
        (dict(temperature=-0.5), "temperature must be >= 0"),
        (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
        (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
        (dict(drafter=tiny_llama(100, seed=6)), "vocabulary of 100 tokens"),
        (dict(drafter="medusa-please"), "unknown drafter"),
        (dict(gamma=0), "gamma must be an integer >= 1"),
        (dict(gamma=2.5), "gamma must be an integer >= 1"),
        (dict(tree_top_k=2, tree_budget=0), "tree_budget must be"),
        (dict(stop_below=1.5), r"stop_below must be a number in \[0, 1\)"),
        (dict(draft_weights="int4"), "draft_weights='int4' is not one of: full | int8"),
        (dict(lookup_ngram=-1), "lookup_ngram must be"),
        (dict(lookup_ngram=2, lookup_gamma=-1), "lookup_gamma must be an integer >= 0"),
        (dict(lookup_ngram=2, lookup_gamma=True), "lookup_gamma must be an integer >= 0"),
        (dict(topk=2), "unknown decoding setting.*topk"),
        (dict(drafter=None, gamma=3), "without a drafter"),
        (dict(dynamic_gamma="no"), "dynamic_gamma must be true or false"),
        (dict(stop_below="0.1"), "stop_below must be a number"),
    ]
    for kwargs, message in cases:
        call = dict(input_ids=PROMPT, drafter=d, max_new_tokens=4) | kwargs
        with pytest.raises(ValueError, match=message):
            generate(t, call.pop("input_ids"), **call)


def test_settings_a_kind_cannot_honour_are_named_once(random_target, drafts, monkeypatch):
    """A two-model tree drafts with full weights and prompt lookup drafts chains: asked for
    otherwise, the loop says once what it ignores, and output stays exact."""
    ref = hf_greedy(random_target, PROMPT, 12)
    with pytest.warns(UserWarning, match="draft_weights=int8 is ignored by two-model trees"):
        out = generate(
            random_target, PROMPT, drafts["partial"], max_new_tokens=12, tree_top_k=2,
            draft_weights="int8",
        )  # fmt: skip
    assert out.tokens[0].tolist() == ref
    with pytest.warns(UserWarning, match="prompt lookup drafts a chain.*tree_top_k ignored"):
        generate(random_target, PROMPT, "prompt_lookup", max_new_tokens=4, tree_top_k=3)


def test_a_drafter_trained_for_another_target_is_refused(random_target, drafts):
    drafter = DistillDrafter(drafts["copy"])
    fingerprint = dict(random_target.fingerprint, hidden_size=4096)
    drafter.checkpoint = replace(drafter.checkpoint, target_fingerprint=fingerprint)
    with pytest.raises(ValueError, match=r"another target.*hidden_size"):
        generate(random_target, PROMPT, drafter, max_new_tokens=4)


@pytest.mark.parametrize("version", ["eagle1", "eagle3"])
def test_an_eagle_head_runs_through_the_loop_exactly(tiny_target, version):
    """Sessions fed by the target's features get its hidden states from the loop; an untrained
    head drafts (and is rejected), yet output is the target's greedy output."""
    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter

    torch.manual_seed(0)
    head = EagleDrafter.build(EagleConfig(version=version), tiny_target, None).eval()
    ids = tiny_target.tokenizer("import os\ndef f(x):\n", return_tensors="pt").input_ids
    ref = tiny_target.model.generate(ids, max_new_tokens=16, do_sample=False)[0, ids.shape[1] :]
    out = generate(tiny_target, ids, head, max_new_tokens=16)
    assert out.tokens[0].tolist() == ref.tolist()
    assert out.stats.drafted > 0
