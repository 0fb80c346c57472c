"""Packed rows (data.pack) train exactly as the same conversations padded, one to a row: for every
kind, the loss sum, the count of scored tokens it is divided by, and every gradient, with ragged
lengths, documents whose loss starts at their second token, and a row's padding. The kinds that
draw per sample (P-EAGLE's COD slots, DFlash's anchors) draw per document, from the document's
own index, so they are held to the same: the draws themselves and what they train. The shared
tiny fixtures and kinds are test_loss_token_mean's."""

from __future__ import annotations

import pytest
import torch
from test_loss_token_mean import KINDS, _build

from specdraft.attention import document_spans, target_inputs
from specdraft.data import DataConfig
from specdraft.data.formats import Example
from specdraft.data.packing import pack_documents
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.dflash.dflash_trainer import DFlashTrainConfig
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter, scored
from specdraft.kinds.peagle.peagle_trainer import PEagleTrainConfig
from specdraft.targets.hidden_cache import CachedTarget, HiddenStateCache, write_cache
from specdraft.targets.target import load_target
from specdraft.train.lr_schedule import collate
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


# The kinds that draw per sample: small enough draws that they are a strict subset (COD keeps
# half of each depth's slots, DFlash two anchors of a document's many), a block that a
# document's end would cut (4 slots in conversations of 2 to 20 tokens).
DRAWING = {
    "peagle": (PEagleDrafter, PEagleConfig(num_depths=3, down_sample_ratio=0.5,
                                           down_sample_ratio_min=0.2, draft_vocab_size=128)),
    "dflash": (DFlashDrafter, DFlashConfig(block_size=4, anchors=2)),
}  # fmt: skip


def _drawing(kind, target):
    cls, config = DRAWING[kind]
    torch.manual_seed(0)
    if cls is PEagleDrafter:
        d2t = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))
        return cls.build(config, target, d2t[: config.draft_vocab_size].sort().values)
    return cls.build(config, target)


def _drawn(batch, drafter, trained: bool):
    """`batch` with the step's draws (prepare_batch, as the trainer makes them; its rows are the
    examples 0.. of their list), or as held-out (no prepare_batch: drawn from the tokens)."""
    if not trained:
        return batch
    batch["example_index"] = torch.arange(len(batch["input_ids"]))
    return drafter.prepare_batch(batch, None, None, torch.Generator().manual_seed(11))


def _per_document(batch, draws):
    """{(document, position in it): the draw there} over every document of `batch`, from
    (batch, ..., seq-like) `draws` whose last axis is the row's positions."""
    out, document = {}, 0
    for row, docs in enumerate(document_spans(batch)):
        for start, n in docs:
            for t in range(n):
                if t + start < draws.shape[-1]:
                    out[document, t] = draws[row, ..., start + t].tolist()
            document += 1
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
    return float(loss.detach()), float(count), grads


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


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_one_trainer_step_on_packed_rows_equals_one_on_padded_conversations(
    tiny_target_path, tmp_path, kind
):
    """The trainer's step over the same conversations, padded in one micro-batch or packed in
    rows over three micro-batches: the same token-mean loss and the same weights after it. For
    P-EAGLE and DFlash the same draws too: a padded row's index in the training set is the
    conversation's index among those packed."""
    target = load_target(tiny_target_path)
    if kind in DRAWING:
        config_cls = {"peagle": PEagleTrainConfig, "dflash": DFlashTrainConfig}[kind]
        drafter_cfg = DRAWING[kind][1]
    else:
        config_cls, drafter_cls, drafter_cfg, _ = KINDS[kind]
    examples = _ragged(target.vocab_size)
    rows = pack_documents(examples, 24)
    results = {}
    for name, data, micro in (("padded", examples, len(examples)), ("packed", rows, 1)):
        if kind in DRAWING:
            drafter = _drawing(kind, target)
        else:
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
    # near 0 moves it by up to a part in 1e3 of lr, and where |g| is within a few eps (1e-8)
    # by more: one of DFlash's 4,096 MLP weights here moved 3.3e-4 (3% of lr) apart on an AMD
    # EPYC with AVX-512 BF16, 1e-4 on an Intel Xeon; hence the absolute tolerance, a tenth of
    # lr. A packing bug moves weights by about lr (1e-2), and the loss is held equal above,
    # tightly.
    for name, weight in results["padded"][1].items():
        torch.testing.assert_close(results["packed"][1][name], weight, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("trained", [True, False], ids=["step-draws", "held-out-draws"])
@pytest.mark.parametrize("kind", sorted(DRAWING))
def test_kinds_that_draw_per_sample_draw_and_train_per_document(tiny_target, kind, trained):
    """P-EAGLE and DFlash on packed rows: each conversation draws what it draws in a row of its
    own (the step's draws from its index and the step's seed; held-out ones from its tokens),
    no slot or block crosses into another document, and the loss sum, count and gradients equal
    the padded rows'."""
    drafter = _drawing(kind, tiny_target).train()
    examples = _ragged(tiny_target.vocab_size)
    rows = pack_documents(examples, 24)
    padded = _drawn(collate(examples, "cpu"), drafter, trained)
    packed = _drawn(collate(rows, "cpu"), drafter, trained)
    # the padded rows, renumbered in the packed rows' order of documents
    order = [i for r in rows for i in r.document_indices]
    padded_in_order = {k: v[order] for k, v in padded.items() if k != "example_index"}

    if kind == "dflash":
        # anchors, as (document, position in it): the same set, drawn from fewer than there are
        def anchors(batch):
            a = drafter.anchors_of(batch)
            hit = torch.zeros(a.shape[0], batch["input_ids"].shape[1] + 1, dtype=torch.long)
            hit.scatter_(1, a.clamp(min=-1) % hit.shape[1], 1)  # -1 lands past the row
            return {k for k, v in _per_document(batch, hit[:, :-1]).items() if v}

        drawn = anchors(packed)
        assert drawn == anchors(padded_in_order)
        assert len(drawn) < sum(max(0, len(e.input_ids) - 4) for e in examples)
        valid = drafter.slot_valid(packed, drafter.anchors_of(packed))
        assert valid.any() and not valid.all()  # a block cut by its document's end
    else:
        # depth >= 1, COD's draws: the same slots kept, document by document
        def kept(batch):
            return {k: v for k, v in _per_document(batch, drafter._keep(batch)[:, 1:]).items()
                    if any(v)}  # fmt: skip

        assert kept(packed) == kept(padded_in_order)
        every = scored(packed["loss_mask"], 3, packed["document_ids"]).sum()
        assert 0 < drafter.loss_tokens(packed) < every  # COD dropped slots

    a = _loss_and_grads(drafter, tiny_target, padded)
    b = _loss_and_grads(drafter, tiny_target, packed)
    assert b[1] == a[1] and a[1] > 20
    assert b[0] == pytest.approx(a[0], rel=1e-5, abs=1e-6)
    assert b[2].keys() == a[2].keys() and a[2]
    for name, grad in a[2].items():
        torch.testing.assert_close(b[2][name], grad, rtol=1e-5, atol=1e-7, msg=name)

    # The same rows as one long document each draw and train otherwise.
    joined = _drawn(collate([Example(r.input_ids, r.loss_mask) for r in rows], "cpu"),
                    drafter, trained)  # fmt: skip
    leaked = _loss_and_grads(drafter, tiny_target, joined)
    assert leaked[0] != pytest.approx(a[0], rel=2e-5)


@pytest.mark.parametrize("config_class", [PEagleTrainConfig, DFlashTrainConfig])
def test_kinds_that_draw_per_sample_take_packed_rows(config_class):
    assert config_class(data=DataConfig(pack=True)).data.pack


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
