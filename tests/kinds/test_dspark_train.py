"""`specdraft train dspark` end to end on the tiny target: trains, saves, drafts exactly in its
end-of-run loop; the recipes load (training from the hidden-state cache:
tests/kinds/test_dflash_train.py)."""

from __future__ import annotations

import json

import pytest

from specdraft.config import SHIPPED_CONFIGS, load_config
from specdraft.core import DecodeConfig
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.kinds.dspark.dspark import DSparkDrafter
from specdraft.kinds.dspark.dspark_trainer import DSparkTrainConfig
from specdraft.train.entry import main as train_main

RECIPES = sorted((SHIPPED_CONFIGS / "dspark").glob("*.yaml"))

COMMON = [
    "micro_batch_size=4", "data.max_samples=40", "data.max_length=32", "warmup_steps=1",
    "lr=3e-3", "drafter.block_size=4", "drafter.anchors=6", "drafter.markov_rank=8",
    "decode.gamma=4", "decode.lookup_ngram=0", "mixed_precision=no",
]  # fmt: skip


def test_trains_saves_and_drafts_exactly_in_its_end_of_run_loop(
    tiny_target, tiny_target_path, tmp_path
):
    out = tmp_path / "run"
    code = train_main("dspark", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=2", "eval_every=2",
        "eval_batches=2", "save_every=0", *COMMON, "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=16", "eval_loop.threads=1", "decode.stop_below=0.1",
    ])  # fmt: skip
    assert code == 0
    drafter = load_drafter(out / "final", tiny_target)
    assert isinstance(drafter, DSparkDrafter) and drafter.drafts_per_block == 4
    assert drafter.confidence_head is not None and drafter.config.markov_rank == 8
    assert load_decoding(out / "final") == DecodeConfig(gamma=4, stop_below=0.1)
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["drafted"] > 0 and served["matches_ar"] is True


def test_bad_settings_are_named(tiny_target_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:  # the config is refused as it is read
        train_main("dspark", [
            f"target={tiny_target_path}", f"output_dir={tmp_path / 'run'}", "drafter.markov_rank=0",
        ])  # fmt: skip
    assert stop.value.code == 2 and "markov_rank must be an integer >= 1" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(DSparkTrainConfig, recipe)
    assert cfg.drafter.sample_from_anchor and cfg.decode.gamma == cfg.drafter.block_size
