"""The Medusa entry script end to end on the tiny target, and its recipes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specdraft.config import SHIPPED_CONFIGS, load_config
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference import generate
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_trainer import MedusaTrainConfig
from specdraft.targets.target import TargetError, load_target
from specdraft.tools import evaluate
from specdraft.train.entry import main as train_main

RECIPES = sorted((SHIPPED_CONFIGS / "medusa").glob("*.yaml"))


@pytest.mark.parametrize(
    "drafter",
    [
        ["drafter.loss=ce", "drafter.draft_vocab_size=256"],
        ["drafter.loss=ce", "drafter.output=shared", "drafter.num_layers=2"],
    ],
    # (ce: the tiny target is nearly deterministic, so self-distillation has ~0 loss to lower;
    # tests/kinds/test_medusa.py checks the kl loss against a naive loop)
    ids=["draft-vocab", "shared-output-two-blocks"],
)
def test_training_lowers_the_loss_and_final_drafts_a_measured_tree(
    tiny_target, tiny_target_path, tmp_path, drafter
):
    out = tmp_path / "run"
    code = train_main("medusa", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=8", "micro_batch_size=4",
        "eval_every=8", "eval_batches=2", "save_every=0", "data.max_samples=40",
        "data.max_length=32", "warmup_steps=1", "lr=3e-3", "drafter.num_heads=3", *drafter,
        "decode.gamma=3", "decode.tree_top_k=3", "decode.tree_budget=6",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
        "eval_loop.tune_budgets=[2,6]", "eval_loop.tune_prompts=1",
    ])  # fmt: skip
    assert code == 0
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    before, after = state["evals"][0], state["evals"][-1]
    assert after["loss"] < before["loss"]
    assert len(after["alpha"]) == 3 and after["tau"] > 1.0
    heads = load_drafter(out / "final", tiny_target)
    assert isinstance(heads, MedusaDrafter) and heads.config.num_heads == 3
    # the final evaluation measured every head's per-rank accuracy, saved for the tree
    for acc in (heads.measured_accuracy(True), heads.measured_accuracy(False)):
        assert acc is not None and acc.shape == (3, heads.config.accuracy_ranks)
        assert torch.all(acc.sum(1) <= 1 + 1e-6)
    served = json.loads((out / "eval_loop.json").read_text())
    # the budget was chosen by measured tokens/s, saved with the heads and measured with
    tuning = served["tuning"]
    assert sorted(r["tree_budget"] for r in tuning) == [2, 6]  # the configured 6 among them
    fastest = next(r["tree_budget"] for r in tuning if r["kept"])
    assert (
        fastest
        == max((r for r in tuning if r["matches_plain"]), key=lambda r: r["tokens_per_s"])[
            "tree_budget"
        ]
    )
    assert load_decoding(out / "final").tree_budget == served["decode"]["tree_budget"] == fastest
    assert served["num_prompts"] == 2 and served["drafted"] > 0
    assert served["matches_ar"] is True  # greedy: the same tokens as plain greedy decoding


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(MedusaTrainConfig, recipe)
    assert cfg.drafter.num_heads >= 1


def test_bad_input_is_a_clear_error(tiny_target_path, tmp_path, capsys):
    common = [f"target={tiny_target_path}", f"output_dir={tmp_path / 'run'}"]
    assert train_main("medusa", [*common, "drafter.draft_vocab_size=5000"]) == 2
    assert "larger than the target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "drafter.num_heads=0"])
    assert "num_heads must be an integer >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "drafter.output=shared", "drafter.draft_vocab_size=10"])
    assert "needs output=own" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "eval_loop.tune_budgets=[4,0]"])
    assert "tune_budgets must be integers >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "eval_loop.tune=[depth]"])
    assert "eval_loop.tune ['depth']: each must be one of tree_top_k" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "eval_loop.tune=[gamma,exit_layer]"])
    assert "LayerSkip's decoding setting" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("medusa", [*common, "eval_loop.tune=[gamma,lookup_gamma]"])
    assert "lookup_gamma, the length of copies, but nothing copies" in capsys.readouterr().err


def medusa2_args(target_path, out) -> list[str]:
    return [
        f"target={target_path}", f"output_dir={out}", "max_steps=6", "micro_batch_size=4",
        "eval_every=6", "eval_batches=2", "save_every=3", "data.max_samples=40",
        "data.max_length=32", "warmup_steps=1", "lr=3e-3", "drafter.num_heads=2",
        "drafter.loss=ce", "drafter.lora.rank=4", "drafter.target_loss=lm",
        "drafter.heads_warmup_steps=3", "drafter.heads_lr_multiplier=2",
        "decode.gamma=2", "decode.tree_top_k=2", "decode.tree_budget=3",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
    ]  # fmt: skip


def test_medusa2_fine_tunes_the_target_and_the_heads_belong_to_it(
    tiny_target, tiny_target_path, tmp_path
):
    out = tmp_path / "run"
    assert train_main("medusa", medusa2_args(tiny_target_path, out)) == 0
    # the adapters sat out the heads' warm-up (B starts at zero, so the target was the base)
    # and trained after it
    warm = load_file(out / "checkpoint-3" / "model.safetensors")
    final = load_file(out / "final" / "model.safetensors")
    b_names = [k for k in final if k.startswith("lora.") and k.endswith("B.weight")]
    assert b_names and all(not warm[k].any() for k in b_names)
    assert any(final[k].any() for k in b_names)
    assert (out / "final" / "adapter" / "adapter_config.json").is_file()
    quality = json.loads((out / "target_quality.json").read_text())
    assert quality["fine_tuned_loss"] != quality["base_loss"]
    # 12 new tokens are too few for the loop test to tell: no looping figures, rather than 0%
    assert "greedy_looping" not in quality
    # against the plain base the heads are refused, naming the difference and the fix
    with pytest.raises(CheckpointError, match="adapter: expected"):
        load_drafter(out / "final", tiny_target)
    # with the fine-tuned target (adapter merged at load, or the run's merged copy) they load
    for tuned in (
        load_target(tiny_target_path, adapter=out / "final" / "adapter"),
        load_target(str(out / "target")),
    ):
        heads = load_drafter(out / "final", tuned)
        assert tuned.fingerprint["adapter"] == quality["adapter"]
        prompt = tuned.tokenizer("def add(a, b):")["input_ids"]
        plain = generate(tuned, prompt, max_new_tokens=16)
        spec = generate(tuned, prompt, heads, max_new_tokens=16, tree_top_k=1)
        assert spec.tokens.tolist() == plain.tokens.tolist() and spec.stats.drafted > 0
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["matches_ar"] is True  # lossless for the fine-tuned target it decodes with
    # evaluate.py decodes the heads with their fine-tuned target (merged from final/adapter)
    # and checks them against that target's own plain decoding, beside the base's `ar`
    report_dir = tmp_path / "eval"
    evaluate.main([
        "--target", tiny_target_path, "--drafter", str(out / "final"), "--baselines", "ar",
        "--num-prompts", "2", "--max-new-tokens", "12", "--output", str(report_dir),
    ])  # fmt: skip
    rows = {r["name"]: r for r in json.loads((report_dir / "report.json").read_text())["runs"]}
    assert list(rows)[:2] == ["ar", f"ar[adapter {quality['adapter']}]"]
    assert rows[str(out / "final")]["matches_ar"] is True
    # resuming from the step-3 checkpoint restores the adapters with the heads: bit-exact
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(out / "checkpoint-3", resumed / "checkpoint-3")
    assert (
        train_main("medusa", [*medusa2_args(tiny_target_path, resumed), "resume_from=latest"]) == 0
    )
    again = load_file(resumed / "final" / "model.safetensors")
    assert again.keys() == final.keys()
    assert all(torch.equal(again[k], final[k]) for k in final)


def test_a_bad_adapter_folder_is_a_clear_error(tiny_target_path, tmp_path):
    with pytest.raises(TargetError, match="not a LoRA adapter folder"):
        load_target(tiny_target_path, adapter=tmp_path)
