"""Packed rows (data.pack) train exactly as the same conversations padded, one to a row: for every
kind, the loss sum, the count of scored tokens it is divided by, and every gradient, with ragged
lengths, documents whose loss starts at their second token, and a row's padding. The shared
tiny fixtures and kinds are test_loss_token_mean's."""

from __future__ import annotations

import pytest
import torch
from test_loss_token_mean import KINDS, _build

from specdraft.attention import target_inputs
from specdraft.config import ConfigError
from specdraft.data import DataConfig
from specdraft.data.formats import Example
from specdraft.data.packing import pack_documents
from specdraft.targets.hidden_cache import CachedTarget, HiddenStateCache, write_cache
from specdraft.targets.target import load_target
from specdraft.train.dflash import DFlashTrainConfig
from specdraft.train.peagle import PEagleTrainConfig
from specdraft.train.schedule import collate
from specdraft.train.trainer import train

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
    # more than the tolerance (Medusa-2 the least: by about 2e-4 of its sum).
    joined = [Example(r.input_ids, r.loss_mask) for r in rows]
    leaked = _loss_and_grads(drafter, target, collate(joined, "cpu"))
    assert leaked[0] != pytest.approx(padded[0], rel=2e-5)


def test_a_batch_of_packed_rows_restarts_positions_at_each_document():
    rows = [Example([5, 6, 7, 8, 9], [0, 1, 1, 1, 1], document_lengths=[2, 3]),
            Example([5, 6, 7], [1, 1, 1], document_lengths=[3])]  # fmt: skip
    batch = collate(rows, "cpu")
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2], [0, 1, 2, 0, 1]]
    # the padding after the second row's document is a document of its own
    assert batch["document_ids"].tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 1, 1]]
    # no document's first token is a target: nothing before it in its document predicts it
    assert batch["loss_mask"].tolist() == [[0, 1, 0, 1, 1], [0, 1, 1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 1, 0, 0]]
    assert "document_ids" not in collate([Example([5, 6], [0, 1])], "cpu")


def test_the_dense_unroll_keeps_packed_documents_apart_as_ttt_attention_does(tiny_target):
    """EAGLE's training-time test on packed rows: its block-wise attention (no mask) and the
    dense mask it is tested against give the same steps."""
    _, drafter_cls, drafter_cfg, _ = KINDS["eagle3"]
    head = _build(drafter_cls, drafter_cfg, tiny_target).eval()
    batch = collate(pack_documents(_ragged(tiny_target.vocab_size), 24), "cpu")
    out = tiny_target.forward(
        batch["input_ids"], **target_inputs(batch), capture_layers=head.capture_layers
    )
    with torch.no_grad():
        fast, dense = head.unroll(batch, out, 3), head.unroll(batch, out, 3, dense=True)
    for a, b in zip(fast, dense, strict=True):
        torch.testing.assert_close(a["h"], b["h"], rtol=1e-5, atol=1e-6)
        assert torch.equal(a["valid"], b["valid"])


def test_one_trainer_step_on_packed_rows_equals_one_on_padded_conversations(
    tiny_target_path, tmp_path
):
    """The trainer's step over the same conversations, padded in one micro-batch or packed in
    rows over three micro-batches: the same token-mean loss and the same weights after it."""
    config_cls, drafter_cls, drafter_cfg, _ = KINDS["eagle3"]
    target = load_target(tiny_target_path)
    examples = _ragged(target.vocab_size)
    rows = pack_documents(examples, 24)
    results = {}
    for name, data, micro in (("padded", examples, len(examples)), ("packed", rows, 1)):
        drafter = _build(drafter_cls, drafter_cfg, target)
        cfg = config_cls(
            target="tiny", output_dir=str(tmp_path / name), max_steps=1, micro_batch_size=micro,
            grad_accum=len(data) // micro, lr=1e-2, warmup_steps=0, eval_every=0, save_every=0,
            log_every=1, seed=0, drafter=drafter_cfg, mixed_precision="no",
        )  # fmt: skip
        result = train(cfg, drafter, target, data, [], tokenizer=target.tokenizer)
        results[name] = (result.losses[0], {n: p.detach() for n, p in drafter.named_parameters()})
    assert results["packed"][0] == pytest.approx(results["padded"][0], rel=1e-5)
    # AdamW's first step moves a weight by about lr * g / (|g| + eps): a gradient's rounding
    # near 0 moves it by up to a part in 1e3 of lr, hence the absolute tolerance
    for name, weight in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][name], weight, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("config_class", [PEagleTrainConfig, DFlashTrainConfig])
def test_kinds_that_draw_per_row_refuse_packed_rows_by_the_key(config_class):
    """P-EAGLE (COD slots) and DFlash (anchors) draw per row, so packing would change what
    they train: an error naming data.pack, not a silent difference."""
    with pytest.raises(
        ConfigError, match=r"data\.pack=true: .* per row.*set data\.pack=false"
    ) as e:
        config_class(data=DataConfig(pack=True))
    assert e.value.key == "data.pack"


def test_the_hidden_state_cache_stores_packed_rows_as_their_conversations_alone(
    tiny_target, tmp_path
):
    examples = _ragged(tiny_target.vocab_size)
    rows = pack_documents(examples, 24)
    layers = [1, tiny_target.num_layers]
    write_cache(tmp_path, tiny_target, rows, layers, dtype="fp32", batch_size=2)
    cache = CachedTarget(tiny_target, HiddenStateCache(tmp_path, tiny_target, rows, layers))
    batch = collate(rows, "cpu")
    cached = cache.forward(batch["input_ids"], **target_inputs(batch), capture_layers=layers)
    for r, row in enumerate(rows):
        start = 0
        for n in row.document_lengths:
            ids = torch.tensor([row.input_ids[start : start + n]])
            alone = tiny_target.forward(ids, capture_layers=layers)
            for layer in layers:
                torch.testing.assert_close(
                    cached.hidden_states[layer][r, start : start + n], alone.hidden_states[layer][0],
                    rtol=1e-5, atol=1e-6,
                )  # fmt: skip
            start += n


def test_resume_on_packed_rows_equals_an_uninterrupted_run(tiny_target_path, tmp_path):
    """Rows are the trainer's examples: the data order, and so resume, see nothing else."""
    config_cls, drafter_cls, drafter_cfg, _ = KINDS["eagle3"]
    target = load_target(tiny_target_path)
    rows = pack_documents(_ragged(target.vocab_size), 24)

    def run(name, steps, **extra):
        cfg = config_cls(
            target="tiny", output_dir=str(tmp_path / name), max_steps=steps, micro_batch_size=1,
            grad_accum=1, lr=1e-2, lr_schedule="constant", warmup_steps=0, eval_every=0,
            save_every=0, log_every=1, seed=0, drafter=drafter_cfg, mixed_precision="no", **extra,
        )  # fmt: skip
        drafter = _build(drafter_cls, drafter_cfg, target)
        return train(cfg, drafter, target, rows, [], tokenizer=target.tokenizer), drafter

    straight, a = run("straight", 4)  # 4 steps over 3 rows: into the second epoch
    run("cut", 2)
    resumed, b = run("cut", 4, resume_from="latest")
    assert resumed.losses == straight.losses
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
