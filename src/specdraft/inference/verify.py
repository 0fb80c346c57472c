"""Accepting a draft tree against the target: greedy, and lossless sampling.

Each returns the accepted path (node indices, root to leaf) and the one token the target adds after
it: the correction at the first rejection, or the bonus token below an accepted leaf. Row 0 of the
target's per-node outputs belongs to the root (the last emitted token); row 1 + i to node i.

Lossless sampling (Leviathan et al. 2023, Chen et al. 2023; for trees, recursive rejection as in
SpecInfer): at a node with target distribution p, try its children in turn. Child x_i, drawn from
draft distribution q_i, is accepted with probability min(1, p'(x_i) / q_i(x_i)), where p' starts as
p; on rejection p' <- norm(max(p' - q_i, 0)). A deterministic child is a point mass q_i = δ(x_i), so
its rejection only removes x_i's mass. If every child is rejected, the token is sampled from p'.
Each emitted token then has exactly the distribution p, whatever the draft.

A session may bring its own rule for temperature > 0 (`DraftSession.verify_sampled`): Medusa's
typical acceptance, which is lossy, lives with the Medusa kind (kinds/medusa/medusa_session.py).
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
