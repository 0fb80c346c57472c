"""Accepting a draft tree against the target: greedy, lossless sampling, and Medusa's (lossy)
typical acceptance.

Each returns the accepted path (node indices, root to leaf) and the one token the target adds after
it: the correction at the first rejection, or the bonus token below an accepted leaf. Row 0 of the
target's per-node outputs belongs to the root (the last emitted token); row 1 + i to node i.

Lossless sampling (Leviathan et al. 2023, Chen et al. 2023; for trees, recursive rejection as in
SpecInfer): at a node with target distribution p, try its children in turn. Child x_i, drawn from
draft distribution q_i, is accepted with probability min(1, p'(x_i) / q_i(x_i)), where p' starts as
p; on rejection p' <- norm(max(p' - q_i, 0)). A deterministic child is a point mass q_i = δ(x_i), so
its rejection only removes x_i's mass. If every child is rejected, the token is sampled from p'.
Each emitted token then has exactly the distribution p, whatever the draft.

Typical acceptance (Medusa, Cai et al. 2024) is LOSSY: it keeps a draft token the target finds
plausible enough, p(x) > min(epsilon, delta * exp(-H(p))), instead of one it would have sampled,
so output drifts from p (towards the draft's likelier tokens) in exchange for longer accepted
paths. The loop uses it only when asked (DecodeConfig.acceptance) and records the run as lossy.
"""

from __future__ import annotations

import torch

from specdraft.core import DraftTree, children_of


def verify_greedy(tree: DraftTree, target_tokens: list[int]) -> tuple[list[int], int]:
    """Accept the children that equal the target's argmax, depth by depth.

    target_tokens: the target's argmax at the root and at each node (n + 1 entries).
    """
    tokens = tree.tokens[0].tolist()
    if tree.is_chain:  # the common case, without building the children map
        accepted = 0
        while accepted < len(tokens) and tokens[accepted] == target_tokens[accepted]:
            accepted += 1
        return list(range(accepted)), target_tokens[accepted]
    children = children_of(tree.parents)
    path: list[int] = []
    node = -1
    while True:
        wanted = target_tokens[node + 1]
        nxt = next((c for c in children.get(node, ()) if tokens[c] == wanted), None)
        if nxt is None:
            return path, wanted
        path.append(nxt)
        node = nxt


def verify_sampling(
    tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling over the tree (module docstring).

    p: (n + 1, vocab) the target's processed distribution at the root and at each node.
    """
    if tree.is_chain:
        return _verify_chain(tree, p, generator)
    return _verify_tree(tree, p, generator)


def _verify_chain(
    tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """The chain case of `_verify_tree`, decided on the device with one host sync per step (the
    tree walk syncs once per child tried, which a GPU decode step feels). The same uniforms, the
    same comparisons (in float64, as the walk's Python floats) and the same residual, so for a
    given generator it returns exactly what the walk returns."""
    n = len(tree)
    if n == 0:
        return [], int(torch.multinomial(p[0], 1, generator=generator).item())
    x = tree.tokens[0].to(p.device)  # (n,)
    u = torch.rand(n, generator=generator, device=p.device).double()
    px = p[:n].gather(-1, x[:, None])[:, 0].double()  # p(x_i) at the row before node i
    if tree.q is None:  # point masses: accept x_i with probability p(x_i)
        ok = u < px
    else:
        q = tree.q[0].to(p.device)  # (n, vocab)
        qx = q.gather(-1, x[:, None])[:, 0]
        ok = (qx > 0) & (u * qx.double() < px)  # q >= p: always accept
    k = ok.long().cumprod(0).sum()  # accepted prefix length, on the device
    row = k.clamp(max=n - 1)
    p_k = p.index_select(0, row.view(1))[0]
    if tree.q is None:
        residual = p_k.scatter(0, x.index_select(0, row.view(1)), 0.0)
    else:
        residual = (p_k - q.index_select(0, row.view(1))[0]).clamp(min=0.0)
    total = residual.sum()
    # An empty residual only comes from rounding (x was accepted with probability one): then
    # the rejection is ignored, as in the walk.
    residual = torch.where(total > 1e-12, residual / total, p_k)
    final = torch.where(k < n, residual, p[n])
    token = torch.multinomial(final, 1, generator=generator)[0]
    accepted, nxt = torch.stack([k, token]).tolist()
    return list(range(accepted)), nxt


def _verify_tree(
    tree: DraftTree, p: torch.Tensor, generator: torch.Generator | None
) -> tuple[list[int], int]:
    """Recursive rejection sampling, walking the tree node by node."""
    tokens = tree.tokens[0].tolist()
    q = tree.q[0].to(p.device) if tree.q is not None else None  # (n, vocab); None: point masses
    children = children_of(tree.parents)
    # One uniform per node, drawn up front: a single random call and host sync per step.
    u = torch.rand(len(tokens), generator=generator, device=p.device).tolist()
    path: list[int] = []
    node = -1
    while True:
        p_res = p[node + 1]
        accepted = None
        for c in children.get(node, ()):
            x = tokens[c]
            if q is None:
                # q_c = δ(x): accept with probability p'(x); rejection removes x's mass
                if u[c] < p_res[x].item():
                    accepted = c
                    break
                residual = p_res.clone()
                residual[x] = 0.0
            else:
                px, qx = p_res[x].item(), q[c, x].item()
                if qx > 0 and u[c] * qx < px:  # q >= p: always accept (u < p/q, without dividing)
                    accepted = c
                    break
                residual = (p_res - q[c]).clamp_(min=0.0)
            total = residual.sum().item()
            # An empty residual means p' <= q_c everywhere, so x was accepted with probability
            # one; only rounding gets here, and then the rejection is ignored.
            if total > 1e-12:
                p_res = residual / total
        if accepted is None:
            return path, int(torch.multinomial(p_res, 1, generator=generator).item())
        path.append(accepted)
        node = accepted


def verify_typical(
    tree: DraftTree,
    p: torch.Tensor,
    generator: torch.Generator | None,
    *,
    epsilon: float,
    delta: float,
) -> tuple[list[int], int]:
    """Medusa's typical acceptance over the tree (module docstring): lossy, output does not
    follow p.

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
