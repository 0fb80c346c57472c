"""Trees drafted from positions that one pass predicts side by side: Medusa's heads, and the
slots of a block drafter (P-EAGLE, DFlash). Position d proposes the token d + 1 below the root
without reading the token drawn at position d - 1, so every node at depth d takes its candidates
from position d - 1's distribution, whatever its parent: the tree is a choice of rank paths.

`tree_paths` picks the paths with the largest expected accepted length under a node budget from
per-position accuracies: Medusa's measured ones (one shape per call), or the drafter's own
confidences in this pass (`position_tree` with no shape: a shape per proposal). `ranked_tree`
fills a shape with the positions' top candidates (greedy), `sampled_tree` with candidates drawn
without replacement (temperature > 0, exact under the loop's recursive rejection sampling).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specdraft.core import DecodeConfig, DraftTree, SamplingSettings, children_of
from specdraft.drafting import DraftVocab, draft_chains, process_logits

if TYPE_CHECKING:
    from specdraft.drafters.base import Drafter


def tree_paths(
    accuracy: torch.Tensor, budget: int, depth: int, top_k: int
) -> list[tuple[int, ...]]:
    """The draft tree with the largest expected accepted length under a node budget.

    A node is a path of ranks (r_1, ..., r_d): head d - 1's r_d-th candidate below the node
    (r_1, ..., r_{d-1}). Taking the heads as independent, the node is accepted with probability
    prod_i accuracy[i - 1, r_i], and the expected accepted length of a tree is the sum of that
    over its nodes; a child never beats its parent, so adding the best remaining node, `budget`
    times, gives the best tree (the Medusa paper's construction). Ranks stop at top_k (and the
    measured ranks), depth at `depth`. Returns the paths, parents first.
    """
    K, R = accuracy.shape
    depth, ranks = min(depth, K), min(top_k, R)
    acc = accuracy.tolist()
    chosen: list[tuple[int, ...]] = []
    # max-heap of candidates by probability; ties to the shallower, then lower-ranked path
    heap = [(-acc[0][r], 1, (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    while heap and len(chosen) < budget:
        neg, length, path = heapq.heappop(heap)
        chosen.append(path)
        if length < depth:
            for r in range(ranks):
                heapq.heappush(heap, (neg * acc[length][r], length + 1, (*path, r)))
    return sorted(chosen, key=lambda p: (len(p), p))


@dataclass(frozen=True)
class TreeShape:
    """A tree of rank paths as the loop's DraftTree wants it: parents and depths in node order,
    and per node the head (depth - 1) and rank whose candidate it holds."""

    parents: list[int]
    depths: list[int]
    heads: torch.Tensor  # (n,) long
    ranks: torch.Tensor  # (n,) long

    @classmethod
    def from_paths(cls, paths: list[tuple[int, ...]]) -> TreeShape:
        index = {p: i for i, p in enumerate(paths)}
        parents = [index[p[:-1]] if len(p) > 1 else -1 for p in paths]
        depths = [len(p) for p in paths]
        return cls(
            parents,
            depths,
            torch.tensor([d - 1 for d in depths]),
            torch.tensor([p[-1] for p in paths]),
        )

    @property
    def width(self) -> int:
        return int(self.ranks.max()) + 1 if len(self.ranks) else 0


def expected_length(accuracy: torch.Tensor, paths: list[tuple[int, ...]]) -> float:
    """The tree's expected accepted draft tokens per step (without the target's own token)."""
    acc = accuracy.tolist()
    return sum(math.prod(acc[i][r] for i, r in enumerate(p)) for p in paths)


def ranked_tree(
    logits: torch.Tensor, shape: TreeShape, vocab: DraftVocab | None, device: torch.device
) -> DraftTree:
    """The shape filled with each position's ranked candidates: node (d, r) holds position
    d - 1's r-th most likely token. logits: (depth, draft vocab)."""
    ranked = logits.topk(min(shape.width, logits.shape[-1]), dim=-1).indices  # (depth, width)
    tokens = ranked[shape.heads, shape.ranks]  # (n,)
    if vocab is not None:
        tokens = vocab.to_target(tokens)
    return DraftTree(tokens[None].to(device), list(shape.parents), list(shape.depths))


def sampled_tree(
    logits: torch.Tensor,
    shape: TreeShape,
    sampling: SamplingSettings,
    vocab: DraftVocab | None,
    generator: torch.Generator | None,
) -> DraftTree:
    """The shape with its nodes sampled (temperature > 0): the children of a node are drawn
    from their position's q (after the same temperature / top-k / top-p as the target's)
    without replacement, child i from q with its elder siblings' tokens removed and
    renormalised, which is the q it is verified with. Recursive rejection sampling over such
    children keeps the output exactly the target's (Jeon et al. 2024) and accepts far more than
    fixed top candidates where the target's distribution is flat. A child left with no
    probability (q's support used up by its siblings) is dropped with its subtree."""
    q_heads = process_logits(logits, sampling)  # (depth, draft vocab)
    if vocab is not None:
        q_heads = vocab.spread(q_heads)  # (depth, vocab)
    n = len(shape.parents)
    tokens = [0] * n
    q = torch.zeros(n, q_heads.shape[-1], dtype=q_heads.dtype, device=q_heads.device)
    kept = [True] * n
    for parent, kids in children_of(shape.parents).items():
        if parent >= 0 and not kept[parent]:
            for c in kids:
                kept[c] = False
            continue
        left = q_heads[shape.depths[kids[0]] - 1].clone()
        for c in kids:  # in node order: rank order
            total = left.sum()
            if total <= 0:
                kept[c] = False
                continue
            q[c] = left / total
            tokens[c] = int(torch.multinomial(q[c], 1, generator=generator))
            left[tokens[c]] = 0.0
    index = {old: new for new, old in enumerate(i for i in range(n) if kept[i])}
    rows = list(index)
    return DraftTree(
        torch.tensor([[tokens[i] for i in rows]], device=q.device),
        [index[shape.parents[i]] if shape.parents[i] >= 0 else -1 for i in rows],
        [shape.depths[i] for i in rows],
        q[rows][None],
    )


def confident_shape(
    logits: torch.Tensor, decode: DecodeConfig, sampling: SamplingSettings
) -> TreeShape:
    """This pass's tree: `tree_paths` over the positions' own top probabilities (the softmax of
    the logits when greedy, q when sampling) in place of measured accuracies. It depends on the
    drafter's output alone, so verification stays exact."""
    probs = logits.float().softmax(-1) if sampling.greedy else process_logits(logits, sampling)
    top = probs.topk(min(decode.tree_top_k, probs.shape[-1]), dim=-1).values  # (depth, k)
    paths = tree_paths(top.cpu(), decode.tree_budget, logits.shape[0], decode.tree_top_k)
    return TreeShape.from_paths(paths)


def position_tree(
    logits: torch.Tensor,
    *,
    decode: DecodeConfig,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    vocab: DraftVocab | None,
    device: torch.device,
    shape: TreeShape | None = None,
) -> DraftTree:
    """What one pass's positions draft with `decode`. logits: (depth, draft vocab), position d
    predicting the token d + 1 below the root. tree_top_k = 1: a chain of each position's draw
    (`slot_drafts`: greedy or sampled, ended early by stop_below). Otherwise the tree of
    `shape` (`confident_shape` of these logits when None), ranked when greedy, sampled else."""
    if decode.chain:
        return slot_drafts(
            logits[None], [logits.shape[0]], decode=decode, sampling=sampling,
            generator=generator, vocab=vocab, device=device,
        )[0]  # fmt: skip
    if shape is None:
        shape = confident_shape(logits, decode, sampling)
    if sampling.greedy:
        return ranked_tree(logits, shape, vocab, device)
    return sampled_tree(logits, shape, sampling, vocab, generator)


def slot_drafts(
    logits: torch.Tensor,
    depths: list[int],
    *,
    decode: DecodeConfig,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    vocab: DraftVocab | None,
    device: torch.device,
) -> list[DraftTree]:
    """What the rows of one parallel pass draft from their slots' logits (rows, deepest, draft
    vocab), slot d predicting the token d + 1 below the row's root: each row's chain drawn slot
    by slot (drafting.draft_chains: its depth, its stop_below; a slot does not read the token
    drawn before it), or for one row with tree_top_k > 1 the tree of its slots' top candidates
    (`position_tree`)."""
    if not decode.chain:
        return [
            position_tree(
                logits[0, : depths[0]], decode=decode, sampling=sampling, generator=generator,
                vocab=vocab, device=device,
            )
        ]  # fmt: skip
    return draft_chains(
        logits[:, 0],
        lambda token, i: logits[:, i + 1],
        depths=depths,
        sampling=sampling,
        generator=generator,
        stop_below=decode.stop_below,
        vocab=vocab,
    )


def sampled_tree_reach(
    q_logits: torch.Tensor,
    target_logits: torch.Tensor,
    input_ids: torch.Tensor,
    contexts: torch.Tensor,
    ends: torch.Tensor,
    gamma: int,
    shape_at: Callable[[torch.Tensor], TreeShape],
    d2t: torch.Tensor | None = None,
    samples: int = 64,
) -> torch.Tensor:
    """(batch, seq, gamma): sampling, the chance that the tree drafted after
    a context ending at c has its first d nodes on the batch's tokens accepted (index d - 1),
    given that the loop emits the batch's tokens: what `served.chain_reach` is for a chain,
    for `sampled_tree`'s trees under recursive rejection sampling. Computed where `contexts`
    (batch, seq) is true, 0 elsewhere; ends (batch,): each row's length.

    q_logits (batch, seq, D, draft vocab): position d - 1's logits after a context ending at c
    (the same for every node at depth d), and target_logits (batch, seq, vocab), both divided
    by the temperature sampled at; shape_at: the tree drafted from a context's (depth, draft
    vocab) logits, as deep as the loop drafts there (`generate`: no deeper than the tokens
    left allow, so shallower within gamma tokens of a row's end); d2t: draft ids as the
    target's.

    Given its parent accepted, a node's children are drawn from q without replacement and
    tried in order. Child m (0-based) is accepted holding the emitted token x with probability
    R_m min(q_m(x), p_m(x)), summed over the draws of its elder siblings: R_m the chance they
    were all rejected, q_m the q left after their tokens, p_m the residual the rejections leave
    of the target's p. Divided by p(x), the chance x is emitted there, it is the chance child
    m was accepted given x. Exact for the eldest child; for the others the mean over `samples`
    draws of the elder siblings (seeded: the same figure every call)."""
    B, T, D = q_logits.shape[:3]
    out = q_logits.new_zeros(B, T, gamma, dtype=torch.float)
    generator = torch.Generator(device=q_logits.device).manual_seed(0)
    for b, c in contexts.nonzero().tolist():
        depth = min(D, gamma, int(ends[b]) - 2 - c)  # as deep as the loop drafts after c
        if depth <= 0:
            continue
        shape = shape_at(q_logits[b, c, :depth])
        siblings = [0] * len(shape.parents)  # each node's index among its parent's children
        for kids in children_of(shape.parents).values():
            for m, kid in enumerate(kids):
                siblings[kid] = m
        width = [0] * depth  # the most children a node at each depth has
        for m, d in zip(siblings, shape.depths, strict=True):
            if d <= depth:
                width[d - 1] = max(width[d - 1], m + 1)
        accepted = []  # per depth, per sibling index: the chance given x
        for i in range(depth):
            q = q_logits[b, c, i].float().softmax(-1)
            if d2t is not None:
                q = q.new_zeros(target_logits.shape[-1]).index_copy_(0, d2t, q)
            p = target_logits[b, c + i].float().softmax(-1)
            x = int(input_ids[b, c + 1 + i])
            accepted.append(_child_acceptance(q, p, x, width[i], samples, generator))
        reach = [1.0] * len(shape.parents)
        for n, (parent, d) in enumerate(zip(shape.parents, shape.depths, strict=True)):
            if d > depth:
                reach[n] = 0.0
                continue
            above = reach[parent] if parent >= 0 else 1.0
            reach[n] = above * accepted[d - 1][siblings[n]]
            out[b, c, d - 1] += reach[n]
    return out


def _child_acceptance(
    q: torch.Tensor, p: torch.Tensor, x: int, width: int, samples: int, generator
) -> list[float]:
    """`sampled_tree_reach`'s chance that child m (m < width) of a node is accepted holding token
    x, given that x is emitted there: q, p (vocab,) the draft and target distributions."""
    if width <= 0 or p[x] <= 0:
        return [0.0] * max(width, 0)
    out = [float(torch.minimum(q[x], p[x]) / p[x])]
    if width == 1:
        return out
    # the elder siblings' draws: Gumbel top-k is drawing without replacement, in order
    noise = (
        -torch.empty(samples, q.shape[0], device=q.device).exponential_(generator=generator).log()
    )
    drawn = (q.log()[None] + noise).topk(width - 1, dim=-1).indices  # (samples, width - 1)
    p_res = p[None].repeat(samples, 1)  # (samples, vocab): the residual after the rejections
    q_left = q[None].repeat(samples, 1)  # q without the elder siblings' tokens, unnormalised
    rejected = torch.ones(samples, device=q.device)  # the chance every elder one was rejected
    for m in range(width - 1):
        t = drawn[:, m : m + 1]
        left = q_left.sum(-1, keepdim=True)  # (samples, 1)
        q_m = q_left / left  # the q child m is drawn from and verified with
        q_t, p_t = q_m.gather(-1, t)[:, 0], p_res.gather(-1, t)[:, 0]
        a = torch.where(q_t > 0, (p_t / q_t.clamp(min=1e-30)).clamp(max=1.0), 0.0)
        rejected = rejected * (1 - a)
        residual = (p_res - q_m).clamp(min=0.0)
        total = residual.sum(-1, keepdim=True)
        # an empty residual only comes from rounding (the child was sure to be accepted)
        p_res = torch.where(total > 1e-12, residual / total.clamp(min=1e-30), p_res)
        q_left = q_left.scatter(-1, t, 0.0)
        q_next = q_left[:, x] / q_left.sum(-1).clamp(min=1e-30)
        out.append(float((rejected * torch.minimum(q_next, p_res[:, x])).mean() / p[x]))
    return [min(a, 1.0) for a in out]


def tree_reach(
    drafter: Drafter,
    batch: Mapping[str, torch.Tensor],
    target_out,
    decode: DecodeConfig,
    shape_at: Callable[[torch.Tensor], TreeShape] | None = None,
    temperature: float = 1.0,
) -> torch.Tensor | None:
    """A kind's `sampled_tree_reach` (served.sampled_reach's tree) where its positions draft
    side by side and its session serves them as a tree: over its `served_logits` at
    `temperature`, at the contexts the walk visits (those whose next token is scored). shape_at: the tree the
    session samples from a context's (depth, draft vocab) logits, divided by the temperature;
    by default `confident_shape`, as a block drafter's session shapes each proposal."""
    logits = drafter.served_logits(batch, target_out, decode)
    if logits is None:
        return None
    logits = logits / temperature  # as the session processes them (no top-k, top-p)
    if shape_at is None:
        divided = SamplingSettings(temperature=1.0)  # the logits are divided already
        shape_at = lambda q_logits: confident_shape(q_logits, decode, divided)  # noqa: E731
    scored = batch["loss_mask"].bool()
    contexts = torch.cat([scored[:, 1:], torch.zeros_like(scored[:, :1])], dim=1)
    vocab = drafter.draft_vocab()
    return sampled_tree_reach(
        logits,
        target_out.logits / temperature,
        batch["input_ids"],
        contexts,
        batch["attention_mask"].sum(1),
        decode.gamma,
        shape_at,
        None if vocab is None else vocab.d2t,
    )
