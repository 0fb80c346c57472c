"""specdraft/losses.py: chunked losses equal naive full-vocabulary loops, values and gradients
(w.r.t. the head's weights, the drafter's hidden states), for every divergence, masked labels,
a reduced draft vocabulary, and chunk sizes that do not divide the rows, exceed them, or are 1."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specdraft.losses import (
    DIVERGENCES,
    check_chunk_tokens,
    chunked,
    divergence_per_row,
    token_losses,
)

H, V, VD = 8, 37, 11


def setup(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    weight = torch.randn(VD, H, generator=g, requires_grad=True)
    target = torch.randn(n, H, generator=g)
    target_weight = torch.randn(V, H, generator=g)
    labels = torch.randint(0, VD, (n,), generator=g)
    labels[::3] = -1  # masked positions
    rows = torch.randperm(V, generator=g)[:VD]  # the draft vocabulary's target ids (d2t)
    return hidden, weight, target, target_weight, labels, rows


def naive(hidden, weight, target, target_weight, labels, rows, kind, temperature):
    """The loss as the kinds computed it before: whole (n, vocab) float32 tensors."""
    logits = hidden @ weight.T
    log_q = F.log_softmax(logits, -1)
    ce = -log_q.gather(-1, labels.clamp(min=0)[:, None])[:, 0]
    ce = ce.where(labels >= 0, 0)
    p_logits = target @ target_weight.T
    t2d = torch.full((V,), -1)
    t2d[rows] = torch.arange(VD)
    token = t2d[p_logits.argmax(-1)]
    log_p = F.log_softmax(p_logits[:, rows] / temperature, -1)
    log_qt = F.log_softmax(logits / temperature, -1)
    p, q = log_p.exp(), log_qt.exp()
    if kind == "fkl":
        div = (p * (log_p - log_qt)).sum(-1)
    elif kind == "soft_ce":
        div = -(p * log_qt).sum(-1)
    elif kind == "rkl":
        div = (q * (log_qt - log_p)).sum(-1)
    elif kind == "tvd":
        div = 0.5 * (p - q).abs().sum(-1)
    elif kind == "lk":  # -log alpha, alpha the acceptance rate sum_x min(p, q)
        div = -torch.minimum(p, q).sum(-1).log()
    elif kind == "lk_hybrid":  # lambda KL + (1 - lambda) TV, lambda = exp(-3 alpha), alpha fixed
        alpha = torch.minimum(p, q).sum(-1)
        lam = torch.exp(-3.0 * alpha.detach())
        div = lam * (p * (log_p - log_qt)).sum(-1) + (1 - lam) * 0.5 * (p - q).abs().sum(-1)
    elif kind == "jsd":  # jsd, beta 0.3, with the mixture in probabilities
        m = 0.3 * p + 0.7 * q
        div = 0.3 * (p * (log_p - m.log())).sum(-1) + 0.7 * (q * (log_qt - m.log())).sum(-1)
    return ce, div, token, log_q


def grads(loss, *tensors):
    return torch.autograd.grad(loss, tensors)


@pytest.mark.parametrize("kind", DIVERGENCES)
@pytest.mark.parametrize("chunk", [0, 1, 4, 7, 100])
def test_chunked_losses_and_gradients_equal_the_naive_ones(kind, chunk):
    """Every divergence and the masked cross-entropy, with a reduced draft vocabulary at
    temperature 2: values, hits and gradients as the whole-vocabulary loop's (17 rows: chunks
    of 4 and 7 leave a remainder, 100 is one chunk, 1 a chunk per row)."""
    hidden, weight, target, tw, labels, rows = setup(17)
    temperature = 2.0
    ce, div, token, log_q = naive(hidden, weight, target, tw, labels, rows, kind, temperature)
    keep = token >= 0
    want_loss = ce.sum() + 0.5 * div.where(keep, 0).sum()
    want = grads(want_loss, hidden, weight)

    out = token_losses(
        hidden, lambda h: h @ weight.T, labels=labels, target=target,
        target_head=lambda h: h @ tw.T, target_rows=rows, divergence=kind,
        temperature=temperature, beta=0.3, top_k=3, chunk_tokens=chunk,
    )  # fmt: skip
    torch.testing.assert_close(out.ce, ce, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out.divergence, div, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.target_token, token)
    ranked = log_q.topk(3, -1).indices
    assert torch.equal(out.hits, ranked == token.clamp(min=0)[:, None])
    got_loss = out.ce.sum() + 0.5 * out.divergence.where(out.target_token >= 0, 0).sum()
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
    for g, w in zip(grads(got_loss, hidden, weight), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunk", [0, 2, 5])
def test_labels_only_and_given_target_logits(chunk):
    """Cross-entropy alone (hits against the label), and a target given as logits rather than
    states (target_head=None), over the whole vocabulary."""
    hidden, weight, target, _, labels, _ = setup(9, seed=1)
    out = token_losses(hidden, lambda h: h @ weight.T, labels=labels, top_k=1, chunk_tokens=chunk)
    log_q = F.log_softmax(hidden @ weight.T, -1)
    ce = (-log_q.gather(-1, labels.clamp(min=0)[:, None])[:, 0]).where(labels >= 0, 0)
    torch.testing.assert_close(out.ce, ce, rtol=1e-5, atol=1e-6)
    assert torch.equal(out.hits[:, 0], log_q.argmax(-1) == labels.clamp(min=0))
    assert out.divergence is None and out.target_token is None

    full = torch.randn(VD, H)  # the target over the draft's own vocabulary
    p_logits = target @ full.T
    got = token_losses(hidden, lambda h: h @ weight.T, target=p_logits, chunk_tokens=chunk)
    want = divergence_per_row(F.log_softmax(p_logits, -1), log_q, "fkl")
    torch.testing.assert_close(got.divergence, want, rtol=1e-5, atol=1e-6)
    g_got = grads(got.divergence.sum(), hidden)[0]
    g_want = grads(want.sum(), hidden)[0]
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-6)


def test_single_row_and_bf16_inputs():
    """One position, and bf16 states and weights: float32 logits from the bf16 product, as the
    kinds' `.float()` of a bf16 head's output."""
    hidden, weight, *_ = setup(1)
    labels = torch.tensor([3])
    out = token_losses(hidden, lambda h: h @ weight.T, labels=labels, chunk_tokens=4)
    want = F.cross_entropy(hidden @ weight.T, labels, reduction="none")
    torch.testing.assert_close(out.ce, want, rtol=1e-5, atol=1e-6)

    h16 = hidden.detach().bfloat16().requires_grad_()
    w16 = weight.detach().bfloat16()
    got = token_losses(h16, lambda h: h @ w16.T, labels=labels, chunk_tokens=1)
    assert got.ce.dtype == torch.float32
    want = F.cross_entropy((h16 @ w16.T).float(), labels, reduction="none")
    torch.testing.assert_close(got.ce, want)
    got.ce.sum().backward()
    assert h16.grad is not None and h16.grad.dtype == torch.bfloat16


def test_chunked_keeps_only_one_chunk_of_logits_for_backward():
    """What the backward pass keeps from a chunked loss is its inputs, not the chunks' logits:
    the saved tensors of the autograd graph add up to the rows' size, where the naive loss
    keeps (rows, vocab) log-probabilities."""
    n, vocab = 64, 1000
    hidden = torch.randn(n, H, requires_grad=True)
    weight = torch.randn(vocab, H, requires_grad=True)
    labels = torch.randint(0, vocab, (n,))

    def saved_elements(chunk: int) -> int:
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            token_losses(hidden, lambda h: h @ weight.T, labels=labels, chunk_tokens=chunk)
        return max(sizes)

    assert saved_elements(0) >= n * vocab  # the naive loss keeps its log-probabilities
    assert saved_elements(16) < 16 * vocab  # chunked: no chunk of logits is kept


def test_chunked_concatenates_outputs_and_the_empty_case():
    rows = torch.arange(10.0)
    out = chunked(lambda r: (r * 2, r + 1), [rows], 3)
    assert torch.equal(out[0], rows * 2) and torch.equal(out[1], rows + 1)
    empty = token_losses(
        torch.zeros(0, H), lambda h: h @ torch.ones(VD, H).T, labels=torch.zeros(0).long()
    )
    assert empty.ce.shape == (0,)


def test_bad_chunk_sizes_name_the_key_and_the_fix():
    assert check_chunk_tokens(None) == 0 and check_chunk_tokens(0) == 0
    assert check_chunk_tokens(512) == 512
    for bad in (-1, 2.5, "1k", True):
        with pytest.raises(ValueError, match=r"loss_chunk_tokens must be .*loss_chunk_tokens=0"):
            check_chunk_tokens(bad)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        token_losses(torch.zeros(1, H), lambda h: h, target=torch.zeros(1, H), divergence="kl")


def test_overlap_is_the_acceptance_rate_and_lk_scales_tv_by_its_inverse():
    """overlap=True gives alpha = sum_x min(p, q) per row; lk's gradient is TV's divided by
    alpha (the LK paper's reason it trains from a cold start where TV's gradient vanishes)."""
    hidden, weight, target, tw, _, rows = setup(6, seed=3)

    def run(kind):
        return token_losses(
            hidden, lambda h: h @ weight.T, target=target, target_head=lambda h: h @ tw.T,
            target_rows=rows, divergence=kind, overlap=True, chunk_tokens=4,
        )  # fmt: skip

    lk, tv = run("lk"), run("tvd")
    p = F.softmax((target @ tw.T)[:, rows], -1)
    q = F.softmax(hidden @ weight.T, -1)
    torch.testing.assert_close(lk.overlap, torch.minimum(p, q).sum(-1).detach())
    torch.testing.assert_close(lk.divergence, -lk.overlap.log())
    for i in range(3):
        (g_lk,) = torch.autograd.grad(lk.divergence[i], hidden, retain_graph=True)
        (g_tv,) = torch.autograd.grad(tv.divergence[i], hidden, retain_graph=True)
        torch.testing.assert_close(g_lk, g_tv / lk.overlap[i], rtol=1e-4, atol=1e-6)
    with pytest.raises(ValueError, match="overlap needs the target"):
        token_losses(hidden, lambda h: h @ weight.T, labels=torch.zeros(6, dtype=torch.long),
                     overlap=True)  # fmt: skip
