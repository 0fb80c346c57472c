"""P-EAGLE drafting: one head pass per proposal drafts the whole chain, the parallel slots never
stay in the head's cache, and greedy output equals plain greedy decoding (with copying too),
with tokens actually drafted and accepted. The sampled case is tests/inference/test_joint.py's."""

from __future__ import annotations

import pytest
import torch
from test_eagle_session import PROMPTS, drive, new_session, plain_greedy

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings
from specdraft.inference import generate
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, PEagleSession

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact

K = 3


@pytest.fixture(scope="module")
def trained_head(tiny_target):
    """A head trained for a few dozen steps on the target's own predictions, so it accepts."""
    torch.manual_seed(0)
    V = tiny_target.vocab_size
    d2t = torch.arange(0, V, 2)
    argmax = tiny_target.forward(torch.randint(3, V, (8, 24))).logits.argmax(-1).unique()
    d2t = torch.unique(torch.cat([d2t, argmax]))[: V // 2].sort().values
    cfg = PEagleConfig(num_depths=K, draft_vocab_size=len(d2t), down_sample_ratio=1.0)
    head = PEagleDrafter.build(cfg, tiny_target, d2t)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
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
        (loss / head.loss_tokens(batch)).backward()
        opt.step()
    return head.eval()


@pytest.mark.parametrize(
    "options",
    [dict(gamma=K), dict(gamma=2), dict(gamma=K, draft_weights="int8"),
     dict(gamma=K, stop_below=0.3), dict(gamma=K, tree_top_k=3, tree_budget=8),
     dict(gamma=6, tree_top_k=2, tree_budget=5, draft_weights="int8")],
    ids=["chain", "shorter-chain", "int8", "stopping", "tree", "int8-tree-gamma-beyond-K"],
)  # fmt: skip
def test_greedy_output_equals_plain_greedy(tiny_target, trained_head, options):
    greedy = SamplingSettings()
    drafted_total = accepted_total = 0
    for prompt in PROMPTS:
        session = new_session(trained_head, tiny_target, greedy, **options)
        assert isinstance(session.rows, PEagleSession)
        tokens, drafted, accepted = drive(tiny_target, session, prompt, 20, greedy)
        assert tokens == plain_greedy(tiny_target, prompt, 20)
        drafted_total += drafted
        accepted_total += accepted
    assert drafted_total > 0 and accepted_total > 0


def test_copying_keeps_greedy_exact(tiny_target, trained_head):
    prompt = [5, 17, 42, 99, 7, 5, 17, 42, 99, 7, 5, 17]
    decode = DecodeConfig(gamma=K, lookup_ngram=2)
    out = generate(tiny_target, prompt, trained_head, max_new_tokens=24, decode=decode)
    assert out.tokens[0].tolist() == plain_greedy(tiny_target, prompt, 24)
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert 0 < out.stats.copied_passes < out.stats.target_passes  # some passes copied, not all


def test_one_head_pass_per_proposal_and_the_slots_leave_the_cache(
    tiny_target, trained_head, monkeypatch
):
    greedy = SamplingSettings()
    session = new_session(trained_head, tiny_target, greedy, gamma=K)
    calls = []
    step = PEagleSession._step
    monkeypatch.setattr(
        PEagleSession, "_step", lambda s, *a, **k: calls.append(a[0].shape[1]) or step(s, *a, **k)
    )
    propose = PEagleSession.propose

    def proposed(self, contexts):
        trees = propose(self, contexts)
        if self.layer is not None:  # only pairs with the target's true features stay cached
            assert self.layer.length == self.cache.columns == self.fed[0]
        return trees

    monkeypatch.setattr(PEagleSession, "propose", proposed)
    _, drafted, _ = drive(tiny_target, session, PROMPTS[0], 12, greedy)
    proposals = len(calls)
    assert drafted > 0 and proposals > 0 and drafted <= K * proposals
    # each call fed the pending pairs and K - 1 slots (fewer only where the end was near)
    assert all(n >= K - 1 for n in calls[:-1])


def test_ignored_settings_are_said(tiny_target, trained_head):
    said = trained_head.ignored_settings(DecodeConfig(gamma=5, tree_top_k=2, stop_below=0.2))
    assert any("stop_below is ignored by P-EAGLE trees" in s for s in said)
    assert any("gamma=5 is capped at 3 by this P-EAGLE drafter" in s for s in said)
    assert trained_head.ignored_settings(DecodeConfig(gamma=K)) == []


def test_a_proposal_before_the_prompts_forward_is_empty(tiny_target, trained_head):
    session = new_session(trained_head, tiny_target, SamplingSettings(), gamma=K)
    assert len(session.propose(DraftContext(torch.tensor([[5, 6, 7]]), max_depth=4))) == 0


def test_a_tree_holds_each_slots_top_candidates_within_its_budget(tiny_target, trained_head):
    """tree_top_k > 1: one head pass, then the tree of the slots' ranked candidates whose
    expected accepted length under the head's own confidences is largest (position_tree)."""
    greedy = SamplingSettings()
    session = new_session(trained_head, tiny_target, greedy, gamma=K, tree_top_k=3, tree_budget=7)
    prompt = torch.tensor([PROMPTS[0]])
    out = tiny_target.forward(prompt, capture_layers=session.capture_layers)
    session.propose(DraftContext(prompt, max_depth=8))
    session.accept(DraftTree.empty(1), [], out.hidden_states)
    context = torch.cat([prompt, out.logits[:, -1:].argmax(-1)], dim=1)  # the root pending
    calls = []
    logits_of = session.rows._logits
    session.rows._logits = lambda h: calls.append(logits_of(h)) or calls[-1]
    tree = session.propose(DraftContext(context, max_depth=8))
    assert len(calls) == 1 and len(tree) == 7 and not tree.is_chain and tree.depth <= K
    ranked = trained_head.d2t[calls[0][0, :K].topk(3, dim=-1).indices]  # (K, 3) target ids
    for node, (token, depth) in enumerate(zip(tree.tokens[0].tolist(), tree.depths, strict=True)):
        assert token in ranked[depth - 1].tolist(), node
    # the first slot's best candidate and the chain of every slot's best are in the tree
    best = ranked[:, 0].tolist()
    paths = {tuple(tree.tokens[0, i].item() for i in tree_path(tree, n)) for n in range(len(tree))}
    assert (best[0],) in paths and tuple(best[: tree.depth]) in paths


def tree_path(tree, node):
    """The nodes from the root's child down to `node`."""
    path = []
    while node >= 0:
        path.append(node)
        node = tree.parents[node]
    return path[::-1]
