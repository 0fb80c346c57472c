"""train/fine_tuned.py's held-out loss of a fine-tuned target, made from the target's final
states a chunk of positions at a time, equals the mean cross-entropy of its full logits."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from specdraft.train.fine_tuned import heldout_loss


@pytest.mark.parametrize("chunk", [0, 1, 5])
def test_heldout_loss_equals_the_full_logits_mean(one_thread, tiny_target, chunk):
    gen = torch.Generator().manual_seed(0)
    examples = []
    for n in (9, 6, 11):
        ids = torch.randint(3, tiny_target.vocab_size, (n,), generator=gen).tolist()
        examples.append(SimpleNamespace(input_ids=ids, loss_mask=[0] * 3 + [1] * (n - 3)))
    got = heldout_loss(tiny_target, examples, batch_size=2, batches=0, chunk_tokens=chunk)
    total = count = 0.0
    for ex in examples:  # one row at a time: no padding
        ids = torch.tensor([ex.input_ids])
        log_q = tiny_target.forward(ids).logits[0, :-1].float().log_softmax(-1)
        nll = -log_q.gather(-1, ids[0, 1:, None])[:, 0]
        w = torch.tensor(ex.loss_mask[1:], dtype=torch.float)
        total, count = total + float((nll * w).sum()), count + float(w.sum())
    assert got == pytest.approx(total / count, rel=1e-5)
