"""scripts/verify_export.py: each export loaded by the reference code its format is named after
(speculators 0.9.0, SafeAILab's eagle-llm, FasterDecoding's medusa-llm, each in its own virtual
environment from the registry), drafting what our loop drafts; an export missing what the
engine's model builds is caught.

The engines' environments are made once per machine (about a minute each; .ci/run makes them
before the suite) under SPECDRAFT_ENGINES, default ~/.cache/specdraft/engines."""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from testkit import perturb

from specdraft.core import DecodeConfig
from specdraft.formats.export_registry import export_drafter
from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.kinds.medusa.medusa import MedusaDrafter
from specdraft.kinds.medusa.medusa_config import MedusaConfig
from specdraft.tools import verify_export

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def engines(monkeypatch, request):
    """The machine's engine environments, not the test session's fresh SPECDRAFT_HOME; made
    here where missing (the registry is needed once). Where it cannot be made (offline), the
    test is skipped with the reason: .ci/run makes them first and stops if it cannot."""
    default = Path.home() / ".cache" / "specdraft" / "engines"
    monkeypatch.setenv("SPECDRAFT_ENGINES", os.environ.get("SPECDRAFT_ENGINES", str(default)))
    engine = getattr(request.function, "engine", None)
    if engine is not None:
        try:
            verify_export.engine_python(engine, log=lambda *a: None)
        except verify_export.VerifyError as e:
            pytest.skip(f"the {engine} environment cannot be made here: {e}")


def engine(name: str):
    def mark(test):
        test.engine = name
        return test

    return mark


def repeating(module_weights: list[torch.nn.Parameter], noise: float) -> None:
    """Noise on weights set to draft 'the token the target just predicted': enough that a
    swapped or dropped tensor shows in the logits and that acceptance varies from step to step
    (so a comparison off by one step fails), little enough that drafts are accepted where the
    random target repeats a token."""
    torch.manual_seed(0)
    perturb(module_weights, noise)


def varied(report: dict) -> None:
    """Drafts were accepted, in more than one length (an alignment slip would show)."""
    lengths = [a for d in report["decoded"] for a in d["ours"]]
    assert sum(lengths) > 0 and len(set(lengths)) > 1, lengths


def export(drafter, folder: Path, fmt: str, base: Path) -> Path:
    return export_drafter(drafter, folder, fmt, base_model_name_or_path=str(base))


def run(folder: Path, engine: str, tmp_path: Path) -> tuple[int, dict]:
    out = tmp_path / f"{engine}.json"
    code = verify_export.main([str(folder), "--engine", engine, "--num-prompts", "4", "--json", str(out)])  # fmt: skip
    return code, json.loads(out.read_text()) if out.exists() else {}


@engine("speculators")
def test_speculators_loads_the_eagle3_export_and_drafts_as_we_do(target, tmp_path, capsys):
    """Three drafted steps, teacher-forced, at every position of 4 prompts and their greedy
    continuations: the same top-1 token everywhere. The same folder without its embedding (as
    exports were before) is caught: speculators builds one and fills it from memory."""
    path, t = target
    torch.manual_seed(0)
    head = EagleDrafter.build(EagleConfig(feature_layers=[1, 2, 4], draft_vocab_size=100), t)
    perturb(head.parameters(), 0.05)
    folder = export(head, tmp_path / "spec", "speculators", path)
    code, report = run(folder, "speculators", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["agree"] == s["positions"] > 100 for s in report["steps"])

    state = load_file(folder / "model.safetensors")
    del state["embed_tokens.weight"]
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    code, report = run(folder, "speculators", tmp_path)
    assert code == 1 and not report["ok"]
    assert any("missing ['embed_tokens.weight']" in p for p in report["problems"])


@engine("speculators")
def test_speculators_loads_an_eagle31_export_and_drafts_as_we_do(target, tmp_path, capsys):
    """An EAGLE-3.1 head (norm_before_fc and norm_output, layers given out of order, so the
    input norm's blocks are reordered with fc's): speculators' Eagle3DraftModel, whose config
    the export sets both flags in, drafts the same top-1 token at every step and position."""
    path, t = target
    torch.manual_seed(0)
    cfg = EagleConfig(feature_layers=[4, 1, 2], draft_vocab_size=100, norm_before_fc=True,
                      norm_output=True)  # fmt: skip
    head = EagleDrafter.build(cfg, t)
    perturb(head.parameters(), 0.05)
    with torch.no_grad():  # norm weights far from one, so a misplaced block shows
        head.input_norm.weight.uniform_(0.2, 3.0)
        head.final_norm.weight.uniform_(0.2, 3.0)
    folder = export(head, tmp_path / "spec", "speculators", path)
    config = json.loads((folder / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_output"] is True
    code, report = run(folder, "speculators", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert all(s["agree"] == s["positions"] > 100 for s in report["steps"])


@engine("speculators")
def test_speculators_loads_the_peagle_export_and_drafts_as_we_do(target, tmp_path, capsys):
    """speculators' PEagleDraftModel reads a P-EAGLE export (mask_hidden, mask_token_id, layers
    given out of order) and its training forward, every group kept, gives every depth's logits
    at every anchor of 4 prompts and their continuations: the same top-1 token everywhere."""
    from specdraft.kinds.peagle.peagle import PEagleConfig, PEagleDrafter

    path, t = target
    torch.manual_seed(0)
    cfg = PEagleConfig(num_depths=4, feature_layers=[4, 1, 2], draft_vocab_size=100)
    head = PEagleDrafter.build(cfg, t, torch.randperm(t.vocab_size)[:100].sort().values)
    perturb(head.parameters(), 0.05)
    folder = export(head, tmp_path / "spec", "speculators", path)
    code, report = run(folder, "speculators", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]  # --steps 3: depths 0, 1, 2
    assert all(s["agree"] == s["positions"] > 100 for s in report["steps"])


@engine("speculators")
def test_speculators_loads_the_dflash_export_and_drafts_as_we_do(target, tmp_path, capsys):
    """speculators' own DFlashDraftModel, on the same fused hidden states: every slot of the
    block after every anchor of 4 prompts and their continuations, the same top-1 token, with
    the aux layers given out of order (the export sorts them and fc's blocks with them)."""
    path, t = target
    torch.manual_seed(0)
    drafter = DFlashDrafter.build(DFlashConfig(block_size=4, num_layers=2, aux_layers=[4, 1, 2]), t)
    perturb(drafter.parameters(), 0.05)
    folder = export(drafter, tmp_path / "spec", "speculators", path)
    code, report = run(folder, "speculators", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(s["agree"] == s["positions"] > 100 for s in report["steps"])


@engine("speculators")
@pytest.mark.parametrize("from_anchor", [True, False])
def test_speculators_loads_the_dspark_export_and_drafts_as_we_do(
    target, tmp_path, capsys, from_anchor
):
    """speculators' own DSparkDraftModel: the Markov-biased logits of every drafting slot of
    the block after every anchor (the slots from the anchor's, or from the first mask's), the
    same top-1 token; its config and weights are all the model builds."""
    path, t = target
    torch.manual_seed(0)
    cfg = DSparkConfig(block_size=4, aux_layers=[4, 1, 2], markov_rank=8,
                       sample_from_anchor=from_anchor)  # fmt: skip
    drafter = DSparkDrafter.build(cfg, t)
    perturb(drafter.parameters(), 0.05)
    with torch.no_grad():  # a Markov bias large enough to change the top token somewhere
        drafter.markov_head.markov_w1.weight.mul_(100)
    folder = export(drafter, tmp_path / "spec", "speculators", path)
    code, report = run(folder, "speculators", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert [s["step"] for s in report["steps"]] == [0, 1, 2] + ([3] if from_anchor else [])
    assert all(s["agree"] == s["positions"] > 100 for s in report["steps"])


@engine("eagle")
def test_eagle_llm_loads_the_eagle1_export_and_decodes_as_we_do(target, tmp_path, capsys):
    """EaModel.from_pretrained reads the folder (pytorch_model.bin, the embedding its strict
    loader needs); the head's logits agree at every position, and eagenerate on a chain of 3
    gives our greedy output with the same accepted length at every step."""
    path, t = target
    # Where drafts are accepted in varied lengths sits on a knife edge of the noise, and the edge
    # moves with the CPU's arithmetic (on an AVX2 EPYC 0.1 accepts exactly 1 token every step,
    # 0.05 accepts 2 or 3): every level tried must agree with eagenerate, and one must vary.
    reports = []
    for noise in (0.05, 0.1, 0.03):
        torch.manual_seed(0)
        head = EagleDrafter.build(EagleConfig(version="eagle1"), t)
        H = t.hidden_size
        with torch.no_grad():  # h = f_t: drafts what the target just predicted
            head.fc.weight.copy_(torch.cat([torch.zeros(H, H), torch.eye(H)], 1))
            head.fc.bias.zero_()
            head.layer.self_attn.o_proj.weight.zero_()
            head.layer.mlp.down_proj.weight.zero_()
        repeating(list(head.parameters()), noise)
        folder = export(head, tmp_path / f"e1-{noise}", "eagle", path)
        code, report = run(folder, "eagle", tmp_path)
        assert code == 0 and report["ok"], capsys.readouterr().out
        assert report["steps"][0]["agree"] == report["steps"][0]["positions"] > 100
        assert all(d["equal"] and d["accepted_equal"] for d in report["decoded"])
        assert sum(d["drafted"] for d in report["decoded"]) > 0
        reports.append(report)
        if len({a for d in report["decoded"] for a in d["ours"]}) > 1:
            break
    varied(reports[-1])


@engine("medusa")
def test_medusa_llm_loads_the_medusa_export_and_decodes_as_we_do(target, tmp_path, capsys):
    """MedusaModel.from_pretrained reads medusa_lm_head.pt (it loads with strict=False, so the
    check compares the names itself); each head agrees at every position, and medusa_generate
    on a chain of the 3 heads gives our output and accepted lengths."""
    path, t = target
    heads = MedusaDrafter.build(MedusaConfig(num_heads=3), t)
    with torch.no_grad():  # zero blocks and the target's LM head: each head repeats
        for head in heads.heads:
            for block in head.blocks:
                block.linear.weight.zero_()
                block.linear.bias.zero_()
            head.out.weight.copy_(t.model.get_output_embeddings().weight)
    repeating(list(heads.parameters()), 0.03)
    folder = export(heads, tmp_path / "medusa", "medusa", path)
    code, report = run(folder, "medusa", tmp_path)
    assert code == 0 and report["ok"], capsys.readouterr().out
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]
    assert all(d["equal"] and d["accepted_equal"] for d in report["decoded"])
    varied(report)

    # a tree of medusa_choices, as the export says for tree_top_k 2: the reference decodes it
    # (its default choices raised IndexError with 3 heads) to our greedy output
    tree = export_drafter(heads, tmp_path / "tree", "medusa", base_model_name_or_path=str(path), decode=DecodeConfig(tree_top_k=2))  # fmt: skip
    assert json.loads((tree / "config.json").read_text())["medusa_choices"] == [1, 2, 2, 1]
    code, report = run(tree, "medusa", tmp_path)
    assert code == 0 and all(d["equal"] for d in report["decoded"]), capsys.readouterr().out

    # the reference loads a misnamed file without a word: the check does not
    state = torch.load(folder / "medusa_lm_head.pt", weights_only=True)
    state["0.9.weight"] = state.pop("0.1.weight")
    torch.save(state, folder / "medusa_lm_head.pt")
    code, report = run(folder, "medusa", tmp_path)
    assert code == 1 and any("missing ['0.1.weight']" in p for p in report["problems"])


def test_bad_input_exits_2_naming_the_fix(target, tmp_path, capsys):
    path, t = target
    heads = MedusaDrafter.build(MedusaConfig(num_heads=2), t)
    folder = export(heads, tmp_path / "medusa", "medusa", path)
    assert verify_export.main([str(folder), "--engine", "speculators"]) == 2
    assert "--engine speculators reads speculators folders" in capsys.readouterr().err
    (folder / "config.json").unlink()
    assert verify_export.main([str(folder), "--engine", "medusa"]) == 2
    assert "holds no config.json" in capsys.readouterr().err
    (folder / "config.json").write_text('{"model_type": "llama"}')
    assert verify_export.main([str(folder), "--engine", "medusa"]) == 2
    assert "no export we know" in capsys.readouterr().err
    assert verify_export.main([str(folder), "--engine", "medusa", "--num-prompts", "0"]) == 2
    assert "would compare next to nothing" in capsys.readouterr().err


def test_two_callers_at_once_make_an_environment_once(tmp_path, monkeypatch):
    """The suite's two workers may need one engine at once: one makes its environment under the
    lock, the other waits and reuses it (without the lock both would make it, each clearing
    the other's half-made venv)."""
    monkeypatch.setenv("SPECDRAFT_ENGINES", str(tmp_path))
    made = []

    def slow_make(engine, spec, venv, python, log):
        made.append(engine)
        venv.mkdir(parents=True)  # fails for a second maker too
        time.sleep(0.3)

    monkeypatch.setattr(verify_export, "_make_engine", slow_make)
    quiet = lambda _: verify_export.engine_python("medusa", log=lambda *a: None)  # noqa: E731
    with ThreadPoolExecutor(2) as pool:
        pythons = list(pool.map(quiet, range(2)))
    assert made == ["medusa"] and pythons[0] == pythons[1]
    assert (pythons[0].parent.parent / ".specdraft-ready").is_file()
