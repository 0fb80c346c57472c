"""A step's loss is exactly the mean over the global batch's scored tokens, for every kind: each
kind's loss is a sum over its tokens, counted from the batch alone, and the trainer divides the
micro-batches' sums by the global count. Checked against a naive mean, example by example, over
micro-batches of very different lengths (where weighting per-micro-batch means is wrong)."""

from __future__ import annotations

import pytest
import torch

from specdraft.core import DecodeConfig
from specdraft.data.formats import Example
from specdraft.drafters.base import LoraConfig
from specdraft.kinds.distill.distill import DistillConfig, DistillDrafter
from specdraft.kinds.distill.distill_trainer import DistillTrainConfig
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig
from specdraft.kinds.layerskip.layerskip import LayerSkipConfig, LayerSkipDrafter
from specdraft.kinds.layerskip.layerskip_trainer import LayerSkipTrainConfig
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.kinds.medusa.medusa_trainer import MedusaTrainConfig
from specdraft.targets.target import load_target
from specdraft.train.lr_schedule import collate, examples_for
from specdraft.train.trainer import train

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


def _uneven(vocab: int) -> list[Example]:
    """Four conversations of very different lengths and loss shares (two micro-batches of two)."""
    g = torch.Generator().manual_seed(5)
    out = []
    for length, prompt in ((40, 3), (6, 2), (28, 20), (9, 1)):
        ids = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(Example(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt)))
    return out


# kind -> (train config class, drafter class, drafter config, how the kind counts its tokens:
# the first loss-mask position a token can be scored from)
MEDUSA = dict(num_heads=3, loss="kl", loss_decay=0.8)
KINDS = {
    "distill": (DistillTrainConfig, DistillDrafter, DistillConfig(init="random", num_layers=1), 1),
    "eagle3": (EagleTrainConfig, EagleDrafter,
               EagleConfig(version="eagle3", ttt_steps=3, ttt_decay=0.8, draft_vocab_size=128), 2),
    "eagle1": (EagleTrainConfig, EagleDrafter,
               EagleConfig(version="eagle1", ttt_steps=2, feature_noise=0.0), 2),
    "medusa1": (MedusaTrainConfig, MedusaDrafter, MedusaConfig(**MEDUSA), 2),
    "medusa2": (MedusaTrainConfig, MedusaDrafter,
                MedusaConfig(**MEDUSA, lora=LoraConfig(rank=4, dropout=0.0), target_loss="lm"), 1),
    "layerskip": (LayerSkipTrainConfig, LayerSkipDrafter, LayerSkipConfig(layer_dropout=0.0), 1),
}  # fmt: skip


def _build(cls, config, target):
    torch.manual_seed(0)
    if cls is EagleDrafter and config.draft_vocab_size:
        d2t = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))
        return cls.build(config, target, d2t[: config.draft_vocab_size].sort().values)
    return cls.build(config, target)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_the_step_loss_is_the_token_mean_over_uneven_micro_batches(
    tiny_target_path, tmp_path, kind
):
    config_cls, drafter_cls, drafter_cfg, first = KINDS[kind]
    target = load_target(tiny_target_path)  # Medusa-2 and LayerSkip change it in place
    drafter = _build(drafter_cls, drafter_cfg, target)
    examples = _uneven(target.vocab_size)
    cfg = config_cls(
        target="tiny", output_dir=str(tmp_path / "run"), max_steps=1, micro_batch_size=2,
        grad_accum=2, lr=1e-3, warmup_steps=0, eval_every=0, eval_batches=1, save_every=0,
        log_every=1, seed=0, drafter=drafter_cfg, decode=DecodeConfig(gamma=2),
        mixed_precision="no",  # compared with an fp32 reference below, on every CPU
    )  # fmt: skip

    # The naive mean: every example alone (no padding), its loss sum and its scored tokens.
    drafter.train()
    sums, counts = [], []
    with torch.no_grad():
        for e in examples:
            batch = collate([e], "cpu")
            out = (
                None
                if getattr(drafter, "runs_target", False)
                else target.forward(batch["input_ids"], capture_layers=drafter.capture_layers)
            )
            loss, _ = drafter(batch, out)
            sums.append(float(loss))
            counts.append(sum(e.loss_mask[first:]))
        naive = sum(sums) / sum(counts)
    # the two micro-batches' shares of the scored tokens are far from equal
    share = sum(counts[i] for i in examples_for(0, 0, 0, len(examples), cfg, 1)) / sum(counts)
    assert abs(share - 0.5) > 0.1

    # What weighting each micro-batch's own mean equally would give: the test must tell it apart.
    micro_means = []
    for micro in range(cfg.grad_accum):
        rows = examples_for(0, micro, 0, len(examples), cfg, 1)
        micro_means.append(sum(sums[i] for i in rows) / sum(counts[i] for i in rows))
    wrong = sum(micro_means) / len(micro_means)

    # fp32 (the trainer's mixed_precision=no, pinned above), padded batches against one example
    # at a time: the products differ only in rounding, which on AVX-512 kernels differs between
    # batch shapes. A KL of near-equal distributions (Medusa-1 on the tiny target: ~3e-4 a
    # token) is a difference of per-token sums of about log(vocab), so its rounding is absolute,
    # ~1e-7 of log(vocab) a token, not relative to the tiny mean: hence abs=1e-7 beside rel=1e-5.
    tolerance = dict(rel=1e-5, abs=1e-7)
    assert wrong != pytest.approx(naive, rel=1e-3, abs=100 * tolerance["abs"])
    result = train(cfg, drafter, target, examples, examples[:2], tokenizer=target.tokenizer)
    assert result.losses[0] == pytest.approx(naive, **tolerance)
