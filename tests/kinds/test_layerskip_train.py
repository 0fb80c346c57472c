"""LayerSkip training: layer dropout, the early-exit loss and its curricula, the entry script,
and the checkpoint as a plain HF model that is its own target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from testkit import assert_chunking_exact
from transformers import AutoModelForCausalLM

from specdraft.config import load_config
from specdraft.formats.checkpoint import CheckpointError
from specdraft.formats.reading import load_drafter
from specdraft.kinds.layerskip.layerskip import (
    LayerSkipConfig,
    LayerSkipDrafter,
    active_exits,
    dropout_rates,
    exit_weights,
)
from specdraft.kinds.layerskip.layerskip_trainer import LayerSkipTrainConfig
from specdraft.targets.target import Target, load_target
from specdraft.train import after_training
from specdraft.train.entry import main as train_main

ROOT = Path(__file__).resolve().parents[2]


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
        (dict(exit_distill=1.5), r"exit_distill must be in \[0, 1\]"),
    ],
)
def test_bad_settings_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        LayerSkipConfig(**values).resolve(4)


@pytest.mark.parametrize(
    "recipe", sorted((ROOT / "configs" / "layerskip").glob("*.yaml")), ids=lambda p: p.name
)
def test_recipes_load(recipe):
    cfg = load_config(LayerSkipTrainConfig, recipe)
    assert cfg.drafter.exit_layer >= 1
    assert {"exit_layer", "gamma"} <= set(cfg.eval_loop.tune)  # chosen where it will run
    if "8b" in recipe.name:
        assert cfg.drafter.resolve(32).exits(32)[-1] == 32


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


def test_train_then_decode_as_its_own_target(tiny_target_path, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    decoded = []  # the targets whose greedy looping the run measured, in order

    def looping(target, prompts, max_new_tokens):
        decoded.append(target.name)
        return 0.25 if len(decoded) == 1 else 0.75

    # the loop test needs 72 tokens; this run decodes 12, so the test stands in for it
    monkeypatch.setattr("specdraft.train.fine_tuned.LOOP_TOKENS", 1)
    monkeypatch.setattr("specdraft.train.fine_tuned.greedy_looping", looping)
    searches = []  # the passes the tuning search was given (eval_loop.tune_passes)
    search = after_training.search_decode
    monkeypatch.setattr(
        after_training,
        "search_decode",
        lambda *a, **k: searches.append(k["passes"]) or search(*a, **k),
    )
    code = train_main("layerskip", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=4", "micro_batch_size=4",
        "eval_every=2", "eval_batches=2", "save_every=2", "data.max_samples=20",
        "data.max_length=32", "warmup_steps=1", "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=12", "drafter.exit_layer=1", "drafter.layer_dropout=0.2",
        "eval_loop.tune=[exit_layer,gamma]", "eval_loop.tune_passes=3", "decode.gamma=3",
    ])  # fmt: skip
    assert code == 0 and searches == [3]
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["matches_ar"] is True and served["drafted"] > 0
    # gamma chosen by measured tokens/s before the measurement (one exit: nothing to choose)
    rounds = {r["round"] for r in served["tuning"]}
    assert rounds == {"gamma"} and served["decode"]["exit_layer"] == 1
    kept = [r for r in served["tuning"] if r["kept"]][-1]  # gamma's last round
    assert served["decode"]["gamma"] == kept["gamma"] == load_drafter_decode(out)["gamma"]
    quality = json.loads((out / "target_quality.json").read_text())
    assert quality["base_loss"] != quality["fine_tuned_loss"]
    # each candidate exit's agreement with the final layer, before and after training
    agreement = quality["exit_agreement"]
    assert agreement["before"].keys() == agreement["after"].keys() == {"1"}
    assert 0 < agreement["after"]["1"]["agreement"] <= 1 and agreement["after"]["1"]["alpha"] > 0
    err = capsys.readouterr().err
    assert "exit  1: agreement" in err
    # what fine-tuning did to greedy continuations of the measured prompts: the base as a user
    # loads it first, then the fine-tuned folder
    assert [str(name) for name in decoded] == [tiny_target_path, str(out / "final")]
    looping = quality["greedy_looping"]
    assert looping == {"base": 0.25, "fine_tuned": 0.75, "prompts": 2, "max_new_tokens": 12}
    assert "greedy continuations that loop: 25% (base) -> 75% (fine-tuned)" in err
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


def load_drafter_decode(run) -> dict:
    return json.loads((run / "final" / "config.json").read_text())["specdraft"]["decode"]


def test_bad_input_to_the_entry_script(tiny_target_path, tmp_path, capsys):
    code = train_main(
        "layerskip",
        [f"target={tiny_target_path}", "drafter.exit_layer=9", f"output_dir={tmp_path}/x"],
    )
    assert code == 2
    assert "exit_layer 9" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_evaluate_measures_it_beside_transformers_early_exit(
    tiny_target_path, tmp_path, monkeypatch
):
    from specdraft.tools.evaluate import main as evaluate

    out = tmp_path / "run"
    assert train_main("layerskip", [
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
    # beside the base target, as every other kind runs: it decodes with its own model, against
    # that model's plain decoding, and the base's plain decoding stays the speed reference
    code = evaluate([
        "--target", tiny_target_path, "--drafter", final, "--baselines", "ar,hf_early_exit",
        "--num-prompts", "2", "--max-new-tokens", "12", "--output", str(tmp_path / "beside"),
    ])  # fmt: skip
    assert code == 0
    runs = json.loads((tmp_path / "beside" / "report.json").read_text())["runs"]
    names = [r["name"] for r in runs]
    assert names[0] == "ar" and names[1].startswith("ar[adapter ")
    assert runs[2]["method"] == "layerskip" and runs[2]["matches_ar"] is True
    # transformers' early exit too is checked against the fine-tuned model's own output
    assert runs[3]["method"] == "hf_early_exit" and runs[3]["matches_ar"] is True

    # two settings of the folder share one load of its model, and transformers' early exit of
    # each decodes with its own gamma, leaving the shared model's generation config as it was
    from transformers.generation.utils import GenerationMixin

    import specdraft.formats.reading as reading

    # (each evaluate run keeps its own loads: nothing is left over from the runs above)
    loads, gammas = [], []
    real, generate = reading.load_target, GenerationMixin.generate
    monkeypatch.setattr(reading, "load_target", lambda *a, **k: loads.append(a) or real(*a, **k))

    def spy(model, *args, **kwargs):
        if kwargs.get("assistant_early_exit"):
            gammas.append(model.generation_config.num_assistant_tokens)
        return generate(model, *args, **kwargs)

    monkeypatch.setattr(GenerationMixin, "generate", spy)
    code = evaluate([
        "--target", tiny_target_path, "--drafter", final, "--drafter", f"{final}:gamma=2",
        "--baselines", "ar,hf_early_exit", "--num-prompts", "2", "--max-new-tokens", "12",
        "--output", str(tmp_path / "two"),
    ])  # fmt: skip
    assert code == 0
    assert [a for a in loads if str(a[0]) == final] == [(final,)]
    runs = json.loads((tmp_path / "two" / "report.json").read_text())["runs"]
    early = [r for r in runs if r["method"] == "hf_early_exit"]
    assert len(early) == 2 and all(r["matches_ar"] for r in early)
    assert set(gammas) == {4, 2}  # the folder's own gamma (the demo config's 4), then 2


@pytest.mark.parametrize("distill", [0.0, 0.6])
def test_the_loss_equals_a_per_sample_reference_loop(tiny_target, distill):
    """The batched loss, layer dropout and padding included, equals a naive loop: each sample
    alone through the layers it does not skip, the final norm and LM head after each exit, the
    cross-entropy over all loss tokens of the batch per exit, weighted by the exit's scale; with
    exit_distill, the early exit's mixes in the cross-entropy against the final layer's
    distribution at the same position."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target.model.name_or_path)
    cfg = LayerSkipConfig(
        exit_layer=1, layer_dropout=0.5, early_exit_scale="sum_l", e_scale=0.7,
        exit_distill=distill,
    )  # fmt: skip
    drafter = LayerSkipDrafter(cfg, model).train()
    lengths = [12, 9, 12, 7]
    ids = torch.zeros(4, 12, dtype=torch.long)
    attention = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(3, 300, (n,), generator=torch.Generator().manual_seed(row))
        attention[row, :n] = 1
    loss_mask = attention.clone()
    loss_mask[:, :4] = 0  # a prompt without loss
    skip = torch.tensor([[True, False, False, True], [False, True, False, True]])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    loss, metrics = drafter.loss({**batch, "layer_skip": skip})

    norm, head = model.model.norm, model.get_output_embeddings()
    per_exit = {1: [], 2: []}  # (nll, ) of every loss token, per exit
    soft = []  # exit 1's cross-entropy against exit 2's distribution, per loss token
    with torch.no_grad():
        for row, n in enumerate(lengths):
            h = model.get_input_embeddings()(ids[row : row + 1, :n])
            pos = torch.arange(n)[None]
            rotary = model.model.rotary_emb(h, pos)
            scored = loss_mask[row, 1:n].bool()
            exit_logits = []
            for layer in range(2):
                if not skip[layer, row]:
                    h = model.model.layers[layer](h, position_ids=pos, position_embeddings=rotary)
                logits = head(norm(h))[0, :-1].float()
                nll = F.cross_entropy(logits, ids[row, 1:n], reduction="none")
                per_exit[layer + 1].append(nll[scored])
                exit_logits.append(logits[scored])
            for early, final in zip(*exit_logits, strict=True):
                soft.append(-(final.softmax(-1) * early.log_softmax(-1)).sum())
    ce = {e: torch.cat(v).sum() for e, v in per_exit.items()}  # the loss is a sum over tokens
    weights = exit_weights([1, 2], 2, "sum_l", 0.7)
    early = (1 - distill) * ce[1] + distill * torch.stack(soft).sum()
    expected = weights[1] * early + weights[2] * ce[2]
    assert torch.allclose(loss.detach(), expected, rtol=1e-5)
    n = sum(len(v) for v in per_exit[1])
    assert drafter.loss_tokens(batch).item() == n
    assert torch.allclose(metrics["loss_exit1"][0], ce[1], rtol=1e-5)
    assert metrics["loss_exit1"][1].item() == n
    # a layer no sample runs still takes part in the graph (zero gradient), as DDP needs
    skip_all = torch.tensor([[True] * 4, [False] * 4])
    drafter.zero_grad()
    drafter.loss({**batch, "layer_skip": skip_all})[0].backward()
    q = model.model.layers[0].self_attn.q_proj.weight.grad
    assert q is not None and torch.count_nonzero(q) == 0


@pytest.mark.parametrize("distill", [0.0, 0.6])
def test_the_chunked_loss_and_its_gradients_equal_the_naive_ones(one_thread, tiny_target, distill):
    """Every exit's cross-entropy (and the self-distillation to the final exit) computed a chunk
    of positions at a time: the same loss and gradients for every weight, the shared LM head
    included, with padding, a prompt without loss and layer dropout."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target.model.name_or_path)
    cfg = LayerSkipConfig(exit_layer=1, layer_dropout=0.5, exit_distill=distill)
    drafter = LayerSkipDrafter(cfg, model).train()
    ids = torch.randint(3, 300, (2, 9), generator=torch.Generator().manual_seed(5))
    attention = torch.ones_like(ids)
    attention[1, 6:] = 0
    loss_mask = attention.clone()
    loss_mask[:, :3] = 0
    skip = torch.tensor([[False, True], [False, False]])
    batch = {"input_ids": ids, "attention_mask": attention, "loss_mask": loss_mask}
    assert_chunking_exact(drafter, lambda: drafter.loss({**batch, "layer_skip": skip})[0])


def test_self_distilled_exits_leave_the_final_layers_gradient_alone(tiny_target):
    """The final layer's distribution is a target, not a path for gradients: with exit_distill,
    the last layer (which only the final exit reads) gets the gradient of the final exit's
    label loss alone, as without it, while the first layer's changes."""
    ids = torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(3))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }

    def grads(distill):
        model = AutoModelForCausalLM.from_pretrained(tiny_target.model.name_or_path)
        cfg = LayerSkipConfig(exit_layer=1, layer_dropout=0.0, exit_distill=distill)
        drafter = LayerSkipDrafter(cfg, model).train()
        drafter.loss(batch)[0].backward()
        return [p.grad.clone() for p in model.model.layers[1].parameters()], [
            p.grad.clone() for p in model.model.layers[0].parameters()
        ]

    (last0, first0), (last1, first1) = grads(0.0), grads(1.0)
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(last0, last1, strict=True))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(first0, first1, strict=True))


def test_a_resumed_run_with_layer_dropout_equals_an_uninterrupted_one(tiny_target_path, tmp_path):
    import shutil

    from safetensors.torch import load_file

    common = [
        f"target={tiny_target_path}", "max_steps=4", "micro_batch_size=4", "eval_every=0",
        "save_every=2", "data.max_samples=40", "data.max_length=32", "warmup_steps=1",
        "drafter.exit_layer=1", "drafter.layer_dropout=0.5", "drafter.dropout_scale=uniform",
        "drafter.curriculum=rotational", "eval_loop.enabled=false",
    ]  # fmt: skip
    assert train_main("layerskip", [*common, f"output_dir={tmp_path / 'straight'}"]) == 0
    (tmp_path / "resumed").mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", tmp_path / "resumed" / "checkpoint-2")
    assert (
        train_main(
            "layerskip", [*common, f"output_dir={tmp_path / 'resumed'}", "resume_from=latest"]
        )
        == 0
    )
    a, b = (
        load_file(tmp_path / d / "final" / "model.safetensors") for d in ("straight", "resumed")
    )
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the dropout changed the run: without it the weights end elsewhere
    assert (
        train_main(
            "layerskip", [*common, "drafter.layer_dropout=0", f"output_dir={tmp_path / 'none'}"]
        )
        == 0
    )
    c = load_file(tmp_path / "none" / "final" / "model.safetensors")
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_lora_trains_adapters_and_saves_a_merged_model(tiny_target_path, tmp_path):
    out = tmp_path / "lora"
    code = train_main("layerskip", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=3", "micro_batch_size=4",
        "eval_every=0", "save_every=0", "data.max_samples=20", "data.max_length=32",
        "warmup_steps=1", "lr=1e-2", "drafter.exit_layer=1", "drafter.lora.rank=4",
        "drafter.lora.dropout=0", "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12",
    ])  # fmt: skip
    assert code == 0
    final = out / "final"
    assert (final / "adapter" / "adapter_config.json").is_file()
    # the saved model is the base with the adapter merged: plain HF, no peft keys
    from safetensors.torch import load_file

    weights = load_file(final / "model.safetensors")
    assert not any("lora" in k for k in weights)
    base = load_target(tiny_target_path)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(weights[q], base.model.state_dict()[q])  # the adapter is in it
    assert torch.equal(weights["model.embed_tokens.weight"], base.model.model.embed_tokens.weight)
    tuned = load_target(str(final))
    merged = load_target(tiny_target_path, adapter=final / "adapter")
    assert torch.allclose(tuned.model.state_dict()[q], merged.model.state_dict()[q], atol=1e-6)
    assert json.loads((out / "eval_loop.json").read_text())["matches_ar"] is True
    # the checkpoint reader builds its nested lora settings as their dataclass
    assert load_drafter(final, tuned).config.lora.rank == 4


def test_lora_modules_that_match_nothing_are_named(tiny_target_path, tmp_path, capsys):
    code = train_main("layerskip", [
        f"target={tiny_target_path}", f"output_dir={tmp_path / 'x'}", "drafter.exit_layer=1",
        "drafter.lora.rank=4", "drafter.lora.target_modules=[query_key_value]",
    ])  # fmt: skip
    assert code == 2
    err = capsys.readouterr().err
    assert "query_key_value" in err and "match no layer" in err and "q_proj" in err
    assert not (tmp_path / "x").exists()
