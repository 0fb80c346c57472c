from __future__ import annotations

import hashlib
import json
import platform
from dataclasses import asdict

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from specdraft.data.stdlib_corpus import demo_corpus_files, demo_prompts
from specdraft.targets import demo_target as bdt


def test_tiny_build_is_a_standard_hf_folder(tiny_target_path):
    tok = AutoTokenizer.from_pretrained(tiny_target_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_path)
    info = json.loads((bdt.Path(tiny_target_path) / bdt.COMPLETE_MARKER).read_text())
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert model.config.vocab_size == len(tok)
    eos = model.generation_config.eos_token_id
    assert tok.eos_token_id in eos and tok.convert_tokens_to_ids("<|end|>") in eos
    assert (
        tok.apply_chat_template(
            [{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True
        )
        == "<|bos|><|user|>\nx<|end|>\n<|assistant|>\n"
    )


def test_second_call_reuses_the_cache(tiny_target_path, monkeypatch):
    def fail(*_a, **_k):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(bdt, "build", fail)
    assert str(bdt.ensure_demo_target(variant="tiny")) == tiny_target_path


def test_same_seed_rebuilds_bit_identical_weights(tmp_path, tiny_target_path):
    spec = bdt.resolve_spec("tiny")
    bdt.build(spec, tmp_path)
    a = load_file(tmp_path / "model.safetensors")
    b = load_file(bdt.Path(tiny_target_path) / "model.safetensors")
    assert a.keys() == b.keys()
    assert all(a[k].equal(b[k]) for k in a)


def test_another_seed_is_another_folder_and_other_weights(tmp_path):
    s0, s1 = bdt.resolve_spec("tiny", seed=0), bdt.resolve_spec("tiny", seed=1)
    assert bdt.demo_target_dir(s0, "tiny") != bdt.demo_target_dir(s1, "tiny")
    bdt.build(s1, tmp_path)
    other = load_file(tmp_path / "model.safetensors")
    ref = bdt.ensure_demo_target(variant="tiny")
    assert not all(other[k].equal(v) for k, v in load_file(ref / "model.safetensors").items())


def test_interrupted_build_leaves_no_folder(monkeypatch, specdraft_home):
    def boom(spec, out):
        (out / "partial").write_text("half")
        raise KeyboardInterrupt

    monkeypatch.setattr(bdt, "build", boom)
    with pytest.raises(KeyboardInterrupt):
        bdt.ensure_demo_target(variant="tiny", seed=7)
    target_dir = bdt.demo_target_dir(bdt.resolve_spec("tiny", seed=7), "tiny")
    assert not target_dir.exists()
    assert not list(target_dir.parent.glob(f".{target_dir.name}-*"))


def test_leftover_of_a_killed_build_is_cleared_by_the_next(monkeypatch, specdraft_home):
    spec = bdt.resolve_spec("tiny", seed=8)
    target_dir = bdt.demo_target_dir(spec, "tiny")
    leftover = target_dir.parent / f".{target_dir.name}-killed"
    leftover.mkdir(parents=True)
    monkeypatch.setattr(
        bdt, "build", lambda spec, out: (out / bdt.COMPLETE_MARKER).write_text("{}")
    )
    assert bdt.ensure_demo_target(variant="tiny", seed=8) == target_dir
    assert not leftover.exists()


def test_bad_variant_and_budget_are_named():
    with pytest.raises(ValueError, match="unknown demo variant 'huge'"):
        bdt.resolve_spec("huge")
    with pytest.raises(ValueError, match="unknown build budget 'forever'"):
        bdt.resolve_spec("tiny", budget="forever")


def test_heldout_files_are_disjoint_from_training_and_prompts_come_from_them():
    train = set(demo_corpus_files("train"))
    heldout = set(demo_corpus_files("heldout"))
    assert heldout and train and not train & heldout
    prompts = demo_prompts(10)
    assert len(prompts) == 10 and len(set(prompts)) == 10
    assert prompts == demo_prompts(10)
    heldout_text = "".join(p.read_text(errors="replace") for p in heldout)
    assert all(p.rstrip().endswith(":") and p in heldout_text for p in prompts)


def test_loop_detector():
    assert bdt.loops([1, 2, 3] * 40)
    assert not bdt.loops(list(range(120)))


def test_muon_takes_the_layer_matrices_and_adamw_the_rest():
    """The default build's optimizers: every parameter in exactly one, Muon only for 2-D
    decoder-layer weights (Muon orthogonalizes matrices; embeddings and norms stay AdamW)."""
    from dataclasses import replace

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from specdraft.targets.demo_target import _optimizers, resolve_spec

    spec = replace(resolve_spec("tiny", overrides={"precision": "fp32"}), optimizer="muon")
    config = LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, tie_word_embeddings=True)  # fmt: skip
    model = LlamaForCausalLM(config)
    muon, adamw = _optimizers(model, spec)
    assert type(muon).__name__ == "Muon" and type(adamw).__name__ == "AdamW"
    assert muon.ns_dtype == torch.float32  # this spec resolved to fp32...
    bf16 = _optimizers(model, replace(spec, precision="bf16"))[0]
    assert bf16.ns_dtype == torch.bfloat16  # ...and a bf16 build orthogonalizes as torch does
    held = [id(p) for opt in (muon, adamw) for g in opt.param_groups for p in g["params"]]
    assert sorted(held) == sorted(id(p) for p in model.parameters())  # each once
    assert all(p.dim() == 2 for g in muon.param_groups for p in g["params"])
    embed = model.get_input_embeddings().weight
    assert all(p is not embed for g in muon.param_groups for p in g["params"])
    with pytest.raises(ValueError, match="optimizer 'sgd'"):
        resolve_spec("tiny", overrides={"optimizer": "sgd"})


def test_our_muon_is_torchs_in_bf16_and_close_in_fp32():
    """The build's Muon with bf16 Newton-Schulz makes torch.optim.Muon's updates bit for bit (so
    bf16 builds are what they were); in fp32 (CPUs without native bf16) it is the same update up
    to bf16 rounding."""
    import torch

    from specdraft.targets.demo_target import Muon

    torch.manual_seed(0)
    start = [torch.randn(24, 40), torch.randn(40, 16)]  # wide and tall: both orientations

    def run(make) -> list[torch.Tensor]:
        params = [torch.nn.Parameter(w.clone()) for w in start]
        opt = make(params)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.sin(p.detach() * (step + 2) + i)
            opt.step()
        return [p.detach() for p in params]

    theirs = run(lambda ps: torch.optim.Muon(
        ps, lr=3e-3, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"))  # fmt: skip
    ours_bf16 = run(lambda ps: Muon(ps, lr=3e-3, weight_decay=0.1, ns_dtype=torch.bfloat16))
    ours_fp32 = run(lambda ps: Muon(ps, lr=3e-3, weight_decay=0.1, ns_dtype=torch.float32))
    assert all(torch.equal(a, b) for a, b in zip(theirs, ours_bf16, strict=True))
    moved = [(a - w).abs().max().item() for a, w in zip(theirs, start, strict=True)]
    assert all(m > 1e-3 for m in moved)  # the steps did move the weights
    for a, b, m in zip(theirs, ours_fp32, moved, strict=True):
        assert not torch.equal(a, b) and (a - b).abs().max().item() < 0.05 * m


def test_repetition_rows_repeat_a_span_that_follows_a_block_prefix():
    import torch

    blocks = torch.arange(10 * 65).view(10, 65)  # every token distinct: positions are legible
    rows, starts, spans = bdt.repetition_rows(blocks, 16, torch.Generator().manual_seed(0))
    assert rows.shape == (16, 65) and len(set(spans.tolist())) > 1 and len(set(starts.tolist())) > 1
    assert spans.min() >= 2 and spans.max() <= bdt.MAX_REPEATED_SPAN and starts.max() <= 32
    for row, start, span in zip(rows.tolist(), starts.tolist(), spans.tolist(), strict=True):
        block = blocks[row[0] // 65].tolist() if start else None
        if block is not None:
            assert row[:start] == block[:start]
        first = row[start : start + span]
        assert first[0] % 65 == start  # the span is what follows the prefix in its block
        assert first == list(range(first[0], first[0] + span))  # a contiguous span of a block
        assert all(row[t] == row[t - span] for t in range(start + span, 65))


def test_repetition_penalty_equals_a_per_token_reference():
    """DITTO's loss against a plain loop: at each token of a repetition after the first copy,
    -log(1 - |p - decay * q|) with p its probability and q its copy's one repetition earlier."""
    import torch

    gen = torch.Generator().manual_seed(3)
    blocks = torch.randint(0, 11, (5, 40), generator=gen)
    rows, starts, spans = bdt.repetition_rows(blocks, 6, gen)
    logits = torch.randn(6, 39, 11, generator=gen, requires_grad=True)
    total, count = bdt.repetition_penalty(logits, rows, starts, spans, 0.5)
    want, n = 0.0, 0
    for r in range(6):
        s, span = starts[r].item(), spans[r].item()
        for t in range(s + span, 40):
            if t - span < 1:
                continue
            p = torch.softmax(logits[r, t - 1], -1)[rows[r, t]]
            q = torch.softmax(logits[r, t - span - 1], -1)[rows[r, t - span]].item()
            want = want - torch.log(1 - (p - 0.5 * q).abs())
            n += 1
    assert count == n > 0
    torch.testing.assert_close(total, want)
    grad = torch.autograd.grad(total, logits)[0]
    torch.testing.assert_close(grad, torch.autograd.grad(want, logits)[0])  # q held fixed


def test_the_repetition_phase_is_deterministic_and_its_penalty_moves_the_weights(tmp_path):
    """Two builds with the phase are bit-identical; the penalty itself changes the result (not
    only the phase's likelihood steps): another decay gives other weights, in a Muon build."""
    specs = {
        name: bdt.resolve_spec(
            "tiny", overrides={"repeat_steps": 3, "optimizer": "muon", "repeat_decay": decay}
        )
        for name, decay in (("a", 0.5), ("b", 0.5), ("c", 0.9))
    }
    for name, spec in specs.items():
        bdt.build(spec, tmp_path / name)
    a, b, c = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert all(a[k].equal(b[k]) for k in a)
    assert not all(a[k].equal(c[k]) for k in a)
    assert bdt.demo_target_dir(specs["a"], "tiny") != bdt.demo_target_dir(specs["c"], "tiny")


def test_in_place_repetition_rows_cost_no_extra_steps_and_their_penalty_counts(
    tmp_path, monkeypatch
):
    """repeat_rows > 0 puts the pseudo-repetitive rows into the last likelihood steps: the build
    runs `steps` forwards of batch_size rows, is deterministic, and the penalty changes it."""
    forwards = []
    real_forward = bdt.LlamaForCausalLM.forward

    def counted(self, input_ids=None, **kwargs):
        if torch.is_grad_enabled():  # a training step's forward, not the held-out loss's
            forwards.append(len(input_ids))
        return real_forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(bdt.LlamaForCausalLM, "forward", counted)
    specs = {
        name: bdt.resolve_spec(
            "tiny",
            overrides={"repeat_steps": 3, "repeat_rows": 2, "optimizer": "muon", "repeat_decay": d},
        )
        for name, d in (("a", 0.5), ("b", 0.5), ("c", 0.9))
    }
    infos = {}
    for name, spec in specs.items():
        forwards.clear()
        infos[name] = bdt.build(spec, tmp_path / name)
        assert forwards == [spec.batch_size] * spec.steps  # no step after the schedule
    a, b, c = (load_file(tmp_path / x / "model.safetensors") for x in "abc")
    assert all(a[k].equal(b[k]) for k in a)
    assert not all(a[k].equal(c[k]) for k in a)
    spec = specs["a"]
    assert infos["a"]["train_tokens_seen"] == spec.steps * spec.batch_size * spec.seq_len
    assert infos["a"]["repetition_rows_seen"] == 3 * 2


def test_settings_added_later_keep_the_cache_folder_of_builds_made_before_them():
    """A setting at its LATER_SETTINGS value leaves the folder's hash as it was before the
    setting existed (the cached default target and its drafters stay valid); set, it moves."""
    spec = bdt.resolve_spec("tiny")
    before = asdict(spec)
    for name in bdt.LATER_SETTINGS:
        del before[name]
    key = json.dumps(
        {"spec": before, "python": platform.python_version(), "build": bdt.BUILD_VERSION},
        sort_keys=True,
    )
    want = f"tiny-{hashlib.sha1(key.encode()).hexdigest()[:10]}"
    assert bdt.demo_target_dir(spec, "tiny").name == want
    moved = bdt.resolve_spec("tiny", overrides={"repeat_steps": 2, "repeat_rows": 1})
    assert bdt.demo_target_dir(moved, "tiny") != bdt.demo_target_dir(
        bdt.resolve_spec("tiny", overrides={"repeat_steps": 2}), "tiny"
    )


@pytest.mark.parametrize(
    "bad",
    [
        {"repeat_rows": -1},
        {"repeat_rows": 4},  # the tiny batch: no likelihood row would be left
        {"repeat_rows": 1, "repeat_steps": 26},  # more in-place steps than the build has
        {"repeat_rows": 1},  # no repeat_steps: the rows would go nowhere
    ],
)
def test_bad_in_place_repetition_rows_are_named(bad):
    with pytest.raises(ValueError, match="need 0 <= repeat_rows < batch_size"):
        bdt.resolve_spec("tiny", overrides=bad)


@pytest.mark.parametrize(
    "bad", [{"repeat_steps": -1}, {"repeat_decay": 1.0}, {"repeat_decay": 0}, {"repeat_lr": 0}]
)
def test_bad_repetition_settings_are_named(bad):
    with pytest.raises(ValueError, match="need repeat_steps >= 0, 0 < repeat_decay < 1"):
        bdt.resolve_spec("tiny", overrides=bad)


def test_repetition_rows_by_lines_repeat_whole_lines():
    """With line ends given, a span starts after a line end and runs through the next one."""
    import torch

    gen = torch.Generator().manual_seed(1)
    blocks = torch.randint(1, 50, (6, 80), generator=gen)
    blocks[:, 3::7] = 0  # token 0 ends a line: lines of 7 tokens
    line_ends = torch.zeros(50, dtype=torch.bool)
    line_ends[0] = True
    rows, starts, spans = bdt.repetition_rows(blocks, 12, gen, line_ends)
    for row, start, span in zip(rows.tolist(), starts.tolist(), spans.tolist(), strict=True):
        assert span == 7 and row[start - 1] == 0 and row[start + span - 1] == 0
        assert 0 not in row[start : start + span - 1]
        assert all(row[t] == row[t - span] for t in range(start + span, 80))
