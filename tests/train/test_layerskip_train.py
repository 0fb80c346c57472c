"""LayerSkip training: layer dropout, the early-exit loss and its curricula, the entry script,
and the checkpoint as a plain HF model that is its own target."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from specdraft.drafters.checkpoint import CheckpointError, load_drafter
from specdraft.drafters.layerskip import (
    LayerSkipConfig,
    LayerSkipDrafter,
    active_exits,
    dropout_rates,
    exit_weights,
)
from specdraft.drafters.target import Target, load_target
from specdraft.train.layerskip import main


def test_scales_and_curricula():
    assert dropout_rates(5, 0.2, "uniform") == [0.2] * 5
    assert dropout_rates(5, 0.2, "linear") == pytest.approx([0, 0.05, 0.1, 0.15, 0.2])
    assert dropout_rates(3, 0.2, "exp") == pytest.approx([0, 0.2 * (2**0.5 - 1), 0.2])
    w = exit_weights([1, 2, 4], 4, "l", e_scale=0.5)
    assert w == pytest.approx({1: 0.5 / 5.5, 2: 1 / 5.5, 4: 4 / 5.5})
    assert sum(exit_weights([2, 3, 8], 8, "inv_sqrt_l", 1.0).values()) == pytest.approx(1)
    cfg = LayerSkipConfig(exit_layer=2, curriculum="rotational", rotation_period=2).resolve(6)
    assert cfg.exits(6) == [1, 2, 3, 4, 5, 6]
    assert active_exits(cfg, 6, 0, 100) == [1, 3, 5, 6]
    assert active_exits(cfg, 6, 1, 100) == [2, 4, 6]
    cfg = LayerSkipConfig(exit_layer=2, curriculum="gradual", gradual_fraction=0.5).resolve(6)
    assert active_exits(cfg, 6, 0, 100) == [6]  # the last layer always trains
    assert active_exits(cfg, 6, 10, 100) == [5, 6]
    assert active_exits(cfg, 6, 60, 100) == [1, 2, 3, 4, 5, 6]
    cfg = LayerSkipConfig(early_exit_layers=[3], early_exit_every=1).resolve(8)
    assert cfg.exit_layer == 2 and cfg.exits(8) == [2, 3, 8]  # E = L // 4, always an exit


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (dict(exit_layer=4), "exit_layer 4 must be in 1..3"),
        (dict(early_exit_layers=[0, 4]), "early_exit_layers"),
        (dict(dropout_scale="cubic"), "dropout_scale"),
        (dict(curriculum="random"), "curriculum"),
        (dict(layer_dropout=1.0), "layer_dropout"),
    ],
)
def test_bad_settings_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        LayerSkipConfig(**values).resolve(4)


def test_the_loss_without_dropout_is_the_models_own(tiny_target):
    """With layer dropout off, the last exit is the model's own forward; a sample that skips a
    layer gets what the model computes without it, and the others are untouched."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target.model.name_or_path)
    drafter = LayerSkipDrafter(LayerSkipConfig(exit_layer=1, layer_dropout=0.0), model)
    ids = torch.randint(3, 300, (3, 12))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    with torch.no_grad():
        states = drafter.exit_states(batch, [1, 2])
        logits = model.get_output_embeddings()(states[2])
        assert torch.allclose(logits, model(input_ids=ids).logits, atol=1e-5)
        drafter.config.layer_dropout = 0.5
        drafter.train()
        torch.manual_seed(0)
        draws = torch.rand(2, 3)
        torch.manual_seed(0)
        dropped = drafter.exit_states(batch, [2])[2]
        skipped = draws < torch.tensor(dropout_rates(2, 0.5, "exp"))[:, None]
        for row in range(3):
            layers = [i for i in range(2) if not skipped[i, row]]
            h = model.get_input_embeddings()(ids[row : row + 1])
            pos = torch.arange(12)[None]
            rotary = model.model.rotary_emb(h, pos)
            for i in layers:
                h = model.model.layers[i](h, position_ids=pos, position_embeddings=rotary)
            assert torch.allclose(dropped[row], model.model.norm(h)[0], atol=1e-5)


def test_train_then_decode_as_its_own_target(tiny_target_path, tmp_path, capsys):
    out = tmp_path / "run"
    code = main([
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=4", "micro_batch_size=4",
        "eval_every=2", "eval_batches=2", "save_every=2", "data.max_samples=20",
        "data.max_length=32", "warmup_steps=1", "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=12", "drafter.exit_layer=1", "drafter.layer_dropout=0.2",
    ])  # fmt: skip
    assert code == 0
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["matches_ar"] is True and served["drafted"] > 0
    quality = json.loads((out / "target_quality.json").read_text())
    assert quality["base_loss"] != quality["fine_tuned_loss"]
    # a plain HF folder, which transformers' own early-exit assisted generation runs exactly
    model = AutoModelForCausalLM.from_pretrained(out / "final")
    base = load_target(tiny_target_path)
    assert not torch.equal(model.lm_head.weight, base.model.lm_head.weight)  # it trained
    prompt = base.tokenizer("def main():\n    return", return_tensors="pt")
    plain = model.generate(**prompt, max_new_tokens=20, do_sample=False)
    early = model.generate(**prompt, max_new_tokens=20, do_sample=False, assistant_early_exit=1)
    assert torch.equal(plain, early)
    # its own target: loaded against the base it is refused, naming the fix
    with pytest.raises(CheckpointError, match="its own target"):
        load_drafter(out / "final", base)
    tuned = load_target(str(out / "final"))
    drafter = load_drafter(out / "final", tuned)
    assert drafter.hf_model is tuned.model and drafter.config.exit_layer == 1
    assert isinstance(tuned, Target)


def test_bad_input_to_the_entry_script(tiny_target_path, tmp_path, capsys):
    code = main([f"target={tiny_target_path}", "drafter.exit_layer=9", f"output_dir={tmp_path}/x"])
    assert code == 2
    assert "exit_layer 9" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_evaluate_measures_it_beside_transformers_early_exit(tiny_target_path, tmp_path):
    from specdraft.scripts.evaluate import main as evaluate

    out = tmp_path / "run"
    assert main([
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=2", "micro_batch_size=4",
        "eval_every=0", "save_every=0", "data.max_samples=20", "data.max_length=32",
        "eval_loop.enabled=false", "drafter.exit_layer=1",
    ]) == 0  # fmt: skip
    final = str(out / "final")
    code = evaluate([
        "--target", final, "--drafter", final, "--baselines", "ar,hf_early_exit",
        "--num-prompts", "2", "--max-new-tokens", "12", "--output", str(tmp_path / "eval"),
    ])  # fmt: skip
    assert code == 0
    rows = {
        r["method"]: r for r in json.loads((tmp_path / "eval" / "report.json").read_text())["runs"]
    }
    assert rows["layerskip"]["matches_ar"] is True and rows["layerskip"]["tau"] > 1
    assert rows["hf_early_exit"]["matches_ar"] is True
