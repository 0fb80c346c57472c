"""The DFlash entry script end to end on the tiny target (trains, saves, decodes exactly in its
end-of-run loop), exact resume, the step's token mean, bad input, and its recipes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from specdraft.config import SHIPPED_CONFIGS, load_config
from specdraft.core import DecodeConfig
from specdraft.data.formats import Example
from specdraft.formats.reading import load_decoding, load_drafter
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.dflash.dflash_trainer import DFlashTrainConfig
from specdraft.train.entry import main as train_main
from specdraft.train.lr_schedule import collate, step_seed
from specdraft.train.trainer import train

RECIPES = sorted((SHIPPED_CONFIGS / "dflash").glob("*.yaml"))

COMMON = [
    "micro_batch_size=4", "data.max_samples=40", "data.max_length=32", "warmup_steps=1",
    "lr=3e-3", "drafter.block_size=4", "drafter.anchors=6", "decode.gamma=3",
    "decode.lookup_ngram=0", "mixed_precision=no",
]  # fmt: skip


def test_trains_saves_and_drafts_exactly_in_its_end_of_run_loop(
    tiny_target, tiny_target_path, tmp_path
):
    out = tmp_path / "run"
    code = train_main("dflash", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=2", "eval_every=2",
        "eval_batches=2", "save_every=0", *COMMON, "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=16", "eval_loop.threads=1",
    ])  # fmt: skip
    assert code == 0
    drafter = load_drafter(out / "final", tiny_target)
    assert isinstance(drafter, DFlashDrafter) and drafter.config.block_size == 4
    assert drafter.config.mask_token_id is not None  # resolved, saved in the config
    assert load_decoding(out / "final") == DecodeConfig(gamma=3)
    served = json.loads((out / "eval_loop.json").read_text())
    # the drafter alone (no copying): drafted and accepted, the same tokens as plain greedy
    assert served["drafted"] > 0 and served["accepted"] > 0 and served["matches_ar"] is True
    assert not served["copied_share"]


def test_a_resumed_run_equals_an_uninterrupted_one(tiny_target_path, tmp_path):
    """The anchors come from the step's seed and each example's index: a run restarted from
    checkpoint-2 ends with the same weights and losses."""
    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=0", "save_every=2",
        "eval_loop.enabled=false", *COMMON,
    ]  # fmt: skip
    assert train_main("dflash", [*common, f"output_dir={tmp_path / 'straight'}"]) == 0
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    assert (
        train_main("dflash", [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from=latest"])
        == 0
    )
    a, b = (
        load_file(tmp_path / d / "final" / "model.safetensors") for d in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    states = [
        json.loads((tmp_path / d / "checkpoint-4" / "trainer_state.json").read_text())["losses"]
        for d in ("straight", "resumed")
    ]
    assert states[0] == states[1] and len(states[0]) == 4


@pytest.mark.parametrize(("kind", "extra"), [("dflash", []), ("dspark", ["drafter.markov_rank=8"])])
def test_offline_training_from_the_hidden_cache_equals_online(
    kind, extra, tiny_target_path, tmp_path
):
    """scripts/dump_hidden_states.py --kind KIND (found through the kind's trainer; DSpark's is
    DFlash's with its own head) stores the aux layers and the final state; training from that
    cache gives the online run's losses and weights."""
    from specdraft.tools import dump_hidden_states

    data = tmp_path / "code.txt"  # a few dozen examples: the dump stores every one
    data.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n\n" for i in range(60)))
    args = [
        f"target={tiny_target_path}", "max_steps=2", "eval_every=2", "eval_batches=1",
        "save_every=2", "eval_loop.enabled=false", *COMMON, f"data.path={data}",
        "data.eval_fraction=0.1", *extra,
    ]  # fmt: skip
    cache = tmp_path / "cache"
    assert dump_hidden_states.main(["--kind", kind, "--out", str(cache), "--dtype", "fp32", *args]) == 0  # fmt: skip
    assert train_main(kind, [*args, f"output_dir={tmp_path / 'online'}"]) == 0
    assert (
        train_main(kind, [*args, f"output_dir={tmp_path / 'offline'}", f"hidden_cache={cache}"])
        == 0
    )
    on, off = (
        json.loads((tmp_path / d / "checkpoint-2" / "trainer_state.json").read_text())
        for d in ("online", "offline")
    )
    assert off["losses"] == pytest.approx(on["losses"], rel=1e-5)
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("online", "offline"))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-5) for k in a)


def test_the_step_loss_is_the_mean_over_every_scored_slot(tiny_target, tmp_path):
    """Two micro-batches of very different lengths: the trainer's first loss equals the sum of
    each example's loss alone (with the anchors prepare_batch gives it) over their scored slots."""
    g = torch.Generator().manual_seed(5)
    examples = []
    for length, prompt in ((40, 3), (8, 2), (28, 20), (11, 1)):
        ids = torch.randint(3, tiny_target.vocab_size, (length,), generator=g).tolist()
        examples.append(Example(input_ids=ids, loss_mask=[0] * prompt + [1] * (length - prompt)))
    config = DFlashConfig(block_size=4, anchors=5)
    torch.manual_seed(0)
    drafter = DFlashDrafter.build(config, tiny_target)
    cfg = DFlashTrainConfig(
        target="tiny", output_dir=str(tmp_path / "run"), max_steps=1, micro_batch_size=2,
        grad_accum=2, lr=1e-3, warmup_steps=0, eval_every=0, save_every=0, seed=0,
        drafter=config, decode=DecodeConfig(gamma=3), mixed_precision="no",
    )  # fmt: skip
    shared = torch.Generator().manual_seed(step_seed(cfg.seed, 0, -1))
    sums = counts = 0.0
    with torch.no_grad():
        for i, e in enumerate(examples):
            batch = collate([e], "cpu") | {"example_index": torch.tensor([i])}
            batch = drafter.prepare_batch(batch, tiny_target, None, shared)
            out = tiny_target.forward(batch["input_ids"], capture_layers=drafter.capture_layers)
            sums += float(drafter(batch, out)[0])
            counts += float(drafter.loss_tokens(batch))
    assert counts > 20
    result = train(cfg, drafter, tiny_target, examples, examples[:2], tokenizer=tiny_target.tokenizer)  # fmt: skip
    assert result.losses[0] == pytest.approx(sums / counts, rel=1e-5)


def test_bad_input_is_a_clear_error(tiny_target_path, tmp_path, capsys):
    for setting, message in [
        ("drafter.mask_token_id=100000", "mask_token_id=100000 is outside"),
        ("drafter.aux_layers=[1,9]", "layer id 9 is out of range"),
    ]:
        code = train_main("dflash", [
            f"target={tiny_target_path}", f"output_dir={tmp_path / 'run'}",
            "data.max_samples=8", setting,
        ])  # fmt: skip
        assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # nothing was written


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_recipes_load(recipe):
    cfg = load_config(DFlashTrainConfig, recipe)
    assert cfg.drafter.block_size >= 2 and cfg.decode.gamma == cfg.drafter.block_size - 1
