"""EAGLE heads: the training-time-test loss and acceptance against a naive step-by-step loop,
the draft vocabulary, checkpoint round trips and the errors for bad input."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from testkit import assert_chunking_exact, perturb
from transformers import LlamaForCausalLM

from specdraft.core import DecodeConfig, TargetOutput
from specdraft.drafting import build_draft_vocab
from specdraft.formats.checkpoint import CheckpointError, save_drafter
from specdraft.formats.reading import load_drafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, resolve_config
from specdraft.targets.target import Target, TargetError


def make_batch(target, seq: int = 10):
    """Two rows of real demo text, the second right-padded by 3, loss on all real tokens."""
    torch.manual_seed(1)
    ids = torch.randint(3, target.vocab_size, (2, seq))
    attention = torch.ones_like(ids)
    attention[1, -3:] = 0
    ids[1, -3:] = 0
    loss_mask = attention.clone()
    loss_mask[:, 0] = 0
    loss_mask[0, 4] = 0  # a prompt token in the middle: not a target
    return {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}


def head_for(target, d2t=None, **cfg) -> EagleDrafter:
    torch.manual_seed(0)
    head = EagleDrafter.build(
        EagleConfig(**cfg), target, d2t if d2t is not None else _d2t(target, cfg)
    )
    perturb(head.parameters(), 0.05)  # a random, not a zero-initialised, head: every term matters
    return head.eval()


def _d2t(target, cfg):
    size = cfg.get("draft_vocab_size", 0)
    if not size or cfg.get("version") == "eagle1":
        return None
    return torch.sort(
        torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(3))[:size]
    ).values


def naive_reference(head: EagleDrafter, batch, target_out, steps: int):
    """Loss sum, scored tokens, and alpha per step, one (row, position, step) at a time.

    Step k at position t sees exactly the causal sequence [step-0 inputs at 0..t, the inputs of
    steps 1..k at t] at positions 0..t+k, so the layer is re-run from scratch on that sequence.
    """
    cfg = head.config
    ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    B, T = ids.shape
    feats = head.fuse(target_out.hidden_states)
    d2t = head.d2t.tolist() if cfg.version == "eagle3" else list(range(head.target.vocab_size))
    terms = [[] for _ in range(steps)]  # (loss term, alpha) of valid positions
    scored = 0  # tokens the loss is over: those step 0 predicts, whether it can score them or not
    for b in range(B):
        for t in range(T - 1):
            seq = [
                head.layer_input(ids[b : b + 1, s + 1 : s + 2], feats[b : b + 1, s : s + 1])
                for s in range(t + 1)
            ]
            for k in range(steps):
                if t + 1 + k > T - 1:
                    break
                x = torch.cat(seq, dim=1)  # (1, t + 1 + k, hidden)
                n = x.shape[1]
                mask = torch.full((n, n), torch.finfo(x.dtype).min).triu(1)[None, None]
                pos = torch.arange(n)[None]
                h = head.layer(
                    x,
                    attention_mask=mask,
                    position_ids=pos,
                    position_embeddings=head.rotary(x, pos),
                )
                h = (h[0] if isinstance(h, tuple) else h)[:, -1]  # (1, hidden)
                p_logits = target_out.logits[b, t + 1 + k]  # (V,)
                q_logits = head.draft_logits(h)[0]
                p_full = p_logits.softmax(-1)
                q_full = torch.zeros_like(p_full)
                q_full[d2t] = q_logits.softmax(-1)
                valid = t + 2 + k < T and bool(loss_mask[b, t + 2 + k])
                scored += valid and k == 0
                if cfg.version == "eagle3":
                    in_draft = int(p_logits.argmax()) in d2t
                    p = p_logits[d2t].softmax(-1)
                    ce = -(p * q_logits.log_softmax(-1)).sum()
                    if valid and in_draft:
                        terms[k].append(("loss", ce))
                else:
                    ce = -(p_full * q_logits.log_softmax(-1)).sum()
                    reg = F.smooth_l1_loss(h[0], feats[b, t + 1 + k])
                    if valid:
                        terms[k].append(("loss", cfg.reg_weight * reg + cfg.cls_weight * ce))
                if valid:
                    terms[k].append(("alpha", torch.minimum(p_full, q_full).sum()))
                    agree = d2t[int(q_logits.argmax())] == int(p_logits.argmax())
                    terms[k].append(("greedy", torch.tensor(float(agree))))
                if t + 2 + k <= T - 1:
                    seq.append(head.layer_input(ids[b : b + 1, t + 2 + k : t + 3 + k], h[:, None]))
    loss = 0.0
    alpha_sums, greedy_sums, counts = [], [], []
    for k in range(steps):
        losses = [v for name, v in terms[k] if name == "loss"]
        alphas = [v for name, v in terms[k] if name == "alpha"]
        greedy_sums.append(float(sum(v for name, v in terms[k] if name == "greedy")))
        if losses:  # a step with no valid position adds nothing
            loss = loss + cfg.ttt_decay**k * torch.stack(losses).sum()
        alpha_sums.append(float(torch.stack(alphas).sum()))
        counts.append(len(alphas))
    n_losses = [sum(name == "loss" for name, _ in terms[k]) for k in range(steps)]
    assert sum(n_losses) > 0, "the reference compares nothing"
    return loss, scored, alpha_sums, greedy_sums, counts


@pytest.mark.parametrize(
    "cfg",
    [
        dict(version="eagle3", ttt_steps=3, draft_vocab_size=200),
        dict(version="eagle1", ttt_steps=3, reg_weight=0.7, cls_weight=0.3),
    ],
    ids=["eagle3", "eagle1"],
)
def test_ttt_loss_and_acceptance_equal_naive_step_by_step_reference(tiny_target, cfg):
    batch = make_batch(tiny_target)
    d2t = None
    if cfg["version"] == "eagle3":
        # half of the target's argmax tokens are draftable: both masked and kept positions occur
        argmax = tiny_target.forward(batch["input_ids"]).logits.argmax(-1).unique()
        counts = torch.rand(tiny_target.vocab_size, generator=torch.Generator().manual_seed(2))
        counts[argmax[::2]] = 10.0
        counts[argmax[1::2]] = -1.0
        d2t = build_draft_vocab(counts, cfg["draft_vocab_size"], tiny_target.vocab_size)
    head = head_for(tiny_target, d2t, **cfg)
    target_out = tiny_target.forward(
        batch["input_ids"],
        attention_mask=batch["attention_mask"],
        capture_layers=head.capture_layers,
    )
    with torch.no_grad():
        loss, metrics = head(batch, target_out)
        ref_loss, ref_scored, ref_alpha, ref_greedy, ref_count = naive_reference(
            head, batch, target_out, cfg["ttt_steps"]
        )
        # the simulated tau's depth: the served gamma
        alpha, greedy, count = head.acceptance(batch, target_out, DecodeConfig(gamma=3))
    assert torch.allclose(loss, ref_loss, atol=1e-4, rtol=1e-5), (loss, ref_loss)
    assert head.loss_tokens(batch).item() == ref_scored
    assert count.tolist() == ref_count and min(ref_count) > 0
    assert torch.allclose(alpha, torch.tensor(ref_alpha), atol=1e-4)
    assert greedy.tolist() == ref_greedy
    assert set(metrics) >= {"loss_0", "loss_2", "top1_0"}
    top1_sum, top1_count = metrics["top1_0"]
    assert top1_count.item() <= ref_count[0] and 0 <= top1_sum.item() <= top1_count.item()


def leaf_states(target, batch, layers):
    """The target's forward as the trainer's training pass gives it: the hidden states at
    `layers` and the final one (leaves with gradients, for the test to follow them) and only
    the last position's logits."""
    L = target.num_layers
    out = target.forward(batch["input_ids"], capture_layers=[*layers, L], logits_to_keep=1)
    states = {i: h.clone().requires_grad_() for i, h in out.hidden_states.items()}
    return TargetOutput(logits=out.logits, hidden_states=states), list(states.values())


@pytest.mark.parametrize(
    "cfg",
    [
        dict(version="eagle3", ttt_steps=3, draft_vocab_size=60),
        dict(version="eagle3", ttt_steps=2),
        dict(version="eagle1", ttt_steps=2, reg_weight=0.7, cls_weight=0.3, feature_noise=0.0),
    ],
    ids=["eagle3-draft-vocab", "eagle3", "eagle1"],
)
def test_the_chunked_loss_and_its_gradients_equal_the_naive_ones(one_thread, tiny_target, cfg):
    """Every unrolled step's loss computed a chunk of positions at a time, the target's logits
    made from its final states: the loss and the gradients (the head's weights, the target's
    states it reads) of the unchunked loss, with padding, a masked prompt token and tokens
    outside the draft vocabulary."""
    head = head_for(tiny_target, **cfg).train()
    batch = make_batch(tiny_target)
    out, states = leaf_states(tiny_target, batch, head.capture_layers)
    assert not head.reads_target_logits
    assert_chunking_exact(head, lambda: head(batch, out)[0], states)


def test_eagle3_masks_positions_whose_target_argmax_is_not_draftable(tiny_target):
    batch = make_batch(tiny_target)
    out = tiny_target.forward(
        batch["input_ids"], capture_layers=head_for(tiny_target).capture_layers
    )
    argmax = set(out.logits.argmax(-1).flatten().tolist())
    without = torch.tensor([i for i in range(tiny_target.vocab_size) if i not in argmax][:50])
    with_them = torch.sort(
        torch.cat([without[: 50 - len(argmax)], torch.tensor(sorted(argmax))])
    ).values
    with torch.no_grad():
        loss_without, _ = head_for(tiny_target, without, ttt_steps=2, draft_vocab_size=50)(
            batch, out
        )
        loss_with, _ = head_for(tiny_target, with_them, ttt_steps=2, draft_vocab_size=50)(
            batch, out
        )
    assert loss_without.item() == 0.0 and loss_with.item() > 0.0


def test_feature_noise_only_while_training(tiny_target):
    head = head_for(tiny_target, version="eagle1", feature_noise=0.5)
    batch = make_batch(tiny_target)
    out = tiny_target.forward(batch["input_ids"], capture_layers=head.capture_layers)
    with torch.no_grad():
        a, b = head(batch, out)[0], head(batch, out)[0]
        head.train()
        c = head(batch, out)[0]
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_gradients_reach_the_head_only(tiny_target):
    head = head_for(tiny_target, version="eagle3", ttt_steps=2, draft_vocab_size=100)
    batch = make_batch(tiny_target)
    out = tiny_target.forward(batch["input_ids"], capture_layers=head.capture_layers)
    head.train()
    head(batch, out)[0].backward()
    assert all(p.grad is not None for p in head.parameters() if p.requires_grad)
    assert all(p.grad is None for p in tiny_target.model.parameters())
    assert "d2t" in head.state_dict() and not any(k.startswith("target") for k in head.state_dict())


# --- draft vocabulary ----------------------------------------------------------------------------


def test_draft_vocab_keeps_most_frequent_loss_tokens_and_eos():
    examples = [
        SimpleNamespace(input_ids=[5, 5, 5, 7, 7, 9, 2], loss_mask=[0, 1, 1, 1, 1, 1, 0]),
        SimpleNamespace(input_ids=[9, 9, 9, 9], loss_mask=[0, 0, 0, 0]),  # prompt only: not counted
    ]
    d2t = build_draft_vocab(examples, 3, 10, always=[1])
    assert d2t.tolist() == [1, 5, 7]  # EOS 1 never seen, still in; 9 counted once, 7 twice
    counts = torch.tensor([0, 0, 3, 3, 1, 0, 0, 0, 0, 0])
    assert build_draft_vocab(counts, 2, 10).tolist() == [2, 3]
    with pytest.raises(ValueError, match=r"1\.\.10"):
        build_draft_vocab(counts, 11, 10)


# --- checkpoints and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("version", ["eagle3", "eagle1"])
def test_checkpoint_round_trip_bit_for_bit(tiny_target, tmp_path, version):
    head = head_for(tiny_target, version=version, draft_vocab_size=120)
    folder = save_drafter(head, tmp_path / "final", target_fingerprint=tiny_target.fingerprint)
    loaded = load_drafter(folder, tiny_target)
    assert isinstance(loaded, EagleDrafter) and loaded.config == head.config
    mine, theirs = head.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    if version == "eagle3":
        assert torch.equal(loaded.d2t, head.d2t) and loaded.d2t.tolist() != list(range(120))
        assert (loaded.t2d[loaded.d2t] == torch.arange(120)).all()
    # the target's embedding / LM head are used, never stored
    n_target = sum(p.numel() for p in tiny_target.model.parameters())
    assert head.num_extra_parameters(tiny_target) < n_target


def other_target(tiny_target) -> Target:
    config = copy.deepcopy(tiny_target.config)
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    return Target(LlamaForCausalLM(config), tiny_target.tokenizer, name="other")


def test_checkpoint_for_another_target_is_a_clear_error(tiny_target, tmp_path):
    head = head_for(tiny_target, version="eagle3", draft_vocab_size=100)
    folder = save_drafter(head, tmp_path / "final", target_fingerprint=tiny_target.fingerprint)
    with pytest.raises(CheckpointError, match="num_layers: expected 2, got 3"):
        load_drafter(folder, other_target(tiny_target))


def test_bad_config_errors_name_the_problem(tiny_target):
    with pytest.raises(TargetError, match="layer id 7 is out of range"):
        EagleDrafter.build(EagleConfig(feature_layers=[1, 2, 7]), tiny_target)
    with pytest.raises(ValueError, match=r"draft_vocab_size=1000 is larger than .* 384"):
        EagleDrafter.build(EagleConfig(draft_vocab_size=1000), tiny_target)
    with pytest.raises(ValueError, match="3 target layers"):
        EagleConfig(feature_layers=[1, 2])
    with pytest.raises(ValueError, match="ttt_steps must be >= 1"):
        EagleConfig(ttt_steps=0)
    with pytest.raises(ValueError, match=r"EAGLE-3\.1's, an EAGLE-3 head's settings"):
        EagleDrafter.build(EagleConfig(version="eagle1", norm_output=True), tiny_target)
    steps = lambda **kw: resolve_config(EagleConfig(**kw), tiny_target).ttt_steps  # noqa: E731
    assert steps(version="eagle1") == 1 and steps() == 7


def test_eagle1_trains_with_the_papers_feature_noise_by_default(tiny_target):
    """EAGLE-1 adds U(-0.1, 0.1) to its input features while training; EAGLE-3's training-time
    test replaces it. An explicit value still wins."""
    noise = lambda **kw: resolve_config(EagleConfig(**kw), tiny_target).feature_noise  # noqa: E731
    assert noise(version="eagle1") == 0.1 and noise(version="eagle3") == 0.0
    assert noise(version="eagle1", feature_noise=0.0) == 0.0
    # set by a later layer (the command line), the version still decides the default
    from specdraft.config import override
    from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig

    cfg = override(EagleTrainConfig(), ["drafter.version=eagle1"])
    assert resolve_config(cfg.drafter, tiny_target).feature_noise == 0.1


@pytest.mark.parametrize("version", ["eagle3", "eagle1"])
def test_the_unroll_without_a_mask_equals_the_dense_mask(version, monkeypatch):
    """ttt_attention (causal over step 0 plus one key per later step, a block of queries at a
    time, recomputed in backward) gives the dense-mask attention's outputs and gradients, with
    grouped-query heads and more than one query block."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import specdraft.kinds.eagle.eagle_layers as eagle_layers
    from specdraft.targets.target import Target

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=128,
    )  # fmt: skip
    target = Target(LlamaForCausalLM(config).eval(), _VocabTokenizer(300))
    head = EagleDrafter.build(EagleConfig(version=version, ttt_steps=4), target).train()
    ids = torch.randint(0, 300, (2, 40))
    loss_mask = torch.ones_like(ids)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}
    out = target.forward(ids, capture_layers=head.capture_layers)
    monkeypatch.setattr(eagle_layers, "TTT_BLOCK", 16)  # 39 queries: three blocks
    results = []
    for dense in (True, False):
        head.zero_grad()
        torch.manual_seed(1)  # the same feature noise (eagle1)
        steps = head.unroll(batch, out, 4, dense=dense)
        sum(s["logits"].float().square().mean() for s in steps).backward()
        grads = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
        results.append((torch.stack([s["h"] for s in steps]), grads))
    (h_dense, g_dense), (h_lean, g_lean) = results
    torch.testing.assert_close(h_lean, h_dense, rtol=1e-5, atol=1e-5)
    assert g_dense.keys() == g_lean.keys() and g_dense
    for name in g_dense:
        torch.testing.assert_close(g_lean[name], g_dense[name], rtol=1e-4, atol=1e-6)


class _VocabTokenizer:
    def __init__(self, n: int) -> None:
        self.vocab = {str(i): i for i in range(n)}

    def get_vocab(self) -> dict[str, int]:
        return self.vocab
