"""EAGLE drafting sessions driven by a hand-written loop that follows EagleSession's contract
step by step, and by generate: greedy output equals plain greedy decoding for chains and dynamic
trees, with tokens actually drafted and accepted."""

from __future__ import annotations

import pytest
import torch
from testkit import perturb
from transformers import DynamicCache

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings, compact
from specdraft.drafters.prompt_lookup import CopyingRows
from specdraft.drafters.sessions import OneRow
from specdraft.drafting import process_logits
from specdraft.inference import generate
from specdraft.inference.tree import tree_attention
from specdraft.inference.verify import verify_greedy, verify_sampling
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, EagleSession

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


@pytest.fixture(scope="module", params=["eagle3", "eagle1"])
def trained_head(request, tiny_target):
    """A head trained for a few dozen steps on the target's own predictions, so it accepts: each
    version."""
    torch.manual_seed(0)
    version = request.param
    V = tiny_target.vocab_size
    d2t = torch.arange(0, V, 2) if version == "eagle3" else None  # half the vocabulary
    if d2t is not None:
        argmax = tiny_target.forward(torch.randint(3, V, (8, 24))).logits.argmax(-1).unique()
        d2t = torch.unique(torch.cat([d2t, argmax]))[: V // 2].sort().values
    cfg = EagleConfig(
        version=version,
        ttt_steps=2,
        draft_vocab_size=len(d2t) if d2t is not None else 0,
    )
    head = EagleDrafter.build(cfg, tiny_target, d2t)
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):
        ids = torch.randint(3, V, (8, 24))
        batch = {
            "input_ids": ids,
            "attention_mask": torch.ones_like(ids),
            "loss_mask": torch.ones_like(ids),
        }
        out = tiny_target.forward(ids, capture_layers=head.capture_layers)
        loss, _ = head(batch, out)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return head.eval()


def drive(
    target, session, prompt: list[int], max_new: int, sampling: SamplingSettings, generator=None
):
    """The speculative loop in miniature: propose, verify the tree in one target forward that
    captures session.capture_layers, compact the target cache, accept with hidden states."""
    seq, cached = list(prompt), 0
    cache = DynamicCache(config=target.config)
    drafted = accepted = 0
    while len(seq) - len(prompt) < max_new:
        remaining = len(prompt) + max_new - len(seq)
        tree = session.propose(DraftContext(torch.tensor([seq]), max_depth=remaining - 1))
        tree.check()
        n, pending = len(tree), len(seq) - cached
        inputs = torch.cat([torch.tensor([seq[cached:]]), tree.tokens], dim=1)
        mask, positions = tree_attention(tree, cached, pending, target.dtype, torch.device("cpu"))
        out = target.forward(
            inputs, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True,
            capture_layers=session.capture_layers,
        )  # fmt: skip
        logits = out.logits[0, pending - 1 :]  # (n + 1, vocab): the root, then each node
        if sampling.greedy:
            path, nxt = verify_greedy(tree, logits.argmax(-1).tolist())
        else:
            path, nxt = verify_sampling(tree, process_logits(logits, sampling), generator)
        compact(cache, len(seq), path)
        cached = len(seq) + len(path)
        session.accept(tree, path, out.hidden_states)
        drafted += n
        accepted += len(path)
        seq += [int(tree.tokens[0, i]) for i in path] + [nxt]
    return seq[len(prompt) : len(prompt) + max_new], drafted, accepted


def new_session(head, target, sampling, generator=None, **settings):
    """The head's session for one sequence (a OneRow around its session of one row)."""
    return head.new_session(
        target, sampling=sampling, decode=DecodeConfig(**settings), generator=generator
    )


def plain_greedy(target, prompt: list[int], max_new: int) -> list[int]:
    seq = list(prompt)
    for _ in range(max_new):
        seq.append(int(target.forward(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt) :]


PROMPTS = [[5, 17, 42, 99, 7, 250], [300, 12, 12, 64]]


@pytest.mark.parametrize(
    "options",
    [dict(tree_top_k=1, gamma=4), dict(tree_top_k=3, gamma=4, tree_budget=10),
     dict(tree_top_k=2, gamma=3, tree_budget=3),
     dict(tree_top_k=1, gamma=4, draft_weights="int8"),
     dict(tree_top_k=3, gamma=4, tree_budget=10, draft_weights="int8"),
     dict(tree_top_k=1, gamma=6, stop_below=0.2, draft_weights="int8")],
    ids=["chain", "tree", "small-budget-tree", "int8-chain", "int8-tree", "stopping-chain"],
)  # fmt: skip
def test_greedy_output_equals_plain_greedy(tiny_target, trained_head, options):
    greedy = SamplingSettings()
    total_drafted = total_accepted = 0
    for prompt in PROMPTS:
        session = new_session(trained_head, tiny_target, greedy, **options)
        tokens, drafted, accepted = drive(tiny_target, session, prompt, 20, greedy)
        assert tokens == plain_greedy(tiny_target, prompt, 20)
        assert session.extra_memory_bytes() > 0
        total_drafted += drafted
        total_accepted += accepted
    assert total_drafted > 0 and total_accepted > 0


def test_lookup_drafts_repeats_without_the_head_and_stays_exact(tiny_target, trained_head):
    """With lookup_ngram, a context that repeats itself is drafted by copying (no head pass) and
    the rest by the head; greedy output is still the target's own."""
    greedy = SamplingSettings()
    prompt = PROMPTS[0] * 3  # a context that repeats
    head = new_session(trained_head, tiny_target, greedy, gamma=4).rows
    copying = CopyingRows(head, 1, 2, gamma=4)
    head_passes = 0
    step = head._step

    def counting_step(*args, **kwargs):
        nonlocal head_passes
        head_passes += 1
        return step(*args, **kwargs)

    head._step = counting_step
    tokens, _, accepted = drive(tiny_target, OneRow(copying), prompt, 24, greedy)
    assert tokens == plain_greedy(tiny_target, prompt, 24)
    copied = copying.row_copied_passes(0)
    assert copied > 0 and accepted > 0
    forwards = 24 - accepted  # each verification forward emits its accepted tokens plus one
    # a head-drafted step runs at most gamma passes; a copied one runs none
    assert 0 < head_passes <= 4 * (forwards - copied)


def test_generate_reports_the_passes_a_hybrid_copied(tiny_target, trained_head, monkeypatch):
    prompt = PROMPTS[0] * 3
    out = generate(tiny_target, prompt, trained_head, max_new_tokens=24, lookup_ngram=2)
    assert out.tokens[0].tolist() == plain_greedy(tiny_target, prompt, 24)
    assert out.stats.copies and 0 < out.stats.copied_passes < out.stats.target_passes
    assert out.stats.accepted > 0
    plain = generate(tiny_target, prompt, "prompt_lookup", max_new_tokens=8).stats
    assert not plain.copies and plain.copied_passes == 0  # its drafts are not a model's copies


def test_untrained_head_still_gives_the_target_output(tiny_target):
    torch.manual_seed(1)
    head = EagleDrafter.build(EagleConfig(ttt_steps=1), tiny_target)
    perturb(head.parameters())
    greedy = SamplingSettings()
    session = new_session(head, tiny_target, greedy, tree_top_k=3, tree_budget=8)
    tokens, drafted, _ = drive(tiny_target, session, PROMPTS[0], 12, greedy)
    assert drafted > 0 and tokens == plain_greedy(tiny_target, PROMPTS[0], 12)


def test_sampled_chain_records_q_over_the_full_vocab(tiny_target, trained_head):
    sampling = SamplingSettings(temperature=1.0)
    session = new_session(
        trained_head, tiny_target, sampling, generator=torch.Generator().manual_seed(0)
    )
    trees = []
    original = session.propose
    session.propose = lambda ctx: trees.append(original(ctx)) or trees[-1]
    tokens, drafted, accepted = drive(
        tiny_target, session, PROMPTS[0], 16, sampling, torch.Generator().manual_seed(1)
    )
    assert len(tokens) == 16 and drafted > 0 and accepted > 0
    tree = next(t for t in trees if len(t))
    assert tree.q.shape == (1, len(tree), tiny_target.vocab_size)
    assert torch.allclose(tree.q.sum(-1), torch.ones(1, len(tree)))
    # each drafted token was sampled from its recorded q
    assert (tree.q[0].gather(-1, tree.tokens[0, :, None]) > 0).all()
    if trained_head.config.version == "eagle3":
        outside = torch.ones(tiny_target.vocab_size, dtype=torch.bool)
        outside[trained_head.d2t] = False
        assert (tree.q[0][:, outside] == 0).all()


def test_contract_violations_are_clear_errors(tiny_target, trained_head):
    session = new_session(trained_head, tiny_target, SamplingSettings())
    ctx = DraftContext(torch.tensor([PROMPTS[0]]), max_depth=4)
    tree = session.propose(ctx)
    assert len(tree) == 0  # no features before the prompt's forward
    out = tiny_target.forward(ctx.tokens[:, :3], capture_layers=session.capture_layers)
    too_big = DraftTree.chain(torch.tensor([[1, 2, 3]]))
    with pytest.raises(ValueError, match="pending token"):
        session.accept(too_big, [], out.hidden_states)
    with pytest.raises(ValueError, match="needs hidden_states"):
        session.accept(tree, [])


def test_decoding_settings_shape_the_tree(tiny_target, trained_head, monkeypatch):
    """generate(gamma=, tree_top_k=) shape an EAGLE tree as they would any drafter's; without
    them decode= decides; output stays exact."""
    trees = []
    propose = EagleSession.propose
    monkeypatch.setattr(EagleSession, "propose", lambda s, ctxs: trees.extend(propose(s, ctxs)) or trees[-len(ctxs):])  # fmt: skip
    prompt = torch.tensor([PROMPTS[0]])
    plain = plain_greedy(tiny_target, PROMPTS[0], 16)
    for gamma, topk in ((2, 1), (3, 2)):
        trees.clear()
        out = generate(
            tiny_target, prompt, trained_head, max_new_tokens=16, gamma=gamma, tree_top_k=topk
        )
        assert out.tokens[0].tolist() == plain
        assert out.stats.drafted > 0 and out.stats.accepted > 0
        drafted = [t for t in trees if len(t)]
        assert max(t.depth for t in drafted) == gamma
        assert all(t.depths.count(1) == topk for t in drafted)  # children of the root
        assert all(t.is_chain for t in drafted) == (topk == 1)
    trees.clear()
    decode = DecodeConfig(gamma=3, tree_top_k=2)
    out = generate(tiny_target, prompt, trained_head, max_new_tokens=16, decode=decode)
    drafted = [t for t in trees if len(t)]
    assert max(t.depth for t in drafted) == 3 and not all(t.is_chain for t in drafted)
    with pytest.raises(ValueError, match="unknown decoding setting"):
        generate(tiny_target, prompt, trained_head, max_new_tokens=4, topk=2)


def test_drafting_weights_are_shared_until_a_parameter_changes(tiny_target, trained_head):
    """Sessions reuse the head's fused/int8 drafting weights; an optimizer step (or any in-place
    change) rebuilds them, so a head evaluated during training drafts with its current weights."""
    greedy = SamplingSettings()
    first = new_session(trained_head, tiny_target, greedy, draft_weights="int8").rows.w
    again = new_session(trained_head, tiny_target, greedy, draft_weights="int8").rows.w
    full = new_session(trained_head, tiny_target, greedy).rows.w
    assert first is again and full is not first and first.int8 and not full.int8
    param = next(p for p in trained_head.parameters() if p.requires_grad)
    saved = param.detach().clone()
    with torch.no_grad():
        param.add_(1.0)
    try:
        changed = new_session(trained_head, tiny_target, greedy, draft_weights="int8").rows.w
        assert changed is not first
    finally:
        with torch.no_grad():
            param.copy_(saved)


def test_int8_drafting_weights_stay_close_to_the_head(tiny_target, trained_head):
    """The int8 copies are per-row symmetric: every product is within a few percent."""
    w = trained_head.drafting_weights(int8=True)
    full = trained_head.drafting_weights(int8=False)
    # the product before the layer: fc (eagle1), else the fused one
    first, first_full = (w.input, full.input) if w.input is not None else (w.fuse, full.fuse)
    assert first.int8 and w.output.int8 and w.layer.gate_up.int8  # really int8, no fallback
    assert w.layer.qkv.int8 and not first_full.int8 and w.memory_bytes() < full.memory_bytes()
    x = torch.randn(5, first.weight.shape[1])
    exact, approx = first_full(x), first(x)
    assert approx.dtype == torch.bfloat16 and exact.dtype == x.dtype  # the kernels' own dtypes
    assert (approx.float() - exact).norm() / exact.norm() < 0.03


def test_stop_below_ends_chains_after_an_unsure_token(tiny_target, trained_head, monkeypatch):
    """Chains of the stopping rule vary in length, each ending at depth or right after the first
    token drafted with probability under the threshold."""
    trees = []
    propose = EagleSession.propose
    monkeypatch.setattr(EagleSession, "propose", lambda s, ctxs: trees.extend(propose(s, ctxs)) or trees[-len(ctxs):])  # fmt: skip
    seen = []
    logits = EagleSession._logits
    monkeypatch.setattr(EagleSession, "_logits", lambda s, h: seen.append(logits(s, h)) or seen[-1])  # fmt: skip
    greedy = SamplingSettings()
    session = new_session(trained_head, tiny_target, greedy, gamma=6)
    drive(tiny_target, session, PROMPTS[1], 24, greedy)  # without stopping, to pick a threshold
    starts = torch.tensor([0] + [len(t) for t in trees if len(t)]).cumsum(0)[:-1]
    first = torch.stack([seen[i].softmax(-1).max() for i in starts])  # each chain's first token
    threshold = float(first.median())  # about half the chains stop at once
    seen.clear()
    trees.clear()
    session = new_session(trained_head, tiny_target, greedy, gamma=6, stop_below=threshold)
    tokens, _, _ = drive(tiny_target, session, PROMPTS[1], 24, greedy)
    assert tokens == plain_greedy(tiny_target, PROMPTS[1], 24)
    sure = [float(x.softmax(-1).max()) >= threshold for x in seen]
    lengths = [len(t) for t in trees if len(t)]
    assert len(set(lengths)) > 1 and max(lengths) <= 6
    i = 0
    for n in lengths[:-1]:  # sure tokens, then an unsure one or the depth (the last chain may
        chain = sure[i : i + n]  # also be cut by the tokens left to generate)
        assert all(chain[:-1]) and (n == 6 or not chain[-1])
        i += n


def test_int8_where_it_cannot_run_drafts_with_full_weights(tiny_target, trained_head, monkeypatch):
    """A head saved with draft_weights=int8 still decodes on a device without the int8 kernel
    (a GPU): one warning, full weights, exact output."""
    import specdraft.drafters.lean as lean

    monkeypatch.setattr(lean, "int8_supported", lambda device: False)
    greedy = SamplingSettings()
    with pytest.warns(UserWarning, match="runs on CPU only"):
        session = new_session(trained_head, tiny_target, greedy, draft_weights="int8")
    assert not session.rows.w.int8
    tokens, drafted, accepted = drive(tiny_target, session, PROMPTS[0], 12, greedy)
    assert drafted > 0 and accepted > 0 and tokens == plain_greedy(tiny_target, PROMPTS[0], 12)


@pytest.mark.parametrize("lookup_ngram", [0, 1])
def test_a_one_token_prompt(tiny_target, trained_head, monkeypatch, lookup_ngram):
    """The first proposal has no features even when the context has no pair to feed yet."""
    out = generate(tiny_target, [5], trained_head, max_new_tokens=10, lookup_ngram=lookup_ngram)
    assert out.tokens[0].tolist() == plain_greedy(tiny_target, [5], 10)
    assert out.stats.target_passes < 10  # it drafted after the first step
