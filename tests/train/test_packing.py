"""Packed rows (data.pack) train exactly as the same conversations padded, one to a row: for every
kind, the loss sum, the count of scored tokens it is divided by, and every gradient, with ragged
lengths, documents whose loss starts at their second token, and a row's padding. The shared
tiny fixtures and kinds are test_loss_token_mean's."""

from __future__ import annotations

import pytest
import torch
from test_loss_token_mean import KINDS, _build

from specdraft.data.formats import Example
from specdraft.data.packing import pack_documents
from specdraft.targets.target import load_target
from specdraft.train.schedule import collate

pytestmark = pytest.mark.exact


def _ragged(vocab: int) -> list[Example]:
    """Seven conversations of ragged lengths; loss from the second token on in some (what a
    boundary that leaks would train on), late in others."""
    g = torch.Generator().manual_seed(7)
    out = []
    for length, prompt in ((20, 1), (5, 2), (14, 9), (9, 1), (3, 1), (12, 4), (2, 1)):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(Example(ids, [0] * prompt + [1] * (length - prompt), f"conversation {length}"))
    return out


def _loss_and_grads(drafter, target, batch):
    """(loss sum, scored tokens, gradients of the token mean) of one micro-batch, in fp32."""
    drafter.zero_grad(set_to_none=True)
    out = None
    if not drafter.runs_target:
        from specdraft.attention import target_inputs

        out = target.forward(
            batch["input_ids"], **target_inputs(batch), capture_layers=drafter.capture_layers
        )
    loss, _ = drafter(batch, out)
    count = drafter.loss_tokens(batch)
    (loss / count).backward()
    grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
    return float(loss), float(count), grads


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_packed_rows_train_exactly_as_padded_ones(tiny_target_path, kind):
    _, drafter_cls, drafter_cfg, _ = KINDS[kind]
    target = load_target(tiny_target_path)  # Medusa-2 and LayerSkip change it in place
    drafter = _build(drafter_cls, drafter_cfg, target)
    drafter.train()
    examples = _ragged(target.vocab_size)
    rows = pack_documents(examples, 24)
    assert len(rows) == 3 and any(len(r.document_lengths) > 2 for r in rows)
    assert any(len(r.input_ids) < 23 for r in rows)  # a row with padding after its documents

    padded = _loss_and_grads(drafter, target, collate(examples, "cpu"))
    packed = _loss_and_grads(drafter, target, collate(rows, "cpu"))

    assert packed[1] == padded[1]  # the same tokens scored: the same token mean
    assert packed[0] == pytest.approx(padded[0], rel=1e-5, abs=1e-6)
    assert packed[2].keys() == padded[2].keys() and padded[2]
    for name, grad in padded[2].items():
        torch.testing.assert_close(packed[2][name], grad, rtol=1e-5, atol=1e-7, msg=name)

    # The same rows without their documents (one long document each) train otherwise, by far
    # more than the tolerance (Medusa-2's least: 2e-4 of its sum, its KL-free heads' terms).
    joined = [Example(r.input_ids, r.loss_mask) for r in rows]
    leaked = _loss_and_grads(drafter, target, collate(joined, "cpu"))
    assert leaked[0] != pytest.approx(padded[0], rel=2e-5)
