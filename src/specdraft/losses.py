"""Losses over a vocabulary, a chunk of positions at a time (docs/architecture.md, "Losses").

A loss over the vocabulary at every position of a long sequence holds (positions, vocab) logits,
their float32 log-probabilities and, in the backward pass, their gradient: at Llama-3's 128,256
tokens and 8,192 positions that is 4.2 GB per float32 copy, per head or exit. Here the LM head
runs inside the loss: `token_losses` turns `chunk_tokens` rows of hidden states into logits,
scores them and lets them go, and the backward pass recomputes each chunk's logits from its
hidden states (torch.utils.checkpoint), so no tensor of (positions, vocab) exists at once; what
survives a chunk is one number per position. The target's distribution, where the loss needs
one, is built the same way from the target's final hidden state and its LM head, chunk by
chunk, without gradients.

The values are the naive ones (`chunk_tokens=0`, every row in one piece): each position's loss
is computed by the same operations on the same logits, so only the order of the sum that the
caller takes afterwards differs (float rounding). The price is time: the head's product runs
twice for the positions that train (forward, then again in backward), and for a target
distribution the target's head runs twice too.

The callables that make logits (`head`, `target_head`) must compute the same values when called
again (no dropout, no sampling): the backward pass calls them a second time.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

# Positions whose logits exist at once by default: at a 128k vocabulary one float32 copy of a
# chunk's logits is 0.5 GB, a fraction of a step's memory at 2k-8k-token sequences, and the
# head's product (1024 x hidden x vocab) is still large enough to run at full speed on a GPU.
DEFAULT_CHUNK_TOKENS = 1024

DIVERGENCES = ("fkl", "rkl", "jsd", "tvd", "soft_ce", "lk", "lk_hybrid")

# The LK losses (Samarin et al., "LK Losses: Direct Acceptance Rate Optimization for Speculative
# Decoding", arXiv 2602.23881) train for the acceptance rate alpha = sum_x min(p(x), q(x)) itself:
# lk is -log alpha (its gradient is TV's scaled by 1 / alpha, usable from a cold start), lk_hybrid
# lambda * KL(p || q) + (1 - lambda) * TV(p, q) with lambda = exp(-eta * alpha) and alpha held
# fixed (KL's strong pull while the drafter is far, TV's acceptance-optimal one as it nears).
# eta = 3, the paper's best hybrid; alpha is floored at LK_FLOOR inside the log.
LK_HYBRID_ETA = 3.0
LK_FLOOR = 1e-5


def check_chunk_tokens(value: object, key: str = "loss_chunk_tokens") -> int:
    """`value` as a chunk size (0: no chunking; None means 0), or a ValueError naming `key`."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"{key} must be a whole number of positions >= 0; got {value!r}. Use e.g. "
            f"{key}={DEFAULT_CHUNK_TOKENS} (the default: logits for that many positions at "
            f"once), or {key}=0 to compute the loss over the whole batch at once"
        )
    return value


def chunked(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    rows: Sequence[torch.Tensor | None],
    chunk_tokens: int,
) -> tuple[torch.Tensor, ...]:
    """`fn` applied to `chunk_tokens` rows of every tensor in `rows` at a time (None entries
    passed as None), its outputs, each with one row per input row, concatenated.

    With gradients on, each chunk runs under torch.utils.checkpoint: only its inputs are kept,
    and its forward is run again in the backward pass, so the tensors `fn` makes inside (a
    chunk's logits and log-probabilities) never exist for more than one chunk. chunk_tokens=0,
    or as many as there are rows, is one call of `fn` on everything, without checkpointing.
    """
    n = next(r for r in rows if r is not None).shape[0]
    if not chunk_tokens or chunk_tokens >= n:
        return fn(*rows)
    outputs = []
    for start in range(0, n, chunk_tokens):
        part = [None if r is None else r[start : start + chunk_tokens] for r in rows]
        if torch.is_grad_enabled():
            out = checkpoint(fn, *part, use_reentrant=False, preserve_rng_state=False)
        else:
            out = fn(*part)
        outputs.append(out)
    return tuple(torch.cat(column) for column in zip(*outputs, strict=True))


@dataclass
class TokenLosses:
    """Per-position results of `token_losses`, each with one row per input row (n,); the fields
    not asked for are None."""

    ce: torch.Tensor | None = None  # -log q(label) (0 where label < 0), with gradient
    divergence: torch.Tensor | None = None  # D(p, q) at `temperature`, with gradient
    # (n, top_k) bool: the reference token (the target's, else the label) at q's rank 0..top_k-1
    hits: torch.Tensor | None = None
    # (n,) the target's most likely token over its whole vocabulary, as a draft id (-1 where the
    # draft vocabulary lacks it); with target_rows=None the token itself
    target_token: torch.Tensor | None = None
    # (n,) alpha = sum_x min(p(x), q(x)), the chance a draw from q is accepted against p (both
    # at `temperature`, without gradient); only with overlap=True
    overlap: torch.Tensor | None = None


def token_losses(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    *,
    labels: torch.Tensor | None = None,
    target: torch.Tensor | None = None,
    target_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
    target_rows: torch.Tensor | None = None,
    divergence: str = "fkl",
    temperature: float = 1.0,
    beta: float = 0.5,
    top_k: int = 0,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    overlap: bool = False,
) -> TokenLosses:
    """Cross-entropy and a divergence from the target per position, with the LM heads applied
    inside, `chunk_tokens` positions at a time (`chunked`).

    hidden (n, hidden): the drafter's states at the scored positions; `head` turns rows of them
    into logits q over the draft vocabulary (with gradients: the head's weights and `hidden`
    train). labels (n,): draft ids for the cross-entropy, -1 for none (0 loss there).
    target (n, target hidden): the target's final states at the same positions, turned into
    logits p by `target_head` without gradients; target_head=None: `target` already holds the
    target's logits (n, vocab). target_rows (draft vocab,): the target's vocabulary ids of the
    draft vocabulary (EAGLE-3's d2t): p is restricted to them and renormalised, and
    `target_token` says where the target's own choice is outside. Exact, not an approximation:
    the restricted distribution is what the naive loss computes too.
    divergence: fkl KL(p || q) | rkl KL(q || p) | jsd JSD(beta) | tvd total variation |
    soft_ce -sum p log q (the cross-entropy to p, KL(p || q) + H(p)) | lk -log alpha |
    lk_hybrid (the LK losses: LK_HYBRID_ETA above); both sides softened by `temperature` (the
    cross-entropy to labels is not). overlap (with a target): `overlap`, each row's alpha. top_k > 0: `hits` for the top-k ranks.
    Logits are float32 whatever the inputs' dtype (bf16 hidden states and weights welcome).
    """
    if divergence not in DIVERGENCES:
        raise ValueError(f"unknown divergence {divergence!r}; use one of {', '.join(DIVERGENCES)}")
    t2d = None  # target id -> draft id, built at the first chunk (the vocabulary size is known)
    want = (labels is not None, target is not None, top_k > 0)
    if overlap and not want[1]:
        raise ValueError("overlap needs the target's distribution: pass target")

    def one_chunk(h, labels_c, target_c):
        nonlocal t2d
        q_logits = head(h).float()  # (c, draft vocab)
        log_q = F.log_softmax(q_logits, dim=-1)
        out = []
        if want[0]:
            picked = log_q.gather(-1, labels_c.clamp(min=0)[:, None])[:, 0]
            out.append((-picked).where(labels_c >= 0, 0))
        reference = labels_c
        if want[1]:
            with torch.no_grad():
                p_logits = (target_head(target_c) if target_head else target_c).float()
                token = p_logits.argmax(-1)  # (c,) over the whole vocabulary
                if target_rows is not None:
                    if t2d is None:
                        t2d = torch.full((p_logits.shape[-1],), -1, device=token.device)
                        t2d[target_rows] = torch.arange(len(target_rows), device=token.device)
                    token = t2d[token]
                    p_logits = p_logits.index_select(-1, target_rows)  # (c, draft vocab)
                log_p = F.log_softmax(p_logits / temperature, dim=-1)
            scaled = log_q if temperature == 1 else F.log_softmax(q_logits / temperature, dim=-1)
            out.append(divergence_per_row(log_p, scaled, divergence, beta))
            out.append(token)
            reference = token
            if overlap:
                with torch.no_grad():
                    out.append(torch.minimum(log_p.exp(), scaled.exp()).sum(-1))
        if want[2]:
            ranked = log_q.detach().topk(min(top_k, log_q.shape[-1]), dim=-1).indices
            out.append(ranked == reference.clamp(min=0)[:, None])
        return tuple(out)

    outputs = list(chunked(one_chunk, [hidden, labels, target], chunk_tokens))
    result = TokenLosses()
    if want[0]:
        result.ce = outputs.pop(0)
    if want[1]:
        result.divergence = outputs.pop(0)
        result.target_token = outputs.pop(0)
        if overlap:
            result.overlap = outputs.pop(0)
    if want[2]:
        result.hits = outputs.pop(0)
    return result


def divergence_per_row(
    log_p: torch.Tensor, log_q: torch.Tensor, kind: str, beta: float = 0.5
) -> torch.Tensor:
    """(n, vocab) float32 log-probabilities of the target p and the drafter q -> (n,) the
    divergence `kind` (see `token_losses`). From log-probabilities, so a token one side gives
    probability 0 adds 0 rather than nan."""
    p, q = log_p.exp(), log_q.exp()
    if kind == "fkl":
        return (p * (log_p - log_q)).sum(-1)
    if kind == "soft_ce":
        return -(p * log_q).sum(-1)
    if kind == "rkl":
        return (q * (log_q - log_p)).sum(-1)
    if kind == "jsd":
        if beta in (0.0, 1.0):
            return torch.zeros_like(log_p[..., 0])  # m equals p or q: both terms vanish
        log_m = torch.logsumexp(
            torch.stack([log_p + math.log(beta), log_q + math.log(1 - beta)]), dim=0
        )
        kl_pm = (p * (log_p - log_m)).sum(-1)
        kl_qm = (q * (log_q - log_m)).sum(-1)
        return beta * kl_pm + (1 - beta) * kl_qm
    if kind == "tvd":
        return 0.5 * (p - q).abs().sum(-1)
    if kind in ("lk", "lk_hybrid"):
        alpha = torch.minimum(p, q).sum(-1)
        if kind == "lk":
            return -alpha.clamp_min(LK_FLOOR).log()
        kl = (p * (log_p - log_q)).sum(-1)
        weight = torch.exp(-LK_HYBRID_ETA * alpha.detach())
        return weight * kl + (1 - weight) * (1 - alpha)
    raise ValueError(f"unknown divergence {kind!r}; use one of {', '.join(DIVERGENCES)}")
