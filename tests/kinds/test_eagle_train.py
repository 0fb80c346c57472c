"""The EAGLE entry script end to end on the tiny target, and its recipes."""

from __future__ import annotations

import json
import re
import shlex

import pytest
import torch

from specdraft.config import SHIPPED_CONFIGS, load_config
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.inference import generate
from specdraft.kinds.eagle.eagle import EagleDrafter
from specdraft.kinds.eagle.eagle_trainer import EagleTrainConfig
from specdraft.tools import export
from specdraft.train.entry import main as train_main

RECIPES = sorted((SHIPPED_CONFIGS / "eagle").glob("*.yaml"))


@pytest.mark.parametrize("version", ["eagle3", "eagle1"])
def test_training_lowers_the_loss_and_final_loads(tiny_target, tiny_target_path, tmp_path, version):
    out = tmp_path / "run"
    code = train_main("eagle", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=8", "micro_batch_size=4",
        "eval_every=8", "eval_batches=2", "save_every=0", "data.max_samples=40",
        "data.max_length=32", "warmup_steps=1", "lr=3e-3", f"drafter.version={version}",
        "drafter.draft_vocab_size=256", "drafter.ttt_steps=2", "decode.gamma=3",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
        "mixed_precision=no",
        # EAGLE-1 drafts EAGLE-2's dynamic tree, which the training path has no served drafts
        # for: the simulation walks the serving session itself on the continuations
        *(["decode.tree_top_k=2", "decode.tree_budget=6"] if version == "eagle1" else []),
        # EAGLE-3 drafts with its full weights, which the training path computes as served
        *(["decode.draft_weights=full"] if version == "eagle3" else []),
    ])  # fmt: skip
    assert code == 0
    state = json.loads((out / "checkpoint-8" / "trainer_state.json").read_text())
    before, after = state["evals"][0], state["evals"][-1]
    assert after["loss"] < before["loss"]
    assert len(after["alpha"]) == 3 and after["tau"] > 1.0
    head = load_drafter(out / "final", tiny_target)
    assert isinstance(head, EagleDrafter) and head.config.version == version
    if version == "eagle3":
        # the draft vocabulary was counted from the data and always holds EOS
        assert head.d2t.shape == (256,) and tiny_target.tokenizer.eos_token_id in head.d2t.tolist()
        assert head.config.feature_layers == [1, 1, 1]  # resolved, saved in the config
    saved = (out / "final" / "train_config.yaml").read_text()
    assert f"version: {version}" in saved
    # the saved head, measured in the loop on held-out demo prompts beside plain decoding
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["num_prompts"] == 2 and served["drafted"] > 0 and served["accepted"] > 0
    assert served["tau"] > 1  # accepted drafts: more than one token per target pass
    assert served["matches_ar"] is True  # greedy: the same tokens as plain greedy decoding
    # the simulated tau beside it is the greedy one, as it was measured greedy
    assert served["speedup_vs_ar"] > 0 and served["simulated_tau"] == after["tau_greedy"]
    # evaluated on the target's own greedy continuations of the same prompts, the simulation
    # walks the loop's steps: training predicts serving exactly (fp32 here)
    how = "served" if version == "eagle3" else "session"
    assert after["eval_on"] == "served-greedy" and after["greedy_simulation"] == how
    assert served["simulated_on"] == "served-greedy" and served["simulated_tau"] == served["tau"]
    assert served["torch_threads"] == 1  # as asked, and stated beside the speedup
    # copying on (lookup_ngram 2): the head alone measured beside it, also exact; and what
    # each prompt decoded to, for a reader
    assert served["decode"]["lookup_ngram"] == 2 and served["alone"]["matches_ar"] is True
    assert served["alone"]["tau"] >= 1 and served["alone"]["speedup_vs_ar"] > 0
    rows = served["outputs"]
    assert len(rows) == 2 and all(r["prompt"] and r["text"] for r in rows)
    # the trained head goes to the serving engines' layouts and comes back the same head
    prompt = tiny_target.tokenizer("def add(a, b):")["input_ids"]
    decode = load_decoding(out / "final")
    assert decode.gamma == 3  # decode.gamma=3, saved with the head
    ours = generate(tiny_target, prompt, head, max_new_tokens=16, decode=decode)
    if version == "eagle3":
        # the tiny target has 2 layers: its head fuses layer 1 thrice, which no engine can
        # capture (tests/tools/test_export.py exports EAGLE-3 heads of a deeper target)
        assert export.main(["--format", "speculators", str(out / "final"), str(tmp_path / "s")]) == 2  # fmt: skip
        return
    for fmt in ["eagle"]:
        assert export.main(["--format", fmt, str(out / "final"), str(tmp_path / fmt)]) == 0
        back = load_drafter(tmp_path / fmt, tiny_target)
        theirs = generate(tiny_target, prompt, back, max_new_tokens=16, decode=decode)
        assert torch.equal(theirs.tokens, ours.tokens) and theirs.stats.drafted > 0
        assert theirs.stats.accepted == ours.stats.accepted


def test_bad_input_is_a_clear_error(tiny_target_path, tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 20)
    common = [f"target={tiny_target_path}", f"data.path={data}", f"output_dir={tmp_path / 'run'}"]
    assert train_main("eagle", [*common, "drafter.feature_layers=[1,2,9]"]) == 2
    assert "layer id 9 is out of range" in capsys.readouterr().err
    assert train_main("eagle", [*common, "drafter.draft_vocab_size=5000"]) == 2
    assert "larger than the target" in capsys.readouterr().err
    # a sharded target is for online training: offline, no target forward runs
    with pytest.raises(SystemExit) as stop:
        train_main("eagle", [*common, "target_sharding=zero3", f"hidden_cache={tmp_path}"])
    assert stop.value.code == 2 and "drop one of them" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("eagle", [*common, "target_sharding=fsdp"])
    assert "not one of: none | zero3" in capsys.readouterr().err
    assert (
        train_main("eagle", [*common, "target_sharding=zero3", f"target={tmp_path / 'none'}"]) == 2
    )
    assert "does not exist" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(EagleTrainConfig, recipe)
    assert cfg.drafter.version == "eagle3" and cfg.drafter.ttt_steps >= 3
    assert torch.tensor(cfg.drafter.draft_vocab_size) > 0


def test_a_resumed_eagle1_run_equals_an_uninterrupted_one(tiny_target_path, tmp_path):
    """Resume is bit-exact for EAGLE heads too, feature noise included (its draws come from the
    step's seed): a run restarted from checkpoint-2 ends with the same weights and losses."""
    import shutil

    from safetensors.torch import load_file

    common = [
        f"target={tiny_target_path}", "max_steps=4", "micro_batch_size=4", "eval_every=0",
        "save_every=2", "data.max_samples=40", "data.max_length=32", "warmup_steps=1",
        "lr=3e-3", "drafter.version=eagle1", "decode.gamma=3", "eval_loop.enabled=false",
    ]  # fmt: skip
    assert train_main("eagle", [*common, f"output_dir={tmp_path / 'straight'}"]) == 0
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    assert (
        train_main("eagle", [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from=latest"])
        == 0
    )
    a, b = (
        load_file(tmp_path / d / "final" / "model.safetensors") for d in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [
        json.loads((tmp_path / d / "checkpoint-2" / "trainer_state.json").read_text())["losses"]
        for d in ("straight", "resumed")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2
    final = [
        json.loads((tmp_path / d / "final" / "config.json").read_text())
        for d in ("straight", "resumed")
    ]
    assert final[0]["specdraft"]["config"]["feature_noise"] == 0.1  # the noise was on


def test_resuming_with_other_drafter_settings_names_them(tiny_target_path, tmp_path):
    """A checkpoint of a head with a smaller draft vocabulary, resumed under a config that builds
    a larger one: a clear error naming the setting that differs and how to resume, the
    checkpoint untouched."""
    from specdraft.train.trainer import ResumeError

    common = [
        f"target={tiny_target_path}", "max_steps=2", "micro_batch_size=4", "eval_every=0",
        "save_every=2", "data.max_samples=16", "data.max_length=32", "drafter.ttt_steps=2",
        "eval_loop.enabled=false", f"output_dir={tmp_path}",
    ]  # fmt: skip
    assert train_main("eagle", [*common, "drafter.draft_vocab_size=128"]) == 0
    common.append("drafter.draft_vocab_size=256")
    saved = (tmp_path / "checkpoint-2" / "model.safetensors").read_bytes()
    with pytest.raises(ResumeError) as err:
        train_main("eagle", [*common, "max_steps=4", "resume_from=latest"])
    said = str(err.value)
    assert "drafter.draft_vocab_size: 128 there, 256 here" in said
    assert "drafter.draft_vocab_size=128" in said and "untouched" in said
    assert (tmp_path / "checkpoint-2" / "model.safetensors").read_bytes() == saved
    # the overrides it names, as given, resume the run
    override = re.search(r"trained with \((.*?)\), or start", said).group(1)
    assert (
        train_main("eagle", [*common, "max_steps=4", "resume_from=latest", *shlex.split(override)])
        == 0
    )
