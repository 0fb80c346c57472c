"""The Medusa entry script end to end on the tiny target, and its recipes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specdraft.config import load_config
from specdraft.drafters.checkpoint import load_drafter
from specdraft.drafters.medusa import MedusaDrafter
from specdraft.train.medusa import DEFAULT_CONFIG, MedusaTrainConfig, main

RECIPES = sorted(Path(DEFAULT_CONFIG).parent.glob("*.yaml"))


@pytest.mark.parametrize(
    "drafter",
    [
        ["drafter.loss=ce", "drafter.draft_vocab_size=256"],
        ["drafter.loss=ce", "drafter.output=shared", "drafter.num_layers=2"],
    ],
    # (ce: the tiny target is nearly deterministic, so self-distillation has ~0 loss to lower;
    # tests/inference/test_medusa.py checks the kl loss against a naive loop)
    ids=["draft-vocab", "shared-output-two-blocks"],
)
def test_training_lowers_the_loss_and_final_drafts_a_measured_tree(
    tiny_target, tiny_target_path, tmp_path, drafter
):
    out = tmp_path / "run"
    code = main([
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=8", "micro_batch_size=4",
        "eval_every=8", "eval_batches=2", "save_every=0", "data.max_samples=40",
        "data.max_length=32", "warmup_steps=1", "lr=3e-3", "drafter.num_heads=3", *drafter,
        "decode.gamma=3", "decode.tree_top_k=3", "decode.tree_budget=6",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
    ])  # fmt: skip
    assert code == 0
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    before, after = state["evals"][0], state["evals"][-1]
    assert after["loss"] < before["loss"]
    assert len(after["alpha"]) == 3 and after["tau"] > 1.0
    heads = load_drafter(out / "final", tiny_target)
    assert isinstance(heads, MedusaDrafter) and heads.config.num_heads == 3
    # the final evaluation measured every head's per-rank accuracy, saved for the tree
    for acc in (heads.accuracy_greedy, heads.accuracy_sampled):
        assert acc.shape == (3, heads.config.accuracy_ranks) and not torch.isnan(acc).any()
        assert torch.all(acc.sum(1) <= 1 + 1e-6)
    assert heads.decode.tree_budget == 6
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["num_prompts"] == 2 and served["drafted"] > 0
    assert served["matches_ar"] is True  # greedy: the same tokens as plain greedy decoding


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(MedusaTrainConfig, recipe)
    assert cfg.drafter.num_heads >= 1


def test_bad_input_is_a_clear_error(tiny_target_path, tmp_path, capsys):
    common = [f"target={tiny_target_path}", f"output_dir={tmp_path / 'run'}"]
    assert main([*common, "drafter.draft_vocab_size=5000"]) == 2
    assert "larger than the target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "drafter.num_heads=0"])
    assert "num_heads must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*common, "drafter.output=shared", "drafter.draft_vocab_size=10"])
    assert "needs output=own" in capsys.readouterr().err
