"""Medusa's drafting (kinds/medusa/medusa.py holds the kind): the session the inference loop
drives, its tree built from the heads' measured accuracies (drafters/position_tree.py), and
Medusa's (lossy) typical acceptance, the session's own rule at temperature > 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import cache
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from specdraft.core import DecodeConfig, DraftContext, DraftTree, SamplingSettings, children_of
from specdraft.drafters.lean import DraftLinear, use_int8
from specdraft.drafters.position_tree import TreeShape, position_tree, tree_paths
from specdraft.drafters.sessions import BatchSession

if TYPE_CHECKING:
    from specdraft.kinds.medusa.medusa import MedusaDrafter


# --- session (inference) ---------------------------------------------------------------------------


def tree_shapes(accuracy: torch.Tensor, decode: DecodeConfig) -> Callable[[int], TreeShape]:
    """depth -> the tree of `tree_paths` for drafts up to that deep (shallower only at the end of
    generation), from the heads' (K, R) accuracies; each built once."""

    @cache
    def shape(depth: int) -> TreeShape:
        paths = tree_paths(accuracy, decode.tree_budget, depth, decode.tree_top_k)
        return TreeShape.from_paths(paths)

    return shape


class MedusaDraftingWeights:
    """The heads as drafting runs them: each block and output layer a DraftLinear (int8 copies
    with draft_weights=int8 on a CPU)."""

    @torch.no_grad()
    def __init__(self, drafter: MedusaDrafter, int8: bool) -> None:
        self.dtype = drafter.heads[0].blocks[0].linear.weight.dtype
        self.blocks = [
            [DraftLinear(b.linear.weight, b.linear.bias, int8=int8) for b in head.blocks]
            for head in drafter.heads
        ]
        if drafter.config.output == "shared":
            lm = drafter.target.model.get_output_embeddings()
            self.shared = DraftLinear(lm.weight, lm.bias, int8=int8)
            self.outputs = None
        else:
            self.shared = None
            self.outputs = [DraftLinear(head.out.weight, int8=int8) for head in drafter.heads]

    def logits(self, h: torch.Tensor, heads: int) -> torch.Tensor:
        """(..., hidden) -> (heads, ..., draft vocab) logits of the first `heads` heads."""
        xs = []
        for blocks in self.blocks[:heads]:
            x = h.to(self.dtype)
            for lin in blocks:
                x = x + F.silu(lin(x).to(x.dtype))
            xs.append(x)
        if self.shared is not None:
            return self.shared(torch.stack(xs)).float()
        return torch.stack([out(x).float() for out, x in zip(self.outputs, xs, strict=False)])

    def memory_bytes(self) -> int:
        linears = [lin for blocks in self.blocks for lin in blocks]
        linears += [self.shared] if self.shared is not None else self.outputs
        return sum(lin.memory_bytes() for lin in linears)


class MedusaSession(BatchSession):
    """One generate call's drafting for its rows (one for a prompt decoded alone): each row's
    target hidden state at its last verified token, and one pass of the heads over every
    drafting row's at once.

    A row drafts nothing before the prompt's forward (no hidden state). After each
    verification, `accept` keeps each row's hidden state of its last accepted position (the
    last pending token when nothing was accepted): its LM-head output is the token now pending
    (the root), and head k drafts the token k + 1 below it.

    Drafting (settings from `decode`), each row from its heads' logits: tree_top_k = 1 drafts a
    chain of the heads' top tokens (sampled from each head's q at temperature > 0, which
    lossless verification needs, and ending early by stop_below); tree_top_k > 1 drafts the
    tree of `tree_paths`, built once per call from the heads' measured accuracies, with up to
    tree_budget nodes, gamma levels and tree_top_k candidates per head: the heads' top
    candidates when greedy, and at temperature > 0 each node's children sampled from their
    head's q without replacement (position_tree.sampled_tree).
    """

    def __init__(
        self,
        drafter: MedusaDrafter,
        target,
        rows: int = 1,
        *,
        sampling: SamplingSettings,
        decode: DecodeConfig,
        generator: torch.Generator | None = None,
    ) -> None:
        decode = drafter.decode_settings(decode)  # the kind's own class, whatever was passed
        if decode.acceptance == "typical":
            # Typical acceptance needs no draft distribution q: the heads draft their top
            # candidates, as the reference's do, rather than sampling from q.
            sampling = SamplingSettings()
        self.drafter = drafter
        self.sampling = sampling
        self.decode = decode
        self.generator = generator
        self.capture_layers: list[int] = list(drafter.capture_layers)
        int8 = use_int8(decode.draft_weights, target.device, "the heads' full weights")
        params = [*drafter.parameters(), drafter.target.model.get_output_embeddings().weight]
        self.w = drafter._drafting.get(params, int8, lambda: MedusaDraftingWeights(drafter, int8))
        self.vocab = drafter.draft_vocab()
        self.depth = min(decode.gamma, drafter.config.num_heads)
        self.lossy = not decode.lossless
        self.h: list[torch.Tensor | None] = [None] * rows  # (hidden,) at the last verified
        if not decode.chain:
            self._shape = tree_shapes(drafter.accuracies(sampling.greedy), decode)

    def verify_sampled(
        self, row: int, tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[list[int], int] | None:
        """Typical acceptance where decode asks for it (lossy), else the loop's exact rule."""
        if not self.lossy:
            return None
        return verify_typical(
            tree, p, generator, epsilon=self.decode.typical_epsilon, delta=self.decode.typical_delta
        )

    @torch.no_grad()
    def propose(self, contexts: Sequence[DraftContext | None]) -> list[DraftTree]:
        depths = [
            0 if c is None or h is None else max(min(self.depth, c.max_depth), 0)
            for c, h in zip(contexts, self.h, strict=True)
        ]
        drafting = [r for r, d in enumerate(depths) if d > 0]
        trees = [DraftTree.empty(1, c.tokens.device if c is not None else None) for c in contexts]
        if drafting:
            h = torch.stack([self.h[r] for r in drafting])  # (rows, hidden)
            logits = self.w.logits(h, max(depths))  # (depth, rows, draft vocab)
            for i, r in enumerate(drafting):
                trees[r] = self._draft(logits[: depths[r], i], contexts[r].tokens.device)
        return trees

    def _draft(self, logits: torch.Tensor, device: torch.device) -> DraftTree:
        """The chain or tree drafted from the heads' logits (depth, draft vocab)."""
        shape = None if self.decode.chain else self._shape(logits.shape[0])
        return position_tree(
            logits, decode=self.decode, sampling=self.sampling, generator=self.generator,
            vocab=self.vocab, device=device, shape=shape,
        )  # fmt: skip

    @torch.no_grad()
    def accept(
        self,
        trees: Sequence[DraftTree],
        paths: Sequence[list[int]],
        hidden_states: Sequence[Mapping[int, torch.Tensor] | None],
    ) -> None:
        """Keep each row's hidden state of the last accepted position of this verification
        forward (its positions: the pending tokens, then the tree's nodes in node order)."""
        for r, (tree, path, hidden) in enumerate(zip(trees, paths, hidden_states, strict=True)):
            if hidden is None:
                raise ValueError(
                    "MedusaSession.accept needs hidden_states: the verification forward's final "
                    f"normed hidden states (layer {self.capture_layers[0]})"
                )
            h = hidden[self.capture_layers[0]]  # (1, pending + n, hidden)
            pending = h.shape[1] - len(tree)
            if pending < 1:
                raise ValueError(
                    f"MedusaSession.accept got hidden states for {h.shape[1]} positions; "
                    f"expected the pending token(s) then the {len(tree)} tree nodes"
                )
            self.h[r] = h[0, pending + path[-1] if path else pending - 1]

    def drop(self, keep: Sequence[int]) -> None:
        self.h = [self.h[r] for r in keep]

    def extra_memory_bytes(self) -> int:
        """The drafting copies of the heads' weights (int8 or fused); no KV cache."""
        return self.w.memory_bytes()


# --- typical acceptance -----------------------------------------------------------------------


def verify_typical(
    tree: DraftTree,
    p: torch.Tensor,
    generator: torch.Generator | None,
    *,
    epsilon: float,
    delta: float,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance over the tree (Cai et al. 2024). LOSSY: it keeps a draft token
    the target finds plausible enough, p(x) > min(epsilon, delta * exp(-H(p))), instead of one
    it would have sampled, so output drifts from p (towards the draft's likelier tokens) in
    exchange for longer accepted paths. The loop uses it only when decode.acceptance asks
    (MedusaDecode) and records the run as lossy.

    p: (n + 1, vocab) the target's processed distribution at the root and at each node.
    1. At a node whose distribution is p, the threshold is min(epsilon, delta * exp(-H(p))); a
       child x passes when p(x) is above its parent's threshold.
    2. Of the root-to-node paths whose every node passes, take the longest (ties: the more
       likely child, by p, at the first place they part), as the Medusa reference does.
    3. The token after the path is drawn from p at the last accepted node (the root when none):
       with nothing accepted the step is plain sampling.

    Against the Medusa reference (FasterDecoding/Medusa, medusa/model/utils.py,
    `evaluate_posterior` and `generate_candidates`): the same per-token rule (strictly above
    min(posterior_threshold, posterior_alpha * exp(-H)), p the softmax at the temperature) and
    the same longest accepted path, but ties between equally long paths go to the likelier
    child where they part, where the reference takes the larger sum of log p along the path;
    its entropy adds 1e-5 inside the log, H here is exact; and
    its default (fast=True) takes the token after the path as the argmax of p there, not a
    draw, which would pull output towards greedy even when no draft is accepted. p here is also
    after top-k / top-p, as everywhere in the loop.
    """
    n = len(tree)
    # entr(p) = -p log p, 0 where p is 0 (tokens top-k / top-p removed)
    entropy = torch.special.entr(p).sum(-1)  # (n + 1,)
    threshold = (delta * torch.exp(-entropy)).clamp(max=epsilon)  # (n + 1,)
    # one draw per row, so the walk and the token after it need a single host sync
    draws = torch.multinomial(p, 1, generator=generator)[:, 0]  # (n + 1,)
    if n:
        rows = torch.tensor(tree.parents, device=p.device) + 1  # node i is scored at its parent
        x = tree.tokens[0].to(p.device)  # (n,)
        px = p[rows, x]  # (n,)
        ok = (px > threshold[rows]).double()  # (n,) strictly above, as the reference
        decided = torch.cat([ok, px.double(), draws.double()]).tolist()
        ok_list, px_list = decided[:n], decided[n : 2 * n]
        draw_list = [int(d) for d in decided[2 * n :]]
    else:
        ok_list, px_list, draw_list = [], [], draws.tolist()
    # reach[i]: nodes on the longest passing path from node i down (0: i fails); children
    # come after their parents, so a reverse pass has seen every child of i before i
    reach, below = [0] * n, [0] * n  # below[i]: the longest reach among i's children
    for i in reversed(range(n)):
        reach[i] = 1 + below[i] if ok_list[i] else 0
        if tree.parents[i] >= 0:
            below[tree.parents[i]] = max(below[tree.parents[i]], reach[i])
    children = children_of(tree.parents)
    path: list[int] = []
    node = -1
    while True:
        passing = [c for c in children.get(node, ()) if ok_list[c]]
        if not passing:
            return path, draw_list[node + 1]
        nxt = max(passing, key=lambda c: (reach[c], px_list[c], -c))
        path.append(nxt)
        node = nxt
