"""scripts/memory_plan.py counts what a real run holds: its parameter counts equal those of the
target and head built with weights, and its totals are the sums of its terms."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, resolve_config
from specdraft.targets.target import load_target
from specdraft.tools import memory_plan


def test_counts_equal_a_head_built_with_weights(tiny_target_path, capsys):
    assert memory_plan.main([tiny_target_path, "--gpus", "4", "--draft-vocab", "128",
                             "--ttt-steps", "3", "--activations-gib-per-1k", "0.5",
                             "--seq", "512", "--micro-batch", "2"]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    target = load_target(tiny_target_path)
    cfg = resolve_config(EagleConfig(version="eagle3", draft_vocab_size=128), target)
    head = EagleDrafter.build(cfg, target, torch.arange(128))
    assert plan["target_parameters"] == sum(p.numel() for p in target.model.parameters())
    assert plan["head_trained_parameters"] == sum(
        p.numel() for p in head.parameters() if p.requires_grad
    )
    largest = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in target.model.modules()
    )
    assert plan["largest_module_parameters"] == largest == target.vocab_size * target.hidden_size
    gib = 2**30
    # ZeRO-3 keeps up to 1e9 elements gathered: all of a target this small
    total = plan["target_parameters"]
    assert plan["target_zero3"] == pytest.approx((total * 2 / 4 + (total + 5e7) * 2) / gib)
    assert plan["activations"] == pytest.approx(0.5 * 512 * 2 / 1024)
    # the measured loss working set, for this target's vocabulary and a 1,024-position chunk
    loss = memory_plan.LOSS_MIB_MEASURED / 1024 * target.vocab_size / 128256
    assert plan["loss"] == pytest.approx(loss) and plan["loss_chunk_tokens"] == 1024
    rest = plan["head_embedding_copy"] + plan["head_zero2"] + plan["activations"] + plan["loss"]
    assert plan["ZeRO-3 target, ZeRO-2 head"] == pytest.approx(plan["target_zero3"] + rest)


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert memory_plan.main([str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory_plan.main([str(tmp_path), "--gpus", "0"])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory_plan.main([str(tmp_path), "--loss-chunk-tokens", "-1"])
    assert "--loss-chunk-tokens must be >= 0" in capsys.readouterr().err
