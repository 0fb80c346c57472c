"""Turning a drafter's logits into drafted tokens: the target's sampling settings applied to logits,
a reduced draft vocabulary, one drafted token with its q, and the two ways a drafter grows a
draft (a chain, EAGLE-2's best-first tree). The bottom layer (docs/architecture.md, "Layers"),
beside core.py's types.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from specdraft.core import DraftTree, SamplingSettings


def process_logits(logits: torch.Tensor, sampling: SamplingSettings) -> torch.Tensor:
    """(..., vocab) logits -> (..., vocab) probabilities after temperature, top-k and top-p (the
    order transformers applies them). The output of speculative sampling follows exactly these."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k > 0 and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # drop a token when the tokens ranked above it already reach top_p; the first always stays
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= sampling.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


@dataclass(frozen=True)
class DraftVocab:
    """A reduced draft vocabulary (EAGLE-3's, Medusa's): draft id i is target id d2t[i]."""

    d2t: torch.Tensor  # (draft vocab,) target ids
    vocab_size: int  # the target's
    t2d: torch.Tensor  # (vocab_size,) each target id's draft id, -1 outside the draft vocabulary

    def to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return self.d2t[ids]

    def spread(self, q: torch.Tensor) -> torch.Tensor:
        """(batch, draft vocab) -> (batch, target vocab) probabilities, 0 outside the draft."""
        full = torch.zeros(q.shape[0], self.vocab_size, dtype=q.dtype, device=q.device)
        return full.index_copy_(-1, self.d2t, q)


def build_draft_vocab(
    examples_or_counts: Iterable | torch.Tensor,
    size: int,
    vocab_size: int,
    *,
    always: Iterable[int] = (),
) -> torch.Tensor:
    """The draft vocabulary d2t: (size,) target ids, ascending, of the most frequent tokens.

    `examples_or_counts` is either a (vocab_size,) tensor of token counts or training examples
    (with `input_ids` and `loss_mask`; the tokens the head will be trained to predict are
    counted). `always` (the EOS ids) are included whatever their count, so the head can end a
    draft. Ties go to the lower id, so the result is deterministic.
    """
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size {size} must be in 1..{vocab_size}")
    if isinstance(examples_or_counts, torch.Tensor):
        counts = examples_or_counts.double().flatten()
        if counts.numel() != vocab_size:
            raise ValueError(f"token counts have {counts.numel()} entries, vocab is {vocab_size}")
    else:
        counts = torch.zeros(vocab_size, dtype=torch.double)
        for e in examples_or_counts:
            ids = torch.as_tensor(e.input_ids, dtype=torch.long)
            keep = torch.as_tensor(e.loss_mask, dtype=torch.bool)
            counts += torch.bincount(ids[keep], minlength=vocab_size).double()
    always = sorted({int(i) for i in always if 0 <= int(i) < vocab_size})
    if len(always) > size:
        raise ValueError(f"draft vocabulary size {size} cannot hold the {len(always)} EOS ids")
    score = counts.clone()
    score[always] = float("inf")
    # stable sort on -count keeps ascending ids among equal counts
    order = torch.sort(-score, stable=True).indices
    return torch.sort(order[:size]).values


def draft_token(
    logits: torch.Tensor,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    vocab: DraftVocab | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One drafted token from (batch, draft vocab) logits: (token (batch, 1) target ids, q).

    Greedy: the argmax, q None (a point mass). Sampling: drawn from q, the draft distribution
    after the same temperature / top-k / top-p as the target's, (batch, target vocab), which
    lossless verification needs.
    """
    if sampling.greedy:
        best = logits.argmax(-1, keepdim=True)
        return (best if vocab is None else vocab.to_target(best)), None
    q = process_logits(logits, sampling)  # (batch, draft vocab)
    if vocab is not None:
        q = vocab.spread(q)
    return torch.multinomial(q, 1, generator=generator), q


def draft_chain(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    depth: int,
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    stop_below: float = 0.0,
    vocab: DraftVocab | None = None,
) -> DraftTree:
    """A chain of up to `depth` tokens: draw from `logits` (batch, draft vocab), feed the token
    back with `step(token (batch, 1), i) -> next logits` (i: the token's index in the chain) and
    repeat; the last token is never fed.

    With stop_below > 0 the chain ends after a position where the drafter is unsure: its most
    likely token has less probability than stop_below (softmax of the logits when greedy, the
    largest entry of q when sampling: the drafter's confidence, not the luck of the draw). That
    token is still verified. The rule looks only at the draft so far, so sampling stays exact.
    """
    return draft_chains(
        logits, step, depths=[depth], sampling=sampling, generator=generator,
        stop_below=stop_below, vocab=vocab,
    )[0]  # fmt: skip


def draft_chains(
    logits: torch.Tensor,
    step: Callable[[torch.Tensor, int], torch.Tensor],
    *,
    depths: Sequence[int],
    sampling: SamplingSettings,
    generator: torch.Generator | None,
    stop_below: float = 0.0,
    vocab: DraftVocab | None = None,
) -> list[DraftTree]:
    """`draft_chain` for the rows of a batch, each row its own chain: row r (of logits (rows,
    draft vocab)) drafts at most depths[r] tokens and ends after its first unsure position
    (stop_below); the rows are fed together until every row's chain has ended, and each row's
    chain is cut where its own ends. A row of depth 0 gets an empty tree.
    """
    rows, deepest = logits.shape[0], max(depths, default=0)
    if deepest <= 0:
        return [DraftTree.empty(1, logits.device) for _ in range(rows)]
    if stop_below > 0:  # a row goes on below level i + 1 (deeper) while it is sure (going)
        deeper = torch.tensor(depths, device=logits.device)
        going = torch.ones(rows, dtype=torch.bool, device=logits.device)
    tokens, qs, sure = [], [], []
    for i in range(deepest):
        token, q = draft_token(logits, sampling, generator, vocab)
        tokens.append(token)
        if q is not None:
            qs.append(q)
        if stop_below > 0:
            top = q.max(-1).values if q is not None else logits.float().softmax(-1).max(-1).values
            sure.append(top >= stop_below)
            going &= sure[-1]
            if not bool((going & (deeper > i + 1)).any()):
                break  # every chain has ended: no row reads another level
        if i + 1 < deepest:
            logits = step(token, i)
    drafted = torch.cat(tokens, dim=1)  # (rows, deepest)
    q_all = torch.stack(qs, dim=1) if qs else None
    # a row's chain ends after its first unsure position, and at its depth
    confident = (
        torch.stack(sure, dim=1).long().cumprod(1).sum(1).tolist() if sure else [deepest] * rows
    )
    chains = []
    for r in range(rows):
        n = min(depths[r], confident[r] + 1)
        q = None if q_all is None else q_all[r : r + 1, :n]
        chains.append(
            DraftTree.chain(drafted[r : r + 1, :n], q)
            if n > 0
            else DraftTree.empty(1, logits.device)
        )
    return chains


# An expand callback of `draft_tree`: feed the given nodes together and return their next-token
# logits (f, draft vocab). Arguments: the nodes' tree ids, their target token ids, their parents'
# tree ids (-1: the root), `visible` (f, fed + f) bool over every node fed so far in feed order
# then these (each sees its fed ancestors and itself), and their depth.
Expand = Callable[[list[int], list[int], list[int], torch.Tensor, int], torch.Tensor]


def draft_tree(
    root_logits: torch.Tensor,
    expand: Expand,
    *,
    depth: int,
    top_k: int,
    budget: int,
    vocab: DraftVocab | None = None,
) -> tuple[DraftTree, list[int]]:
    """EAGLE-2's dynamic tree (batch 1), grown best-first from (draft vocab,) root logits.

    1. Level 1: the root's top_k tokens, scored by their draft log-probability.
    2. Each further level: the top_k nodes of the newest level by cumulative log-probability are
       fed together (`expand`) and each gets its top_k children, scored by parent score + own
       log-probability.
    3. Rerank all nodes by score and keep the best `budget`: a child never outscores its parent,
       so the kept set is a tree (ties go to the shallower node).

    Nodes are point masses (q None) also when sampling: the rerank keeps or drops a node by its
    own token's probability, so a sampled child that survived it would not be distributed as q.
    Returns the tree and, per kept node, its slot in feed order (-1: never fed), which tells a
    drafter with a KV cache which of its entries belong to an accepted node.
    """
    device = root_logits.device

    def best(logits: torch.Tensor) -> tuple[list, list]:
        logp = F.log_softmax(logits.float(), dim=-1)
        scores, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
        ids = ids if vocab is None else vocab.to_target(ids)
        return scores.tolist(), ids.tolist()

    cum, toks = best(root_logits)
    parents, depths = [-1] * len(toks), [1] * len(toks)
    newest = list(range(len(toks)))
    fed: list[int] = []  # node ids in feed order
    for d in range(2, depth + 1):
        frontier = sorted(newest, key=lambda i: -cum[i])[:top_k]
        slot = {node: s for s, node in enumerate(fed)}
        visible = torch.zeros(len(frontier), len(fed) + len(frontier), dtype=torch.bool)
        for row, node in enumerate(frontier):
            visible[row, len(fed) + row] = True
            a = parents[node]
            while a >= 0:
                visible[row, slot[a]] = True
                a = parents[a]
        logits = expand(
            frontier, [toks[n] for n in frontier], [parents[n] for n in frontier], visible, d - 1
        )  # (f, draft vocab)
        fed += frontier
        child_scores, child_toks = best(logits)
        newest = []
        for row, node in enumerate(frontier):
            for score, tok in zip(child_scores[row], child_toks[row], strict=True):
                newest.append(len(toks))
                toks.append(tok)
                parents.append(node)
                depths.append(d)
                cum.append(cum[node] + score)
    order = sorted(range(len(toks)), key=lambda i: (-cum[i], depths[i], i))
    keep: set[int] = set()
    for i in order:
        if len(keep) == budget:
            break
        if parents[i] < 0 or parents[i] in keep:
            keep.add(i)
    kept = sorted(keep, key=lambda i: (depths[i], i))  # topological: parents first
    new_index = {old: new for new, old in enumerate(kept)}
    slot = {node: s for s, node in enumerate(fed)}
    tree = DraftTree(
        torch.tensor([[toks[i] for i in kept]], device=device),
        [new_index[parents[i]] if parents[i] >= 0 else -1 for i in kept],
        [depths[i] for i in kept],
        None,
    )
    return tree, [slot.get(i, -1) for i in kept]
