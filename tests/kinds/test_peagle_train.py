"""The P-EAGLE entry script end to end on the tiny target (its end-of-run loop drafts and
accepts exactly), bit-exact resume, the step's token mean under COD, bad values named, and its
recipes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specdraft.config import SHIPPED_CONFIGS, load_config
from specdraft.core import DecodeConfig
from specdraft.data.formats import Example
from specdraft.formats.reading import load_drafter
from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter
from specdraft.kinds.peagle.peagle_trainer import PEagleTrainConfig
from specdraft.targets.target import load_target
from specdraft.train.entry import main as train_main
from specdraft.train.lr_schedule import collate, examples_for, step_seed
from specdraft.train.trainer import train

RECIPES = sorted((SHIPPED_CONFIGS / "peagle").glob("*.yaml"))

COMMON = [
    "micro_batch_size=4", "data.max_samples=40", "data.max_length=32", "warmup_steps=1",
    "lr=3e-3", "drafter.num_depths=3", "drafter.draft_vocab_size=256", "decode.gamma=3",
]  # fmt: skip


def test_two_steps_train_and_the_saved_head_drafts_and_accepts_in_the_loop(
    tiny_target, tiny_target_path, tmp_path
):
    out = tmp_path / "run"
    code = train_main("peagle", [
        *COMMON, f"target={tiny_target_path}", f"output_dir={out}", "max_steps=2",
        "eval_every=2", "eval_batches=2", "save_every=0", "decode.lookup_ngram=0",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
    ])  # fmt: skip
    assert code == 0
    head = load_drafter(out / "final", tiny_target)
    assert isinstance(head, PEagleDrafter) and head.config.num_depths == 3
    assert head.d2t.shape == (256,) and tiny_target.tokenizer.eos_token_id in head.d2t.tolist()
    saved = json.loads((out / "final" / "config.json").read_text())["specdraft"]
    assert saved["kind"] == "peagle" and saved["config"]["mask_token_id"] is not None
    served = json.loads((out / "eval_loop.json").read_text())
    # no copying: what was accepted, the head drafted
    assert served["drafted"] > 0 and served["accepted"] > 0 and not served["copied_share"]
    assert served["matches_ar"] is True  # greedy: the same tokens as plain greedy decoding


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_target_path, tmp_path):
    """COD's draws come from the step's seed and the example's index: a run restarted from
    checkpoint-2 ends with the same weights and losses."""
    common = [
        *COMMON, f"target={tiny_target_path}", "max_steps=4", "eval_every=0", "save_every=2",
        "eval_loop.enabled=false", "drafter.down_sample_ratio=0.5",
    ]  # fmt: skip
    assert train_main("peagle", [*common, f"output_dir={tmp_path / 'straight'}"]) == 0
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    assert (
        train_main("peagle", [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from=latest"])
        == 0
    )
    a, b = (
        load_file(tmp_path / d / "final" / "model.safetensors") for d in ("straight", "resumed")
    )
    assert "mask_hidden" in a and a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    losses = [
        json.loads((tmp_path / d / "checkpoint-2" / "trainer_state.json").read_text())["losses"]
        for d in ("straight", "resumed")
    ]
    assert losses[0] == losses[1] and len(losses[0]) == 2


def test_the_step_loss_is_the_token_mean_over_the_kept_slots(tiny_target_path, tmp_path):
    """Two uneven micro-batches: the step's loss is the sum of every example's loss (alone,
    unpadded, with the draws the trainer makes for it) over all their scored slots."""
    target = load_target(tiny_target_path)
    g = torch.Generator().manual_seed(5)
    examples = []
    for length, prompt in ((40, 3), (6, 2), (28, 20), (9, 1)):
        ids = torch.randint(3, target.vocab_size, (length,), generator=g).tolist()
        examples.append(Example(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt)))
    drafter_cfg = PEagleConfig(num_depths=3, down_sample_ratio=0.5, draft_vocab_size=128)
    torch.manual_seed(0)
    d2t = torch.randperm(target.vocab_size, generator=torch.Generator().manual_seed(1))[:128]
    drafter = PEagleDrafter.build(drafter_cfg, target, d2t.sort().values)
    cfg = PEagleTrainConfig(
        target="tiny", output_dir=str(tmp_path / "run"), max_steps=1, micro_batch_size=2,
        grad_accum=2, lr=1e-3, warmup_steps=0, eval_every=0, eval_batches=1, save_every=0,
        log_every=1, seed=0, drafter=drafter_cfg, decode=DecodeConfig(gamma=2),
        mixed_precision="no",
    )  # fmt: skip
    shared = torch.Generator().manual_seed(step_seed(cfg.seed, 0, -1))
    sums, counts = [], []
    with torch.no_grad():
        for i, e in enumerate(examples):
            batch = collate([e], "cpu") | {"example_index": torch.tensor([i])}
            batch = drafter.prepare_batch(batch, target, None, shared)
            out = target.forward(batch["input_ids"], capture_layers=drafter.capture_layers)
            sums.append(float(drafter(batch, out)[0]))
            counts.append(float(drafter.loss_tokens(batch)))
    naive = sum(sums) / sum(counts)
    micro = [examples_for(0, m, 0, len(examples), cfg, 1) for m in range(2)]
    wrong = sum(sum(sums[i] for i in r) / sum(counts[i] for i in r) for r in micro) / 2
    assert wrong != pytest.approx(naive, rel=1e-4)  # 10x the tolerance below: told apart
    result = train(cfg, drafter, target, examples, examples[:2], tokenizer=target.tokenizer)
    assert result.losses[0] == pytest.approx(naive, rel=1e-5, abs=1e-7)


def test_bad_values_are_named(tiny_target_path, tmp_path, capsys):
    data = tmp_path / "tiny.txt"
    data.write_text("def f(x):\n    return x + 1\n" * 20)
    common = [
        f"target={tiny_target_path}",
        f"data.path={data}",
        f"output_dir={tmp_path / 'run'}",
        "drafter.draft_vocab_size=256",
    ]  # fmt: skip
    assert train_main("peagle", [*common, "drafter.mask_token_id=100000"]) == 2
    assert "mask_token_id=100000 is not a token of the target" in capsys.readouterr().err
    for bad, said in (
        ("drafter.num_depths=1", "num_depths must be >= 2"),
        ("drafter.down_sample_ratio=0", "down_sample_ratio must be in (0, 1]"),
        ("drafter.down_sample_ratio=1.5", "down_sample_ratio must be in (0, 1]"),
    ):
        with pytest.raises(SystemExit) as stop:
            train_main("peagle", [*common, bad])
        assert stop.value.code == 2 and said in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(PEagleTrainConfig, recipe)
    assert cfg.drafter.num_depths >= 2 and 0 < cfg.drafter.down_sample_ratio <= 1
    assert cfg.decode.gamma <= cfg.drafter.num_depths and cfg.decode.tree_top_k == 1
