"""scripts/export.py: a trained drafter folder loaded with the target its training config names
and written in each format; bad input exits 2 with a one-line error and writes nothing."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch
from testkit import perturb
from transformers import LlamaForCausalLM

from specdraft.drafters.base import drafter_class
from specdraft.formats.checkpoint import CheckpointError, save_drafter, set_decode
from specdraft.formats.export_registry import FORMATS
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.targets.target import load_target
from specdraft.tools import export


@pytest.fixture(scope="module")
def heads_folder(tiny_target, tiny_target_path, tmp_path_factory):
    """Medusa heads trained (here: perturbed) for the tiny demo target, saved as a run does."""
    torch.manual_seed(0)
    heads = MedusaDrafter.build(MedusaConfig(num_heads=2), tiny_target)
    perturb(heads.parameters(), 0.1)
    folder = tmp_path_factory.mktemp("run") / "final"
    save_drafter(
        heads, folder, target_fingerprint=tiny_target.fingerprint,
        train_config_yaml=f"target: {tiny_target_path}\n",
    )  # fmt: skip
    return folder


@pytest.fixture(scope="module")
def deep_target(tiny_target, tmp_path_factory):
    """(path, Target): a random 6-layer target with the tiny demo target's tokenizer, saved as a
    model folder: deep enough for three distinct fused layers below its final normed state."""
    config = tiny_target.config.__class__(
        **{**tiny_target.config.to_dict(), "num_hidden_layers": 6}
    )
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("deep") / "target"
    LlamaForCausalLM(config).save_pretrained(path)
    tiny_target.tokenizer.save_pretrained(path)
    return str(path), load_target(str(path))


@pytest.fixture(scope="module")
def eagle_folders(deep_target, tmp_path_factory):
    """An EAGLE-3 and an EAGLE-1 head, saved as a run saves them."""
    path, target = deep_target
    folders = {}
    for name, config in {
        "eagle3": EagleConfig(feature_layers=[1, 2, 3], draft_vocab_size=100),
        "eagle1": EagleConfig(version="eagle1"),
    }.items():
        torch.manual_seed(0)
        head = EagleDrafter.build(config, target)
        folders[name] = tmp_path_factory.mktemp("run") / "final"
        save_drafter(
            head, folders[name], target_fingerprint=target.fingerprint,
            train_config_yaml=f"target: {path}\n",
        )  # fmt: skip
    return folders


@pytest.mark.parametrize("fmt, kind", [("speculators", "eagle3"), ("sglang", "eagle3"), ("eagle", "eagle1")])  # fmt: skip
def test_export_writes_eagle_heads_that_load_back(deep_target, eagle_folders, fmt, kind, tmp_path):
    out, target = tmp_path / fmt, deep_target[1]
    assert export.main(["--format", fmt, str(eagle_folders[kind]), str(out)]) == 0
    original, back = load_drafter(eagle_folders[kind], target), load_drafter(out, target)
    assert all(torch.equal(v, back.state_dict()[k]) for k, v in original.state_dict().items())


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_export_carries_the_decoding_settings_it_was_tuned_to(
    deep_target, eagle_folders, heads_folder, fmt, tmp_path
):
    """A folder tuned to a chain of 3 with copying, int8 drafting, a stop rule and a schedule
    by batch size reads back with them, and so does its export, not with DecodeConfig()'s
    gamma 5 and no copying. A speculators folder's gamma is its speculative_tokens, which vLLM
    serves."""
    kind = FORMATS[fmt].kinds[0]
    source = {"medusa": heads_folder}.get(kind) or eagle_folders["eagle1" if fmt == "eagle" else "eagle3"]  # fmt: skip
    folder = tmp_path / "tuned"
    shutil.copytree(source, folder)
    schedule = [{"batch_size": 4, "gamma": 2}, {"batch_size": 16, "off": True}]
    tuned = drafter_class(kind).decode_settings(
        gamma=3, lookup_ngram=2, draft_weights="int8", stop_below=0.1, batch_schedule=schedule
    )  # the kind's own settings class (MedusaDecode for heads)
    set_decode(folder, tuned)
    assert load_decoding(folder) == tuned and load_decoding(folder).for_batch(16) is None
    out = tmp_path / fmt
    assert export.main(["--format", fmt, str(folder), str(out)]) == 0
    assert load_decoding(out) == tuned
    if fmt == "speculators":
        config = json.loads((out / "config.json").read_text())
        assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
        config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 6
        (out / "config.json").write_text(json.dumps(config))
        assert load_decoding(out) == dataclasses.replace(tuned, gamma=6)


def test_a_folder_of_an_earlier_checkpoint_format_is_refused_with_the_fix(
    deep_target, eagle_folders, tmp_path, capsys
):
    """A folder an earlier specdraft wrote (checkpoint format 2) is neither loaded nor exported:
    the error names its format and says to retrain, and nothing is written."""
    old = tmp_path / "old"
    shutil.copytree(eagle_folders["eagle3"], old)
    config = json.loads((old / "config.json").read_text())
    config["specdraft"]["format_version"] = 2
    (old / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"checkpoint format 2; .*format 3 only.*retrain"):
        load_drafter(old, deep_target[1])
    assert export.main(["--format", "sglang", str(old), str(tmp_path / "o")]) == 2
    assert "checkpoint format 2" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", sorted(f for f, spec in FORMATS.items() if "medusa" in spec.kinds))
def test_export_writes_heads_that_load_back(tiny_target, heads_folder, fmt, tmp_path, capsys):
    out = tmp_path / fmt
    assert export.main(["--format", fmt, str(heads_folder), str(out), "--base-model", "b/m"]) == 0
    assert f"in {out}" in capsys.readouterr().out
    assert json.loads((out / "config.json").read_text())["base_model_name_or_path"] == "b/m"
    h = torch.randn(3, tiny_target.hidden_size)
    original = load_drafter(heads_folder, tiny_target)
    torch.testing.assert_close(load_drafter(out, tiny_target).logits(h), original.logits(h))


def test_the_base_model_defaults_to_where_the_target_was_loaded(
    heads_folder, tiny_target_path, tmp_path
):
    assert export.main(["--format", "medusa", str(heads_folder), str(tmp_path / "out")]) == 0
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_target_path


@pytest.mark.parametrize(
    "case, message",
    [
        ("not empty", "is not empty and holds no previous export"),
        ("no drafter", "has no config.json"),
        ("out is the drafter", "would replace the drafter folder"),
    ],
)
def test_bad_input_exits_2_with_one_line(heads_folder, tmp_path, capsys, case, message):
    folder, out = heads_folder, tmp_path / "out"
    if case == "not empty":
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    elif case == "no drafter":
        folder = tmp_path / "nothing"
    else:
        out = heads_folder
    force = ["--force"] if case == "out is the drafter" else []  # refused even when forced
    before = sorted(p.name for p in tmp_path.rglob("*"))
    assert export.main(["--format", "vllm", str(folder), str(out), *force]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].startswith("scripts/export.py: error: ")
    assert message in errors[0]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before
    assert sorted(p.name for p in heads_folder.iterdir()) == [
        "COMPLETE", "config.json", "model.safetensors", "train_config.yaml",
    ]  # fmt: skip
