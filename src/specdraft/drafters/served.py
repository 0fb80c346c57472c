"""What a drafter drafts when served, after every position of a batch, computed through its
training path teacher-forced on the batch's tokens: the input of the simulation of serving
(inference/metrics.py), at temperature 0 (`ServedDrafts`, walked step by step) and at
temperature 1 (`chain_reach`, walked in expectation). docs/architecture.md, "Training predicts
serving". And what a drafter's `acceptance` sums on held-out data, per draft depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class ServedDrafts:
    """What a drafter drafts when served greedily, after every position of a batch: the input of
    the simulation of serving (`inference.metrics.simulate_serving`), which walks these the way
    the loop walks its steps. Index [b, c, d - 1]: row b, a context whose last token is at c,
    a draft asked for at most d tokens (the loop asks for fewer near the end). Drafted on the
    batch's own tokens (teacher-forced): while a draft agrees with them it is what the session
    drafts, and after its first disagreement nothing it drafts is accepted."""

    accepted: torch.Tensor  # (batch, seq, gamma) long: the path greedy verification accepts
    depth: torch.Tensor  # (batch, seq, gamma) long: the draft's depth (0: none)
    size: torch.Tensor  # (batch, seq, gamma) long: its nodes

    @property
    def gamma(self) -> int:
        return self.accepted.shape[-1]


def chain_drafts(
    drafts: torch.Tensor, confident: torch.Tensor, input_ids: torch.Tensor, gamma: int
) -> ServedDrafts:
    """A chain drafter's ServedDrafts: drafts (batch, seq, D) target ids, [b, c, i] the token
    drafted at depth i + 1 after a context ending at c whose depths before it agreed with the
    batch; confident (batch, seq, D) bool, whether that draft's top probability is at least
    stop_below (drafting.draft_chain ends the chain after the first that is not). D may be less
    than gamma (a kind that drafts at most D)."""
    T, D = drafts.shape[1], min(drafts.shape[2], gamma)
    c = torch.arange(T, device=drafts.device)
    at = c[:, None] + 1 + torch.arange(D, device=drafts.device)[None]  # (T, D) token compared
    truth = input_ids[:, at.clamp(max=T - 1)]  # (B, T, D)
    agree = (drafts[..., :D] == truth) & (at < T)
    leading = agree.long().cumprod(-1).sum(-1)  # (B, T) depths accepted of the whole chain
    # the chain's length: it ends after its first unconfident depth
    length = confident[..., : D - 1].long().cumprod(-1).sum(-1) + 1  # (B, T)
    caps = torch.arange(1, gamma + 1, device=drafts.device)
    depth = torch.minimum(length[..., None], caps)  # (B, T, gamma)
    accepted = torch.minimum(leading[..., None], depth)
    return ServedDrafts(accepted, depth, depth.clone())


def greedy_confidence(logits: torch.Tensor, stop_below: float) -> torch.Tensor:
    """(..., vocab) draft logits -> (...) bool: the top probability is at least stop_below, as
    drafting.draft_chain decides whether a greedy chain goes on."""
    if stop_below <= 0:
        return torch.ones(logits.shape[:-1], dtype=torch.bool, device=logits.device)
    return logits.float().softmax(-1).max(-1).values >= stop_below


def along_positions(values: torch.Tensor, depth: int) -> torch.Tensor:
    """(batch, seq) per-position values -> (batch, seq, depth): [b, c, i] = values[b, c + i]
    (the last position's where c + i runs past the end), what a drafter that predicts the next
    token from each position drafts at depth i + 1 after a context ending at c."""
    T = values.shape[1]
    at = torch.arange(T, device=values.device)[:, None] + torch.arange(depth, device=values.device)
    return values[:, at.clamp(max=T - 1)]


def one_later(values: torch.Tensor, fill) -> torch.Tensor:
    """(batch, S, ...) values at position t -> (batch, S + 1, ...) at c = t + 1, `fill` at 0: a
    drafter fed the target's state at the token before the context's last (EAGLE, Medusa)
    drafts after a context ending at c from what it computed at c - 1."""
    first = torch.full_like(values[:, :1], fill)
    return torch.cat([first, values], dim=1)


def chain_reach(
    q_logits: torch.Tensor,
    target_logits: torch.Tensor,
    confident: torch.Tensor,
    input_ids: torch.Tensor,
    gamma: int,
    t2d: torch.Tensor | None = None,
) -> torch.Tensor:
    """(batch, seq, gamma): for sampling at temperature 1, the chance that the chain drafted
    after a context ending at c has its first d drafts accepted (index d - 1), given that the
    loop emits the batch's tokens after c.

    q_logits (batch, seq, D, draft vocab): the drafter's at [b, c, i], depth i + 1's after a
    context ending at c whose depths before it agreed with the batch (as `chain_drafts`), or
    (batch, seq, vocab) position-wise (Drafter.served_logits); target_logits (batch, seq,
    vocab): the target's at every position; confident (batch, seq, D), or (batch, seq)
    position-wise, as `chain_drafts` takes it; t2d (vocab,): each target id's index in a
    reduced draft vocabulary (-1: outside it), None where the drafter drafts over the target's.

    A draft x ~ q is accepted with probability min(1, p(x) / q(x)), and the token emitted at
    that depth is distributed as p (the loop is lossless), so given the emitted token x the
    draft was accepted with probability min(p(x), q(x)) / p(x) = min(1, q(x) / p(x)). Given
    every depth before it accepted, the drafter drew depth i + 1 after the batch's own tokens,
    which is what q holds; the chain reaches depth i + 1 when depths 1..i were confident
    (stop_below looks at q alone). Exact for a batch that is the target's sample at T = 1."""
    B, T = input_ids.shape
    D = gamma if q_logits.dim() == 3 else min(q_logits.shape[2], gamma)
    c = torch.arange(T, device=q_logits.device)
    at = c[:, None] + 1 + torch.arange(D, device=q_logits.device)[None]  # (T, D) the token judged
    inside = at < T
    before = (at - 1).clamp(max=T - 2)  # the position that predicts it
    p_x = _prob_of_next(target_logits, input_ids[:, 1:])[:, before]  # (B, T, D)
    nxt = input_ids[:, 1:] if t2d is None else t2d[input_ids[:, 1:]]  # in q's entries
    if q_logits.dim() == 3:  # position-wise: depth i + 1 after c is position c + i's
        q_x = _prob_of_next(q_logits, nxt)[:, before]
        confident = along_positions(confident, D)
    else:
        x = nxt[:, (at - 1).clamp(max=T - 2)]  # (B, T, D)
        q_logits = q_logits[..., :D, :].float()
        q_x = q_logits.gather(-1, x[..., None].clamp(min=0))[..., 0]
        q_x = torch.where(x >= 0, (q_x - q_logits.logsumexp(-1)).exp(), 0.0)
    ratio = torch.where(p_x > 0, q_x / p_x.clamp(min=1e-30), 1.0).clamp(max=1.0)  # q >= p: 1
    accepted = (ratio * inside).cumprod(-1)  # (B, T, D): depths 1..i + 1 all accepted
    goes_on = confident[..., : D - 1].to(accepted.dtype).cumprod(-1)
    reach = accepted * torch.cat([torch.ones_like(accepted[..., :1]), goes_on], dim=-1)
    return torch.cat([reach, reach.new_zeros(B, T, gamma - D)], dim=-1)


def _prob_of_next(logits: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
    """(batch, seq - 1): softmax(logits[:, t])[nxt[:, t]], 0 where nxt is -1 (outside the
    vocabulary the logits cover), without a copy of the softmax."""
    logits = logits[:, : nxt.shape[1]]
    picked = logits.gather(-1, nxt.clamp(min=0)[..., None])[..., 0].float()
    return torch.where(nxt >= 0, (picked - logits.float().logsumexp(-1)).exp(), 0.0)


# --- a drafter's served drafts, from its narrow hooks ----------------------------------------------
#
# The simulation asks a drafter (drafters/base.py) for no more than: `served_logits` (a chain's
# logits after every position, through its training path), `chain_confidence` (where such a chain
# stops), `draft_vocab` (its draft vocabulary), and for trees
# `served_tree_drafts` / `sampled_tree_reach`. What follows composes them, the same for every kind.


def drafts_chain(drafter, decode) -> bool:
    """Whether `drafter`'s session drafts a chain with `decode`: decode.chain, unless the kind
    drafts chains whatever the settings say (`drafts_trees` False)."""
    return decode.chain or not drafter.drafts_trees


@torch.no_grad()
def served_drafts(drafter, batch, target_out, decode) -> ServedDrafts | None:
    """What greedy decoding with `decode` drafts after every position of the batch, through the
    drafter's training path unrolled as its session drafts (chain or tree, gamma, stop rule,
    draft vocabulary): walked by `inference.metrics.simulate_serving` on the target's own greedy
    continuation it gives the served tau exactly. A chain's from `served_logits`, a tree's from
    `served_tree_drafts`. None where the kind or these settings have no such simulation:
    evaluation then estimates tau from the per-depth agreement of `acceptance`."""
    if not drafts_chain(drafter, decode):
        return drafter.served_tree_drafts(batch, target_out, decode)
    logits = drafter.served_logits(batch, target_out, decode)
    if logits is None:
        return None
    vocab = drafter.draft_vocab()
    drafts = logits.argmax(-1) if vocab is None else vocab.to_target(logits.argmax(-1))
    confident = drafter.chain_confidence(batch, target_out, logits, decode)
    if logits.dim() == 3:  # one set per position: depth i + 1 after c is position c + i's
        drafts = along_positions(drafts, decode.gamma)
        confident = along_positions(confident, decode.gamma)
    return chain_drafts(drafts, confident, batch["input_ids"], decode.gamma)


@torch.no_grad()
def sampled_reach(
    drafter, batch, target_out, decode, temperature: float = 1.0
) -> torch.Tensor | None:
    """(batch, seq, gamma): sampling at `temperature` with `decode`, the chance that the draft
    after a context ending at c has its first d nodes on the batch's tokens accepted (index
    d - 1), given that the loop emits the batch's tokens (`chain_reach`): walked in expectation
    by `inference.metrics.expected_passes` on the target's own sampled continuation. A chain's
    from `served_logits`, a tree's from `sampled_tree_reach`. None where the kind or these
    settings have neither, and for an acceptance rule that is not lossless (`decode.lossless`:
    Medusa's typical acceptance neither samples the drafts nor emits what the target samples)."""
    if not decode.lossless:
        return None
    if not drafts_chain(drafter, decode):
        return drafter.sampled_tree_reach(batch, target_out, decode, temperature)
    logits = drafter.served_logits(batch, target_out, decode)
    if logits is None:
        return None
    logits = logits / temperature  # q as the session processes it (no top-k, top-p)
    confident = drafter.chain_confidence(batch, target_out, logits, decode)
    vocab = drafter.draft_vocab()
    return chain_reach(
        logits, target_out.logits / temperature, confident, batch["input_ids"],
        decode.gamma, None if vocab is None else vocab.t2d,
    )  # fmt: skip


# --- held-out acceptance (Drafter.acceptance) -------------------------------------------------


def alpha_agreement(
    p_logits: torch.Tensor, logits: torch.Tensor, d2t: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., vocab) target and (..., draft vocab) draft logits -> (...) alpha = sum_x min(p(x),
    q(x)), the chance a sampled draft token is accepted (q mapped to the target's vocabulary
    through d2t, 0 outside the draft vocabulary), and (...) bool greedy agreement: the draft's
    argmax is the target's, what greedy verification accepts."""
    p = F.softmax(p_logits.float(), dim=-1)
    q = F.softmax(logits.float(), dim=-1)
    best = logits.argmax(-1)
    if d2t is not None:
        q, best = torch.zeros_like(p).index_copy_(-1, d2t, q), d2t[best]
    return torch.minimum(p, q).sum(-1), best == p_logits.argmax(-1)


def depth_sums(per_depth) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A drafter's `acceptance`: (alpha summed, greedy agreement summed, count) per depth, from
    each depth's (alpha, agreement, bool mask of the positions it counts)."""
    sums = [((a * m).sum(), (g & m).sum().float(), m.sum().float()) for a, g, m in per_depth]
    return tuple(torch.stack(column) for column in zip(*sums, strict=True))


def agreement_sums(
    target_logits: torch.Tensor, student_logits: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, vocab) x2 -> (alpha summed, greedy agreement summed, n): how a chain drafted from the
    student's logits fares against the target's at n positions (a chain drafter's `acceptance`,
    one estimate for every depth)."""
    alpha, agree = alpha_agreement(target_logits, student_logits)
    return alpha.sum(), agree.sum().float(), alpha.new_tensor(float(student_logits.shape[0]))
