"""P-EAGLE heads: the COD loss and acceptance against a naive slot-by-slot loop, COD's counts and
draws, the mask token, checkpoint round trips and the errors for bad values."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from testkit import assert_chunking_exact, perturb

from specdraft.core import DecodeConfig, TargetOutput, float_mask
from specdraft.formats.checkpoint import save_drafter
from specdraft.formats.reading import load_drafter
from specdraft.inference import generate
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, cod_keep, scored

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


def make_batch(target, seq: int = 12):
    """Two rows, the second right-padded by 3, loss on every real token but a prompt one."""
    torch.manual_seed(1)
    ids = torch.randint(3, target.vocab_size, (2, seq))
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0
    ids[1, -3:] = 0
    loss_mask = attention.clone()
    loss_mask[:, 0] = 0
    loss_mask[0, 5] = 0  # a prompt token in the middle: not a target
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def head_for(target, draft_vocab: int = 0, **cfg) -> PEagleDrafter:
    torch.manual_seed(0)
    d2t = None
    if draft_vocab:
        perm = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3))
        d2t = perm[:draft_vocab].sort().values
    head = PEagleDrafter.build(PEagleConfig(draft_vocab_size=draft_vocab, **cfg), target, d2t)
    perturb(head.parameters(), 0.05)  # a random head: every term matters
    return head.eval()


def naive_slot(head: PEagleDrafter, ids, features, a: int, d: int) -> torch.Tensor:
    """(draft vocab,) logits of slot (anchor a, depth d) of one row, re-run from scratch on the
    causal sequence it sees: the pairs (f_t, x_{t+1}) at t = 0..a, then d mask slots."""
    mask_feat = head.fc_fuse(head.mask_hidden)[0]  # (1, hidden)
    tokens = torch.cat([ids[1 : a + 2], torch.full((d,), head.config.mask_token_id)])
    feats = torch.cat([features[: a + 1], mask_feat.expand(d, -1)])
    n = len(tokens)
    causal = float_mask(torch.ones(n, n, dtype=torch.bool).tril(), feats.dtype)[None, None]
    h = head.step(tokens[None], feats[None], torch.arange(n)[None], causal, None)
    return head.draft_logits(h[0, -1])


def naive_reference(head, batch, target_out, keep):
    """Loss sum, scored slots, and per depth alpha and greedy agreement sums, one slot at a
    time."""
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    features = head.fuse(target_out.hidden_states)
    total, count = 0.0, 0
    alpha, greedy = torch.zeros(keep.shape[1]), torch.zeros(keep.shape[1])
    for b in range(ids.shape[0]):
        for d, a in keep[b].nonzero().tolist():
            at = a + 1 + d  # the target's distribution for token a + 2 + d
            if at + 1 >= ids.shape[1] or not loss_mask[b, at + 1]:
                continue
            count += 1
            logits = naive_slot(head, ids[b], features[b], a, d).float()
            p_full = F.softmax(target_out.logits[b, at].float(), -1)
            q_full = torch.zeros_like(p_full).index_copy_(0, head.d2t, F.softmax(logits, -1))
            alpha[d] += torch.minimum(p_full, q_full).sum()
            greedy[d] += float(head.d2t[logits.argmax()] == p_full.argmax())
            if head.t2d[p_full.argmax()] < 0:
                continue  # not draftable: adds 0
            p = F.softmax(target_out.logits[b, at, head.d2t].float(), -1)
            total += float((p * (p.log() - F.log_softmax(logits, -1))).sum().detach())
    return total, count, alpha, greedy


@pytest.mark.parametrize("draft_vocab", [0, 200])
def test_loss_and_acceptance_equal_a_naive_slot_by_slot_loop(tiny_target, draft_vocab):
    head = head_for(tiny_target, draft_vocab, num_depths=3, down_sample_ratio=0.5)
    batch = make_batch(tiny_target)
    out = tiny_target.forward(batch["input_ids"], capture_layers=head.capture_layers)
    keep = head._keep(batch)
    assert keep[:, 1:].sum() < keep[:, 0].numel() * 2  # COD dropped slots
    loss, metrics = head(batch, out)
    total, count, _, _ = naive_reference(head, batch, out, keep)
    assert float(loss.detach()) == pytest.approx(total, rel=1e-5)
    assert float(head.loss_tokens(batch)) == count  # every kept slot whose token carries loss
    assert sum(float(n) for k, (_, n) in metrics.items() if k.startswith("loss_")) <= count
    # acceptance: every anchor's group, no COD
    S = batch["input_ids"].shape[1] - 1
    full = torch.ones(2, 3, S, dtype=torch.bool)
    sums, greedy, counts = head.acceptance(batch, out, DecodeConfig(gamma=3))
    _, _, alpha, agree = naive_reference(head, batch, out, full)
    assert torch.allclose(sums, alpha, rtol=1e-5) and torch.equal(greedy, agree)
    valid = scored(batch["loss_mask"], 3)
    assert counts.tolist() == valid.sum((0, 2)).float().tolist()
    assert len(head.acceptance(batch, out, DecodeConfig(gamma=8))[0]) == 3  # at most K deep


@pytest.mark.parametrize("draft_vocab", [0, 60])
def test_the_chunked_loss_and_its_gradients_equal_the_naive_ones(
    one_thread, tiny_target, draft_vocab
):
    """The slots' KL computed a chunk of slots at a time, the target's logits made from its
    final states: the unchunked loss and gradients (the head, mask_hidden, the target's
    states it reads)."""
    head = head_for(tiny_target, draft_vocab, num_depths=3, down_sample_ratio=0.5).train()
    batch = make_batch(tiny_target)
    L = tiny_target.num_layers
    out = tiny_target.forward(
        batch["input_ids"], capture_layers=[*head.capture_layers, L], logits_to_keep=1
    )
    states = {i: h.clone().requires_grad_() for i, h in out.hidden_states.items()}
    out = TargetOutput(logits=out.logits, hidden_states=states)
    assert_chunking_exact(head, lambda: head(batch, out)[0], list(states.values()))


def test_cod_keeps_depth_zero_and_about_n_r_to_the_d_of_the_groups_before():
    torch.manual_seed(0)
    loss_mask = torch.ones(1, 202)
    loss_mask[0, :30] = 0
    valid = scored(loss_mask, 5)[0]  # (5, 201)
    n = int(valid[0].sum())
    cfg = PEagleConfig(num_depths=5, down_sample_ratio=0.6, down_sample_ratio_min=0.25)
    keep = cod_keep(valid, cfg, torch.Generator().manual_seed(0))
    assert keep[0].all()  # depth 0: every position (the context every slot reads)
    for d in range(1, 5):
        assert int(keep[d].sum()) == int(n * max(0.6**d, 0.25))
        assert not (keep[d] & ~keep[d - 1]).any()  # a slot's group has its earlier slots
        assert not (keep[d] & ~valid[d]).any()  # and its own token carries loss
    again = cod_keep(valid, cfg, torch.Generator().manual_seed(0))
    other = cod_keep(valid, cfg, torch.Generator().manual_seed(1))
    assert torch.equal(keep, again) and not torch.equal(keep, other)
    every = cod_keep(valid, PEagleConfig(num_depths=5, down_sample_ratio=1.0), None)
    assert torch.equal(every[1:], valid[1:] & every[:-1])  # ratio 1: every scored chain


def test_draws_depend_on_the_step_and_the_example_not_on_the_batch(tiny_target):
    head = head_for(tiny_target, num_depths=3)
    batch = make_batch(tiny_target, seq=40)
    shared = torch.Generator().manual_seed(11)
    both = head.prepare_batch({**batch, "example_index": torch.tensor([7, 9])}, None, None, shared)
    alone = head.prepare_batch(
        {k: v[1:] for k, v in batch.items()} | {"example_index": torch.tensor([9])},
        None, None, shared,
    )  # fmt: skip
    assert torch.equal(both["cod_keep"][1:], alone["cod_keep"])
    later = head.prepare_batch(
        {**batch, "example_index": torch.tensor([7, 9])}, None, None,
        torch.Generator().manual_seed(12),
    )  # fmt: skip
    assert not torch.equal(later["cod_keep"], both["cod_keep"])
    # without the trainer's draws (evaluation), from each row's own tokens: the same each time
    assert torch.equal(head._keep(batch), head._keep(batch))


def test_gradients_reach_the_head_and_mask_hidden_not_the_target(tiny_target):
    head = head_for(tiny_target, num_depths=3).train()
    batch = make_batch(tiny_target)
    out = tiny_target.forward(batch["input_ids"], capture_layers=head.capture_layers)
    loss, _ = head(batch, out)
    loss.backward()
    assert head.mask_hidden.grad is not None and head.mask_hidden.grad.abs().sum() > 0
    assert all(p.grad is None for p in tiny_target.model.parameters())
    # the embedding is the target's, not a copy the head trains and saves
    assert "embed" not in " ".join(n for n, _ in head.named_parameters())


def test_the_mask_token_is_resolved_and_saved(tiny_target, tmp_path):
    tok = tiny_target.tokenizer
    expected = next(
        t for t in (tok.mask_token_id, tok.pad_token_id, tok.unk_token_id, tiny_target.vocab_size - 1)
        if t is not None
    )  # fmt: skip
    head = head_for(tiny_target, num_depths=2)
    assert head.config.mask_token_id == expected
    assert head_for(tiny_target, num_depths=2, mask_token_id=17).config.mask_token_id == 17
    save_drafter(head, tmp_path / "h", target_fingerprint=tiny_target.fingerprint)
    back = load_drafter(tmp_path / "h", tiny_target)
    assert back.config.mask_token_id == expected


def test_bad_values_are_named(tiny_target):
    with pytest.raises(ValueError, match="num_depths must be >= 2"):
        PEagleConfig(num_depths=1)
    for ratio in (0.0, 1.5):
        with pytest.raises(ValueError, match=r"down_sample_ratio must be in \(0, 1\]"):
            PEagleConfig(down_sample_ratio=ratio)
    with pytest.raises(ValueError, match="down_sample_ratio_min"):
        PEagleConfig(down_sample_ratio_min=-0.1)
    V = tiny_target.vocab_size
    with pytest.raises(ValueError, match=f"mask_token_id={V} is not a token of the target"):
        PEagleDrafter.build(PEagleConfig(mask_token_id=V), tiny_target)
    with pytest.raises(ValueError, match="mask_token_id must be >= 0"):
        PEagleConfig(mask_token_id=-1)
    with pytest.raises(ValueError, match="larger than the target"):
        PEagleDrafter.build(PEagleConfig(draft_vocab_size=V + 1), tiny_target)


def test_checkpoint_round_trip_bit_for_bit_with_identical_drafts(tiny_target, tmp_path):
    head = head_for(tiny_target, 200, num_depths=3)
    decode = DecodeConfig(gamma=3)
    save_drafter(head, tmp_path / "h", decode=decode, target_fingerprint=tiny_target.fingerprint)
    back = load_drafter(tmp_path / "h", tiny_target)
    assert isinstance(back, PEagleDrafter) and back.config == head.config
    a, b = head.state_dict(), back.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = [5, 17, 42, 99, 7]
    ours = generate(tiny_target, prompt, head, max_new_tokens=10, decode=decode)
    theirs = generate(tiny_target, prompt, back, max_new_tokens=10, decode=decode)
    assert torch.equal(ours.tokens, theirs.tokens) and ours.stats.drafted > 0
