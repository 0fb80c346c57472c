"""scripts/compare.py end to end on the tiny demo target: every family trained with the same
token budget in its own process (a failing one reported, the others measured), tuned, measured
greedy and sampled beside the baselines in one process, and reported with the four plots."""

from __future__ import annotations

import json

import pytest

from specdraft.scripts.compare import main

# the demo configs, shrunk to the tiny target (its vocabulary is 384 tokens)
TINY = [
    "--set", "eagle:drafter.draft_vocab_size=256", "--set", "eagle:drafter.ttt_steps=2",
    "--set", "medusa:drafter.num_heads=2", "--set", "medusa:drafter.draft_vocab_size=256",
    "--set", "layerskip:drafter.exit_layer=1",
]  # fmt: skip
SMALL = [
    "--target", "demo-tiny", "--budget-tokens", "2000", "--num-prompts", "2",
    "--max-new-tokens", "10", "--tune-prompts", "1",
]  # fmt: skip
for family in ("distill", "eagle", "medusa", "layerskip"):
    SMALL += ["--set", f"{family}:data.max_samples=40", "--set", f"{family}:eval_batches=2"]


def test_every_family_trained_tuned_measured_and_reported(tmp_path, capsys):
    out = tmp_path / "compare"
    # Medusa given a setting it refuses: reported as failed, the other three still run
    bad = ["--set", "medusa:drafter.num_heads=0"]
    assert main([*SMALL, *TINY, *bad, "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    rows = {r["family"]: r for r in report["families"]}
    assert list(rows) == ["distill", "eagle", "medusa", "layerskip"]
    assert "num_heads" in rows["medusa"]["error"] and (out / "medusa.log").is_file()
    for family in ("distill", "eagle", "layerskip"):
        r = rows[family]
        assert r["matches_plain"] is True and r["tau"] >= 1 and r["speedup"] > 0
        assert r["speedup_t1"] > 0 and r["train_tokens"] >= 2000 and r["train_seconds"] > 0
        assert r["train_tokens_per_s"] > 0 and r["simulated_tau"] is not None
        assert len(r["simulated_over_training"]) >= 2 and r["tuned"]["decode"]
        assert r["tau_alone"] >= 1 and r["tau_gap"] is not None  # the drafter's own tau
    # every trained family's runs drafted and had drafts accepted, greedy and sampled: a
    # family whose drafter drafted nothing would still match plain decoding and show tau 1
    for mode in ("greedy", "sampled"):
        trained = [
            r for r in report[mode]["runs"] if r["method"] in ("distill", "eagle", "layerskip")
        ]
        assert {r["method"] for r in trained} == {"distill", "eagle", "layerskip"}, mode
        for r in trained:
            assert r["drafted"] > 0 and r["accepted"] > 0, (mode, r["name"])
    # what only some families cost: weights beside the target, or the target's own quality
    assert rows["eagle"]["extra_params"] > 0 and rows["layerskip"]["extra_params"] == 0
    assert rows["layerskip"]["quality_cost_nats"] is not None
    assert rows["distill"]["quality_cost_nats"] is None
    methods = {r["method"] for r in report["greedy"]["runs"]}
    assert {"ar", "prompt_lookup", "hf_assisted", "hf_early_exit"} <= methods
    assert "hf_assisted" not in {r["method"] for r in report["sampled"]["runs"]}
    for name in ("report.md", "frontier.png", "tau_vs_speedup.png", "acceptance.png",
                 "simulated_tau.png"):  # fmt: skip
        assert (out / name).stat().st_size > 0
    md = (out / "report.md").read_text()
    assert "| medusa | failed:" in md and "**" in md
    assert "| layerskip |" in capsys.readouterr().out

    # the trained folders again, taken as given: nothing retrained
    again = tmp_path / "again"
    given = ["--folder", f"eagle={out / 'eagle' / 'final'}", "--families", "eagle",
             "--tune-prompts", "0", "--no-sampled", "--wandb", "specdraft-test"]  # fmt: skip
    assert main([*SMALL, *given, "--output", str(again)]) == 0
    assert list((again / "wandb").glob("offline-run-*/run-*.wandb"))  # WANDB_MODE=offline
    row = json.loads((again / "report.json").read_text())["families"][0]
    assert row["train_seconds"] == rows["eagle"]["train_seconds"]  # as recorded by the first
    assert row["simulated_tau"] is not None
    assert not (again / "eagle").exists()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--families", "eagle,speculators"], "choose from distill"),
        (["--budget-tokens", "0"], "must be >= 1"),
        (["--folder", "eagle"], "expected FAMILY=FOLDER"),
        (["--set", "eagle=lr=1"], "expected FAMILY:KEY=VALUE"),
    ],
)
def test_bad_options_are_named(args, message, capsys):
    with pytest.raises(SystemExit):
        main(args)
    assert message in capsys.readouterr().err


def test_a_folder_of_another_family_is_refused(tmp_path, capsys, tiny_target):
    tiny_target.model.save_pretrained(tmp_path / "plain")  # a plain HF model: a two-model draft
    code = main([*SMALL, "--families", "eagle", "--folder", f"eagle={tmp_path / 'plain'}",
                 "--output", str(tmp_path / "out")])  # fmt: skip
    assert code == 2
    assert "holds a distill drafter, not eagle" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "extra", "message"),
    [
        ("", [], "no prompts in it"),
        ("word " * 3000, [], "longer than the target's context"),
    ],
)
def test_bad_prompts_are_named_before_any_training(tmp_path, capsys, content, extra, message):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(content)
    out = tmp_path / "out"
    code = main([*SMALL, "--prompts", str(prompts), "--output", str(out), *extra])
    assert code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()  # nothing trained, nothing written


def test_a_medusa_tree_gets_its_own_simulated_tau(tmp_path):
    """Served as a tree, Medusa's simulated tau is 1 + the expected accepted length of that tree
    under the saved greedy accuracies, worked out here by hand; a chain keeps the per-depth
    figure, and heads without measured accuracies give none."""
    import torch
    from safetensors.torch import save_file

    from specdraft.train.compare import Family, served_simulated_tau

    accuracy = torch.tensor([[0.5, 0.2], [0.4, 0.1]])  # (head, rank)
    save_file({"accuracy_greedy": accuracy}, str(tmp_path / "model.safetensors"))
    found = Family("medusa", folder=tmp_path, alpha_greedy=[0.5, 0.4])
    tree = {"tree_top_k": 2, "tree_budget": 4, "gamma": 2}
    # the 4 likeliest nodes: (0) 0.5, (0, 0) 0.2, (1) 0.2, (1, 0) 0.08 (over (0, 1)'s 0.05)
    assert served_simulated_tau(found, tree) == pytest.approx(1 + 0.5 + 0.2 + 0.2 + 0.08)
    chain = {"tree_top_k": 1, "tree_budget": 4, "gamma": 2}
    assert served_simulated_tau(found, chain) == pytest.approx(1 + 0.5 + 0.5 * 0.4)
    save_file({"accuracy_greedy": accuracy * float("nan")}, str(tmp_path / "model.safetensors"))
    assert served_simulated_tau(found, tree) is None
