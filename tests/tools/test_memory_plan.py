"""scripts/memory_plan.py counts what a real run holds: its parameter counts equal those of the
target and head built with weights, the head's training state what a real optimizer step holds,
and its totals are the sums of its terms."""

from __future__ import annotations

import json

import pytest
import torch

from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter, resolve_config
from specdraft.targets.target import load_target
from specdraft.tools import memory_plan


def _plan(path: str, capsys, gpus: int) -> dict:
    assert memory_plan.main([path, "--gpus", str(gpus), "--draft-vocab", "128",
                             "--ttt-steps", "3", "--activations-gib-per-1k", "0.5",
                             "--seq", "512", "--micro-batch", "2"]) == 0  # fmt: skip
    return json.loads(capsys.readouterr().out)


def test_counts_and_head_state_equal_a_head_built_and_stepped(tiny_target_path, capsys):
    """The plan's counts are those of the real target and head, and the head's training state is
    what one AdamW step on the real head holds (its parameters, gradients and both moments, in
    fp32), measured from the tensors rather than restated."""
    plan = _plan(tiny_target_path, capsys, gpus=4)
    target = load_target(tiny_target_path)
    cfg = resolve_config(EagleConfig(version="eagle3", draft_vocab_size=128), target)
    head = EagleDrafter.build(cfg, target, torch.arange(128)).float()
    trained = [p for p in head.parameters() if p.requires_grad]
    assert plan["target_parameters"] == sum(p.numel() for p in target.model.parameters())
    assert plan["head_trained_parameters"] == sum(p.numel() for p in trained)
    largest = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in target.model.modules()
    )
    assert plan["largest_module_parameters"] == largest == target.vocab_size * target.hidden_size

    optimizer = torch.optim.AdamW(trained, lr=1e-3)
    sum(p.float().pow(2).sum() for p in trained).backward()
    optimizer.step()
    state = [t for p in trained for t in (p, p.grad, *optimizer.state[p].values()) if t.dim()]
    held = sum(t.numel() * t.element_size() for t in state)  # fp32 weights, grads, 2 moments
    gib = 2**30
    # DDP: all of it on every GPU, plus its gradient buckets (one more fp32 copy of the grads)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in trained)
    assert plan["head_ddp"] * gib == pytest.approx(held + grads)
    # ZeRO-2 over 4 GPUs: a quarter of it, the bf16 weights whole, and the two reduce buckets
    buckets = plan["head_zero2"] * gib - held / 4 - plan["head_trained_parameters"] * 2
    assert buckets == pytest.approx(2 * 5e8 * 2)  # configs/deepspeed/zero2.json: 5e8 each


def test_target_share_scales_with_the_gpus_and_totals_add_up(tiny_target_path, capsys):
    """ZeRO-3 splits the target over the GPUs and keeps what it gathers whole: twice the GPUs
    halve the share and leave the rest; a whole copy is never less than a ZeRO-3 share; the
    reported totals are the sums of the terms they name."""
    two, four = _plan(tiny_target_path, capsys, gpus=2), _plan(tiny_target_path, capsys, gpus=4)
    whole = two["target_whole"]
    assert two["target_zero3"] - four["target_zero3"] == pytest.approx(whole / 2 - whole / 4)
    assert four["head_zero2"] < two["head_zero2"] and four["head_ddp"] == two["head_ddp"]
    for plan in (two, four):
        rest = plan["head_embedding_copy"] + plan["head_zero2"] + plan["activations"] + plan["loss"]
        assert plan["ZeRO-3 target, ZeRO-2 head"] == pytest.approx(plan["target_zero3"] + rest)
        act = plan["activations"] + plan["loss"]
        assert plan["whole target, DDP head"] == pytest.approx(whole + plan["head_ddp"] + act)


def test_bad_input_is_a_clear_error(tmp_path, capsys):
    assert memory_plan.main([str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory_plan.main([str(tmp_path), "--gpus", "0"])
    assert "at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        memory_plan.main([str(tmp_path), "--loss-chunk-tokens", "-1"])
    assert "--loss-chunk-tokens must be >= 0" in capsys.readouterr().err
