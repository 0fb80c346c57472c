"""P-EAGLE drafting: one head pass per proposal drafts the whole chain, the parallel slots never
stay in the head's cache, and greedy output equals plain greedy decoding (with copying too),
with tokens actually drafted and accepted. The sampled case is tests/inference/test_joint.py's."""

from __future__ import annotations

import pytest
import torch
from test_eagle_session import PROMPTS, drive, new_session, plain_greedy

from specdraft.core import DecodeConfig, DraftContext, SamplingSettings
from specdraft.drafters.peagle import PEagleConfig, PEagleDrafter, PEagleSession
from specdraft.inference import generate

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
     dict(gamma=K, stop_below=0.3), dict(gamma=6, tree_top_k=3, tree_budget=8)],
    ids=["chain", "shorter-chain", "int8", "stopping", "tree-and-gamma-beyond-K-ignored"],
)  # fmt: skip
def test_greedy_output_equals_plain_greedy(tiny_target, trained_head, options):
    greedy = SamplingSettings()
    drafted_total = accepted_total = 0
    for prompt in PROMPTS:
        session = new_session(trained_head, tiny_target, greedy, **options)
        assert isinstance(session, PEagleSession)
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
    original = PEagleSession.accept

    def accept(self, tree, path, hidden_states=None):
        if len(tree):  # a proposal's slots are in the cache until its accept
            assert self.layer.length == self.fed + len(tree) - 1
        original(self, tree, path, hidden_states)
        if self.layer is not None:
            assert self.layer.length == self.fed  # only pairs with the target's true features

    monkeypatch.setattr(PEagleSession, "accept", accept)
    _, drafted, _ = drive(tiny_target, session, PROMPTS[0], 12, greedy)
    proposals = len(calls)
    assert drafted > 0 and proposals > 0 and drafted <= K * proposals
    # each call fed the pending pairs and K - 1 slots (fewer only where the end was near)
    assert all(n >= K - 1 for n in calls[:-1])


def test_ignored_settings_are_said(tiny_target, trained_head):
    said = trained_head.ignored_settings(DecodeConfig(gamma=5, tree_top_k=2))
    assert any("tree_top_k=2 is ignored by P-EAGLE" in s for s in said)
    assert any("gamma=5 is more than the 3 tokens" in s for s in said)
    assert trained_head.ignored_settings(DecodeConfig(gamma=K)) == []


def test_a_proposal_before_the_prompts_forward_is_empty(tiny_target, trained_head):
    session = new_session(trained_head, tiny_target, SamplingSettings(), gamma=K)
    assert len(session.propose(DraftContext(torch.tensor([[5, 6, 7]]), max_depth=4))) == 0
