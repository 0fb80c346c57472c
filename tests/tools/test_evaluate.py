"""scripts/evaluate.py end to end on the tiny demo target: every method on the same prompts,
report.json with the agreed fields, report.md and the three plots."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from specdraft.measuring.evaluation_report import crossover, short_labels
from specdraft.tools import evaluate

FIELDS = {
    "name",
    "label",
    "method",
    "tau",
    "acceptance_per_position",
    "tokens_per_s",
    "speedup_vs_ar",
    "overhead",
    "draft_time_frac",
    "copied_share",
    "drafted",
    "accepted",
    "extra_params",
    "decode",
    "extra_memory_bytes",
    "num_prompts",
    "batch_size",
    "new_tokens",
    "matches_ar",
    "mean_log_p",
    "lossy",
    "dtype",
    "speedup_vs_ar_same_dtype",
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models (tests/conftest.py)


def test_greedy_report(tiny_target_path, draft_folder, tmp_path):
    out = tmp_path / "eval"
    evaluate.main(
        [
            "--target",
            tiny_target_path,
            "--drafter",
            str(draft_folder),
            "--num-prompts",
            "2",
            "--max-new-tokens",
            "12",
            "--gamma",
            "3",
            "--output",
            str(out),
        ]
    )
    report = json.loads((out / "report.json").read_text())
    assert report["target"]["vocab_size"] == 384 and report["settings"]["gamma"] == 3
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {
        "ar",
        "hf_ar",
        "prompt_lookup",
        "hf_prompt_lookup",
        "copy",
        "hf_assisted[copy]",
    }
    # MT-Bench by default: 2 requests (writing, roleplay), both turns, each turn-2 prompt after
    # the target's own answer; what each method decoded, by its label: greedy, all the same
    assert report["benchmark"] == {"prompts": "mt-bench", "requests": 2, "turns": 2,
                                   "categories": ["writing", "roleplay"], "chat_template": True}  # fmt: skip
    texts = report["outputs"]
    assert [(t["id"], t["turn"]) for t in texts] == [("81", 1), ("91", 1), ("81", 2), ("91", 2)]
    assert texts[0]["outputs"]["ar"] in texts[2]["prompt"]  # the answer, then the next turn
    labels = {r["label"] for r in runs.values()}
    assert all(set(t["outputs"]) == labels and len(set(t["outputs"].values())) == 1 for t in texts)
    copy = runs["copy"]  # pooled: the groups' tokens add up to the run's
    assert sum(g["new_tokens"] for g in copy["by_turn"].values()) == copy["new_tokens"]
    markdown = (out / "report.md").read_text()
    assert "| label | writing | roleplay | overall |" in markdown
    assert "| label | turn 1 | turn 2 | overall |" in markdown
    assert (out / "categories.png").exists()
    for r in runs.values():
        assert set(r) == FIELDS | {"by_category", "by_turn"}
        assert set(r["by_category"]) == {"writing", "roleplay"} and set(r["by_turn"]) == {"1", "2"}
        assert r["mean_log_p"] is None and r["lossy"] is False  # greedy: p is a point mass
        assert r["num_prompts"] == 4 and 0 < r["new_tokens"] <= 48
        assert r["matches_ar"] is True  # greedy: every method reproduces plain decoding
        assert r["tokens_per_s"] > 0
    assert runs["ar"]["tau"] == 1.0 and runs["ar"]["speedup_vs_ar"] == 1.0
    mine = runs["copy"]
    assert mine["method"] == "distill" and mine["tau"] > 1
    assert mine["acceptance_per_position"][0] == 1.0  # a copy of the target is always right
    assert mine["drafted"] > 0 and mine["accepted"] > 0 and runs["ar"]["drafted"] == 0
    assert mine["extra_params"] > 0 and mine["extra_memory_bytes"] > 4 * mine["extra_params"]
    assert 0 < mine["draft_time_frac"] < 1
    assert mine["copied_share"] is None  # a two-model draft never copies from the context
    assert mine["overhead"] == pytest.approx(mine["tau"] / mine["speedup_vs_ar"] - 1)
    assert [r["label"] for r in runs.values()] == [*list(runs)[:5], "hf[copy]"]  # short: kept
    md = (out / "report.md").read_text()
    assert "| hf[copy] | hf_assisted[copy] |" in md and "speedup" in md  # label -> name
    for plot in ("acceptance_per_position", "tau_distribution", "speedup"):
        assert (out / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"


def test_sampling_report_has_no_greedy_match(tiny_target_path, tmp_path):
    out = tmp_path / "eval"
    evaluate.main(
        [
            "--target",
            tiny_target_path,
            "--baselines",
            "prompt_lookup",
            "--num-prompts",
            "1",
            "--max-new-tokens",
            "8",
            "--temperature",
            "1.0",
            "--output",
            str(out),
        ]
    )
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["ar", "prompt_lookup"]
    assert all(r["matches_ar"] is None for r in runs)
    # lossless sampling: the target's log-likelihood of the output is measured, nothing is lossy
    assert all(r["mean_log_p"] < 0 and r["lossy"] is False for r in runs)
    assert "| mean log p | lossy |" in (out / "report.md").read_text()
    assert "**Lossy**" not in (out / "report.md").read_text()


def test_batch_size_sweep_report(tiny_target_path, draft_folder, tmp_path):
    """--batch-sizes 1,2,4: one run per method and batch size, each against plain decoding at
    its own batch size, on the same prompts (the first 4 of 5: whole batches of each size);
    transformers' assisted methods at batch size 1 only; the crossover of every method as the
    rows' speedups give it; the sweep's table and plot."""
    out = tmp_path / "eval"
    evaluate.main(
        ["--target", tiny_target_path, "--drafter", str(draft_folder), "--num-prompts", "5",
         "--max-new-tokens", "8", "--gamma", "3", "--batch-sizes", "4,1,2", "--output", str(out),
         "--prompts", "demo"]
    )  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    assert report["settings"]["batch_sizes"] == [1, 2, 4]
    assert report["settings"]["num_prompts"] == 4
    rows = [(r["name"], r["batch_size"]) for r in report["runs"]]
    batched = ["ar", "hf_ar", "prompt_lookup", "copy"]
    assert sorted(rows) == sorted(
        [(n, b) for n in batched for b in (1, 2, 4)]
        + [("hf_prompt_lookup", 1), ("hf_assisted[copy]", 1)]
    )
    at = {(r["name"], r["batch_size"]): r for r in report["runs"]}
    for r in report["runs"]:
        assert set(r) == FIELDS and r["num_prompts"] == 4
        assert r["label"] == at[r["name"], 1]["label"]  # one label per method: its plot line
        plain = at["ar", r["batch_size"]]
        assert r["speedup_vs_ar"] == pytest.approx(r["tokens_per_s"] / plain["tokens_per_s"])
    for b in (1, 2, 4):
        assert at["ar", b]["speedup_vs_ar"] == 1.0 and at["ar", b]["tau"] == 1.0
        copy_b = at["copy", b]  # a copy of the target: every draft accepted, at every batch size
        assert copy_b["drafted"] > 0 and copy_b["acceptance_per_position"][0] == 1.0
        for name in ("ar", "prompt_lookup", "copy"):  # our loop, greedy: plain's output
            assert at[name, b]["matches_ar"] is True
        for name in batched:  # greedy: each prompt decodes as it does alone, at every size
            assert at[name, b]["new_tokens"] == at[name, 1]["new_tokens"]
    assert set(report["crossover"]) == {"hf_ar", "prompt_lookup", "copy", "hf_prompt_lookup",
                                        "hf_assisted[copy]"}  # fmt: skip
    for name, b in report["crossover"].items():
        speedups = {
            r["batch_size"]: r["speedup_vs_ar"] for r in report["runs"] if r["name"] == name
        }
        assert b == crossover(speedups)
    md = (out / "report.md").read_text()
    assert "## Speedup against batch size" in md and "| label | b=1 | b=2 | b=4 | crossover |" in md
    for plot in ("acceptance_per_position", "tau_distribution", "speedup", "batch_sizes"):
        assert (out / f"{plot}.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--batch-sizes", "0"], "--batch-sizes: batch size 0: each must be a whole number >= 1"),
        (["--batch-sizes", "-1"], "batch size -1: each must be a whole number >= 1"),
        (["--batch-sizes", "abc"], "'abc' is not a batch size: give whole numbers >= 1"),
        (["--batch-sizes", ""], "give batch sizes separated by commas, e.g. 1,2,4,8,16"),
        (["--batch-sizes", "1,2,2"], "give each batch size once"),
        (["--batch-sizes", "1,16", "--num-prompts", "4"],
         "needs at least 16 prompts (one batch of 16), and --num-prompts gives 4: raise "
         "--num-prompts to 16"),
    ],
)  # fmt: skip
def test_bad_batch_sizes_are_refused_before_anything_loads(
    args, message, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: pytest.fail("loaded a target"))
    with pytest.raises(SystemExit):
        evaluate.main([*args, "--output", str(tmp_path / "out")])
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_prompts_that_cannot_be_measured_are_refused_before_the_target_loads(
    tiny_target_path, tmp_path, capsys, monkeypatch
):
    prompts = tmp_path / "p.txt"
    prompts.write_text("def f(x):\n\nimport os\n\nx = 1\n")
    monkeypatch.setattr(evaluate, "load_target", lambda *a, **k: pytest.fail("loaded a target"))
    with pytest.raises(SystemExit, match=f"--prompts {prompts} gives 3: raise --num-prompts to 4"):
        evaluate.main(["--target", tiny_target_path, "--prompts", str(prompts), "--num-prompts",
                       "8", "--batch-sizes", "1,4", "--output", str(tmp_path / "out")])  # fmt: skip
    assert not (tmp_path / "out").exists()
    # and at batch size 1, a prompt longer than the target's context leaves room for
    prompts.write_text("word " * 3000)
    with pytest.raises(SystemExit, match="more than the target's context"):
        evaluate.main(["--target", tiny_target_path, "--prompts", str(prompts),
                       "--output", str(tmp_path / "out")])  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_unknown_baseline_is_refused(tmp_path, capsys):
    """Refused by name with the ones there are, before any target is loaded or file written."""
    with pytest.raises(SystemExit):
        evaluate.main(["--baselines", "ar,medusa", "--output", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "unknown baselines ['medusa']" in err and "choose from ar," in err
    assert not (tmp_path / "out").exists()


def test_one_drafter_under_several_decoding_settings(tiny_target, tiny_target_path, tmp_path):
    """FOLDER:key=value,... measures the same head as a chain, a stopping int8 chain and a tree
    in one run; a key the drafter does not have, or a bad value, is refused by name."""
    from specdraft.core import DecodeConfig
    from specdraft.formats.checkpoint import save_drafter
    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter

    torch.manual_seed(0)
    head = EagleDrafter.build(EagleConfig(), tiny_target)
    folder = tmp_path / "head"
    fingerprint = tiny_target.fingerprint
    save_drafter(head, folder, target_fingerprint=fingerprint, decode=DecodeConfig(gamma=3))
    out = tmp_path / "eval"
    specs = [str(folder), f"{folder}:draft_weights=int8,stop_below=0.01,gamma=4",
             f"{folder}:tree_top_k=2,tree_budget=5", f"{folder}:lookup_ngram=1,stop_below=0"]  # fmt: skip
    args = ["--target", tiny_target_path, "--baselines", "ar", "--num-prompts", "1",
            "--max-new-tokens", "8", "--output", str(out)]  # fmt: skip
    evaluate.main(args + [x for spec in specs for x in ("--drafter", spec)])
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["name"] for r in runs] == [
        "ar", "head", "head:draft_weights=int8,stop_below=0.01,gamma=4",
        "head:tree_top_k=2,tree_budget=5", "head:lookup_ngram=1,stop_below=0",
    ]  # fmt: skip
    assert [r["label"] for r in runs] == ["ar", "head", "eagle#1", "eagle#2", "eagle#3"]
    assert all(r["matches_ar"] for r in runs)
    # each run reports the settings it drafted with: the saved defaults, then its overrides
    assert runs[0]["decode"] is None and runs[1]["decode"]["gamma"] == 3
    assert runs[2]["decode"] | {} == runs[1]["decode"] | dict(
        draft_weights="int8", stop_below=0.01, gamma=4
    )
    assert runs[3]["decode"]["tree_top_k"] == 2 and runs[3]["decode"]["tree_budget"] == 5
    bad = {
        f"{folder}:tree_widht=2": "unknown key 'tree_widht'; did you mean 'tree_budget' or 'tree_top_k'",
        f"{folder}:version=eagle1": "unknown key 'version'",
        f"{folder}:draft_weights=int4": "draft_weights='int4' is not one of: full \\| int8",
        f"{folder}:stop_below=1.5": r"stop_below must be a number in \[0, 1\)",
        f"{folder}:gamma=abc": r"\(gamma=abc\): gamma expects int; got 'abc'",
        f"{folder}:lookup_ngram=2.5": "lookup_ngram expects int; got '2.5'",
        f"{folder}:lookup_ngram=-1": "lookup_ngram must be an integer >= 0",
        f"{folder}:gamma=0": "gamma must be an integer >= 1",
        # another kind's setting, named with its owner
        f"{folder}:exit_layer=2": "exit_layer='2' is a LayerSkip drafter's decoding setting, "
        "which this eagle drafter does not take: drop exit_layer, or use a LayerSkip drafter",
        f"{folder}:tree_top_k=0": "tree_top_k must be an integer >= 1",
        f"{folder}:gamma": "head:gamma",  # no "=": read as a folder name, which is not there
    }
    for spec, message in bad.items():
        with pytest.raises((SystemExit, OSError, ValueError), match=message):
            evaluate.main([*args, "--drafter", spec])


def test_short_labels_are_short_distinct_and_keep_short_names():
    long = "runs/eagle-demo/final:lookup_ngram=0,tree_top_k=4,tree_budget=12"
    rows = [("ar", "ar"), ("hf_prompt_lookup", "hf_prompt_lookup"), (long, "eagle"),
            (long.replace("=0", "=2"), "eagle"), ("runs/distill-demo/final", "distill"),
            ("hf_assisted[runs/distill-demo/final]", "hf_assisted"), ("copy", "distill"),
            ("copy", "distill"), ("eagle#1", "eagle")]  # fmt: skip
    labels = short_labels([{"name": n, "method": m} for n, m in rows])
    assert labels == ["ar", "hf_prompt_lookup", "eagle#1", "eagle#2", "distill#1",
                      "hf[distill#1]", "copy", "copy#2", "eagle#1#2"]  # fmt: skip


def test_a_drafters_own_settings_shape_its_drafts(tiny_target, tiny_target_path, tmp_path):
    """FOLDER:key=value reaches that run and only it: one trained head measured as saved (a
    chain 4 deep), cut to 2 deep, and widened into a tree shows each shape in report.json."""
    from specdraft.core import DecodeConfig
    from specdraft.formats.checkpoint import save_drafter
    from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter

    torch.manual_seed(0)
    head = EagleDrafter.build(EagleConfig(ttt_steps=2), tiny_target)
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=3e-3)
    for _ in range(30):  # on the target's own predictions, until the head gets drafts accepted
        ids = torch.randint(3, tiny_target.vocab_size, (8, 24))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "loss_mask": torch.ones_like(ids)}  # fmt: skip
        loss, _ = head(batch, tiny_target.forward(ids, capture_layers=head.capture_layers))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    folder = tmp_path / "head"
    saved = DecodeConfig(gamma=4, tree_top_k=1)  # the saved decoding defaults
    save_drafter(head.eval(), folder, target_fingerprint=tiny_target.fingerprint, decode=saved)
    out = tmp_path / "eval"
    specs = [str(folder), f"{folder}:gamma=2", f"{folder}:tree_top_k=3,tree_budget=9"]
    evaluate.main(
        ["--target", tiny_target_path, "--baselines", "ar", "--num-prompts", "2",
         "--max-new-tokens", "24", "--output", str(out)]
        + [x for spec in specs for x in ("--drafter", spec)]
    )  # fmt: skip
    runs = json.loads((out / "report.json").read_text())["runs"]
    assert [r["name"] for r in runs] == [
        "ar", "head", "head:gamma=2", "head:tree_top_k=3,tree_budget=9",
    ]  # fmt: skip
    saved, shallow, tree = runs[1:]
    for r in (saved, shallow, tree):
        assert r["matches_ar"] is True and r["drafted"] > 0 and r["accepted"] > 0

    def drafting_passes(r) -> int:
        """Target passes that verified a draft: all but each prompt's first (an EAGLE head has
        no target features before the prompt's forward, so it drafts nothing there)."""
        return round(r["new_tokens"] / r["tau"]) - r["num_prompts"]

    # As saved: a chain deeper than 2, verified deeper than 2.
    assert saved["drafted"] > 2 * drafting_passes(saved)
    assert len(saved["acceptance_per_position"]) > 2
    # gamma=2: at most 2 draft tokens per pass, so alpha_1, alpha_2 only and tau <= 3.
    assert shallow["drafted"] <= 2 * drafting_passes(shallow)
    assert len(shallow["acceptance_per_position"]) <= 2 and shallow["tau"] <= 3
    # tree_top_k=3, tree_budget=9: more nodes per pass than a chain 4 deep can hold.
    assert tree["drafted"] > 4 * drafting_passes(tree)
    assert len(tree["acceptance_per_position"]) <= 4


def test_the_target_defaults_to_the_drafters_own_else_the_embedded_one(tmp_path, draft_folder):
    """No --target: the first drafter folder's run names it (train_config.yaml), with no drafter
    the embedded default; a drafter folder that does not say is an error asking for --target."""
    from specdraft.targets.target import DEFAULT_TARGET

    args, _ = evaluate.parse_args(["--output", str(tmp_path)])
    assert args.target == DEFAULT_TARGET == "smollm2-135m"
    run = tmp_path / "run"
    shutil.copytree(draft_folder, run)
    (run / "train_config.yaml").write_text("target: some/model\n")
    args, _ = evaluate.parse_args(["--drafter", f"{run}:gamma=3", "--output", str(tmp_path)])
    assert args.target == "some/model"
    for folder in (draft_folder, tmp_path):  # no train_config.yaml; no drafter at all
        with pytest.raises(SystemExit):
            evaluate.parse_args(["--drafter", str(folder), "--output", str(tmp_path)])
