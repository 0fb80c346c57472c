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
from dataclasses import dataclass

import torch

from specdraft.core import (
    DecodeConfig,
    DraftTree,
    DraftVocab,
    SamplingSettings,
    children_of,
    draft_chain,
    process_logits,
)


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
    (core.draft_chain: greedy or sampled, ended early by stop_below). Otherwise the tree of
    `shape` (`confident_shape` of these logits when None), ranked when greedy, sampled else."""
    depth = logits.shape[0]
    if decode.chain:
        return draft_chain(
            logits[0:1],
            lambda _token, i: logits[i + 1 : i + 2],
            depth=depth,
            sampling=sampling,
            generator=generator,
            stop_below=decode.stop_below,
            vocab=vocab,
        )
    if shape is None:
        shape = confident_shape(logits, decode, sampling)
    if sampling.greedy:
        return ranked_tree(logits, shape, vocab, device)
    return sampled_tree(logits, shape, sampling, vocab, generator)
