"""Distillation: divergences against naive loops, the student, on-policy data, the entry script,
and the final checkpoint as transformers' assistant_model."""

from __future__ import annotations

import json
import math

import pytest
import torch
from testkit import assert_chunking_exact
from transformers import AutoModelForCausalLM

from specdraft.drafters.served import alpha_agreement
from specdraft.kinds.distill.distill import (
    DistillConfig,
    DistillDrafter,
    build_student,
    divergence,
)
from specdraft.targets.target import TargetOutput
from specdraft.train.entry import main as train_main


def _naive(p_logits: list[float], q_logits: list[float], kind: str, t: float, beta: float) -> float:
    """One position, one vocabulary entry at a time, straight from the definitions."""

    def softmax(xs):
        m = max(x / t for x in xs)
        e = [math.exp(x / t - m) for x in xs]
        return [v / sum(e) for v in e]

    p, q = softmax(p_logits), softmax(q_logits)
    kl = lambda a, b: sum(ai * math.log(ai / bi) for ai, bi in zip(a, b, strict=True) if ai > 0)  # noqa: E731
    if kind == "fkl":
        return kl(p, q)
    if kind == "rkl":
        return kl(q, p)
    if kind == "jsd":
        m = [beta * pi + (1 - beta) * qi for pi, qi in zip(p, q, strict=True)]
        return beta * kl(p, m) + (1 - beta) * kl(q, m)
    return 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q, strict=True))


@pytest.mark.parametrize("kind", ["fkl", "rkl", "jsd", "tvd"])
@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_divergence_equals_the_naive_loop(kind, temperature):
    g = torch.Generator().manual_seed(0)
    p_logits = torch.randn(5, 11, generator=g, dtype=torch.float64) * 3
    q_logits = torch.randn(5, 11, generator=g, dtype=torch.float64) * 3
    for beta in (0.1, 0.5, 0.9) if kind == "jsd" else (0.5,):
        got = divergence(p_logits, q_logits, kind, temperature, beta)
        want = [
            _naive(p.tolist(), q.tolist(), kind, temperature, beta)
            for p, q in zip(p_logits, q_logits, strict=True)
        ]
        assert got.tolist() == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert (divergence(p_logits, p_logits, kind, temperature, beta).abs() < 1e-6).all()


def test_alpha_is_one_minus_total_variation():
    g = torch.Generator().manual_seed(1)
    p, q = torch.randn(7, 13, generator=g), torch.randn(7, 13, generator=g)
    assert alpha_agreement(p, q)[0] == pytest.approx(1 - divergence(p, q, "tvd"), abs=1e-6)
    assert alpha_agreement(p, p)[0] == pytest.approx(torch.ones(7), abs=1e-6)


def test_loss_counts_only_loss_tokens_and_adds_cross_entropy(tiny_target):
    torch.manual_seed(0)
    cfg = DistillConfig(init="random", divergence="rkl", ce_weight=0.5)
    drafter = DistillDrafter.build(cfg, tiny_target)
    ids = torch.randint(0, tiny_target.vocab_size, (2, 10))
    mask = torch.zeros_like(ids)
    mask[:, 6:] = 1  # tokens 6..9 are targets: predicted at positions 5..8
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    t_logits = tiny_target(ids).logits
    loss, metrics = drafter(batch, TargetOutput(logits=t_logits))

    s_logits = drafter.hf_model(ids).logits
    per_pos = [
        _naive(t_logits[b, i].tolist(), s_logits[b, i].tolist(), "rkl", 1.0, 0.5)
        + 0.5 * -torch.log_softmax(s_logits[b, i], -1)[ids[b, i + 1]].item()
        for b in range(2)
        for i in range(5, 9)
    ]
    assert loss.item() == pytest.approx(sum(per_pos), rel=1e-5)
    assert drafter.loss_tokens(batch).item() == len(per_pos)
    # changing the target outside the loss positions changes nothing
    t_other = t_logits.clone()
    t_other[:, :5] = torch.randn_like(t_other[:, :5])
    assert drafter(batch, TargetOutput(logits=t_other))[0].item() == pytest.approx(loss.item())
    assert set(metrics) == {"loss_rkl", "loss_ce", "top1_agreement"}


@pytest.mark.parametrize("divergence", ["fkl", "jsd", "tvd", "none"])
def test_the_chunked_loss_and_its_gradients_equal_the_naive_ones(
    one_thread, tiny_target, divergence
):
    """The divergence and cross-entropy computed a chunk of positions at a time, the target's
    logits made from its final states: the loss and gradients (the student's weights, the
    target's states) of the loss on whole logits, at temperature 2 with a masked prompt."""
    torch.manual_seed(0)
    cfg = DistillConfig(init="random", divergence=divergence, ce_weight=0.5, temperature=2.0)
    drafter = DistillDrafter.build(cfg, tiny_target)
    assert drafter.capture_layers == [tiny_target.num_layers] and not drafter.reads_target_logits
    ids = torch.randint(0, tiny_target.vocab_size, (2, 9))
    mask = torch.zeros_like(ids)
    mask[0, 3:], mask[1, 5:] = 1, 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    L = tiny_target.num_layers
    out = tiny_target(ids, capture_layers=[L])
    h = out.hidden_states[L].clone().requires_grad_()
    drafter.loss_chunk_tokens = 0
    on_logits = drafter(batch, TargetOutput(logits=out.logits))[0]  # as the target gave them
    chunked_out = TargetOutput(logits=out.logits[:, -1:], hidden_states={L: h})  # the trainer's
    assert_chunking_exact(drafter, lambda: drafter(batch, chunked_out)[0], [h])
    drafter.loss_chunk_tokens = 3
    torch.testing.assert_close(drafter(batch, chunked_out)[0], on_logits, rtol=1e-5, atol=0)


def test_student_presets(tiny_target):
    copied = build_student(DistillConfig(init="target", num_layers=1, init_layers=[1]), tiny_target)
    assert copied.config.num_hidden_layers == 1
    assert torch.equal(
        copied.model.embed_tokens.weight, tiny_target.model.model.embed_tokens.weight
    )
    theirs = tiny_target.layers[1].state_dict()
    for name, mine in copied.model.layers[0].state_dict().items():
        assert torch.equal(mine, theirs[name]), name
    narrow = build_student(DistillConfig(init="random", hidden_size=32, num_layers=1), tiny_target)
    assert narrow.config.hidden_size == 32
    assert narrow.get_output_embeddings().weight.shape[0] == tiny_target.vocab_size
    with pytest.raises(ValueError, match="hidden size 64"):
        build_student(DistillConfig(init="target", hidden_size=32), tiny_target)


def test_on_policy_batch_trains_on_the_students_own_samples(tiny_target):
    torch.manual_seed(0)
    drafter = DistillDrafter.build(
        DistillConfig(on_policy_ratio=1.0, on_policy_tokens=5), tiny_target
    )
    ids = torch.randint(0, tiny_target.vocab_size, (3, 12))
    mask = torch.ones_like(ids)
    mask[:, :4] = 0
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": mask}
    new = drafter.prepare_batch(batch, tiny_target, torch.Generator().manual_seed(7))
    again = drafter.prepare_batch(batch, tiny_target, torch.Generator().manual_seed(7))
    assert torch.equal(new["input_ids"], again["input_ids"])  # a pure function of the generator
    assert new["input_ids"].shape == (3, 4 + 5)
    assert torch.equal(new["input_ids"][:, :4], ids[:, :4])  # the prompt is the data's prefix
    assert new["loss_mask"].tolist() == [[0] * 4 + [1] * 5] * 3
    off = DistillDrafter(drafter.hf_model, DistillConfig(on_policy_ratio=0.0))
    assert off.prepare_batch(batch, tiny_target, torch.Generator()) is batch


def test_every_process_makes_the_same_on_policy_decision(tiny_target):
    """Processes draw their continuations with their own generators but decide whether to
    generate from the shared one, so all of them run the student's generation or none does
    (under ZeRO-3 a process that generated alone would wait forever for the others)."""
    torch.manual_seed(0)
    drafter = DistillDrafter.build(
        DistillConfig(on_policy_ratio=0.5, on_policy_tokens=2), tiny_target
    )
    ids = torch.randint(0, tiny_target.vocab_size, (2, 8))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    decisions = set()
    for step in range(40):
        per_rank = [
            drafter.prepare_batch(
                batch, tiny_target, torch.Generator().manual_seed(1000 * rank + step),
                torch.Generator().manual_seed(step),
            ) is not batch
            for rank in range(3)
        ]  # fmt: skip
        assert len(set(per_rank)) == 1, step
        decisions.add(per_rank[0])
    assert decisions == {True, False}


def test_final_checkpoint_is_an_assistant_model_for_transformers(
    tiny_target, tiny_target_path, tmp_path
):
    out = tmp_path / "run"
    code = train_main("distill", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=4", "micro_batch_size=4",
        "eval_every=2", "eval_batches=2", "save_every=0", "data.max_samples=20",
        "data.max_length=32", "warmup_steps=1", "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=12",
    ])  # fmt: skip
    assert code == 0
    # The run ends by serving its draft in our loop: exact output, drafts made and accepted.
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["matches_ar"] is True and served["num_prompts"] == 2
    assert served["drafted"] > 0 and served["accepted"] > 0 and served["tau"] > 1
    assert served["decode"]["gamma"] == 5 and served["simulated_tau"] > 1
    draft = AutoModelForCausalLM.from_pretrained(out / "final")
    tok = tiny_target.tokenizer
    prompt = tok("def main():\n    return", return_tensors="pt")
    plain = tiny_target.model.generate(**prompt, max_new_tokens=24, do_sample=False)
    assisted = tiny_target.model.generate(
        **prompt, max_new_tokens=24, do_sample=False, assistant_model=draft
    )
    assert torch.equal(plain, assisted)
    assert plain.shape[1] > prompt["input_ids"].shape[1]


def test_entry_script_rejects_bad_input_with_a_clear_message(tiny_target_path, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_main("distill", [f"target={tiny_target_path}", "lerning_rate=1e-3"])
    assert exit_.value.code == 2
    assert "lerning_rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_main("distill", ["max_steps=many"])
    assert "max_steps" in capsys.readouterr().err

    other = AutoModelForCausalLM.from_pretrained(tiny_target_path)
    other.resize_token_embeddings(100)
    other.save_pretrained(tmp_path / "other_vocab")
    code = train_main("distill", [
        f"target={tiny_target_path}", "drafter.init=path",
        f"drafter.student_path={tmp_path / 'other_vocab'}", f"output_dir={tmp_path / 'x'}",
    ])  # fmt: skip
    assert code == 2
    assert "vocabulary of 100" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()

    code = train_main("distill", [
        f"target={tiny_target_path}", f"data.path={tmp_path / 'missing.jsonl'}",
        f"output_dir={tmp_path / 'y'}",
    ])  # fmt: skip
    assert code == 2
    assert "missing.jsonl" in capsys.readouterr().err


def test_a_copy_of_the_target_agrees_everywhere_greedy_and_samples_alike(tiny_target):
    """The simulated acceptance of a student identical to the target: its argmax is always the
    target's (greedy agreement 1) and sum min(p, q) = 1 (sampled), at every depth."""
    from specdraft.core import DecodeConfig, TargetOutput

    copy = DistillDrafter.build(
        DistillConfig(init="target", num_layers=tiny_target.num_layers), tiny_target
    ).eval()
    ids = torch.randint(3, tiny_target.vocab_size, (2, 16))
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones_like(ids),
        "loss_mask": torch.ones_like(ids),
    }
    with torch.no_grad():
        out = TargetOutput(logits=tiny_target.forward(ids).logits)
        alpha, greedy, count = copy.acceptance(batch, out, DecodeConfig(gamma=3))
    assert count.tolist() == [30.0] * 3 and greedy.tolist() == count.tolist()
    assert torch.allclose(alpha, count, rtol=1e-5)
    other = DistillDrafter.build(DistillConfig(init="random", num_layers=1), tiny_target).eval()
    with torch.no_grad():
        _, greedy_other, _ = other.acceptance(batch, out, DecodeConfig(gamma=3))
    assert (greedy_other < count).all()
