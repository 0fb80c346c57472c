"""llama.cpp as an engine: `scripts/export.py --format gguf` writes GGUF files with llama.cpp's own
converter, `scripts/verify_export.py --engine llama.cpp` serves them in llama.cpp's server
against its plain decoding, `benchmarks/bench_llamacpp.py` measures them; and what llama.cpp cannot
serve, or would serve wrongly, is refused before it runs.

The tests that run llama.cpp use the machine's build (made once per machine, minutes:
`python scripts/verify_export.py --setup --engine llama.cpp`, which .ci/run runs before the
suite) and are marked `llamacpp`; where it has not been built they are skipped, saying so."""

from __future__ import annotations

import json
import os
from pathlib import Path

import bench_llamacpp
import pytest
import torch
from gguf_kit import write_llama_gguf
from testkit import perturb
from transformers import LlamaForCausalLM

from specdraft import llamacpp_build
from specdraft.core import DecodeConfig
from specdraft.formats.checkpoint import save_drafter
from specdraft.formats.gguf_export import ExportError, export_gguf, gguf_fields, gguf_problems
from specdraft.kinds.dspark.dspark import DSparkConfig, DSparkDrafter
from specdraft.kinds.eagle.eagle import EagleConfig, EagleDrafter
from specdraft.measuring.llamacpp import (
    Completion,
    Drafting,
    LlamaServer,
    agreement,
    counters,
    read_gguf_export,
)
from specdraft.tools import export, verify_export

MACHINE_ENGINES = Path.home() / ".cache" / "specdraft" / "engines"


@pytest.fixture
def engine(monkeypatch):
    """The machine's llama.cpp build (not the test session's fresh SPECDRAFT_HOME)."""
    monkeypatch.setenv("SPECDRAFT_ENGINES", os.environ.get("SPECDRAFT_ENGINES", str(MACHINE_ENGINES)))  # fmt: skip
    built = llamacpp_build.built_llamacpp()
    if built is None:
        pytest.skip(
            "llama.cpp is not built on this machine: python scripts/verify_export.py --setup "
            "--engine llama.cpp (minutes, once; .ci/run does it before the suite)"
        )
    return built


@pytest.fixture(scope="module")
def distill_gguf(tiny_target_path, draft_folder, tmp_path_factory):
    """The tiny target and a copy of it as a two-model draft, exported to GGUF by the script
    (the target converted too: the tiny target has no GGUF of its own)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SPECDRAFT_ENGINES", os.environ.get("SPECDRAFT_ENGINES", str(MACHINE_ENGINES)))  # fmt: skip
        if llamacpp_build.built_llamacpp() is None:
            pytest.skip("llama.cpp is not built on this machine (see the module's docstring)")
        out = tmp_path_factory.mktemp("gguf") / "distill"
        args = [str(draft_folder), str(out), "--format", "gguf", "--target", tiny_target_path]
        assert export.main([*args, "--gguf-type", "f32"]) == 0
        # a second export into it replaces it, as a previous export, without --force
        assert export.main([*args, "--gguf-type", "f32"]) == 0
        return out


pytestmark = [pytest.mark.slow, pytest.mark.llamacpp]


def test_two_model_draft_exports_and_decodes_exactly_in_llamacpp(distill_gguf, engine, tmp_path):
    """A draft that is the target: llama.cpp accepts nearly all it drafts, and its outputs with
    the draft equal its plain decoding's (near-ties apart), at two draft lengths."""
    manifest = json.loads((distill_gguf / "specdraft_gguf.json").read_text())
    assert manifest["spec_type"] == "draft-simple" and manifest["target"] == "target.gguf"
    assert sorted(p.name for p in distill_gguf.iterdir()) == [
        "draft.gguf", "specdraft_gguf.json", "target.gguf"
    ]  # fmt: skip
    out = tmp_path / "verify.json"
    args = ["--engine", "llama.cpp", "--prompts", "demo", "--num-prompts", "3"]
    args += ["--max-new-tokens", "24", "--lengths", "1,3", "--json", str(out)]
    assert verify_export.main([str(distill_gguf), *args]) == 0
    report = json.loads(out.read_text())
    assert report["ok"] and [r["length"] for r in report["runs"]] == [1, 3]
    for run in report["runs"]:
        assert run["equal"] + len(run["near_ties"]) == 3 and not run["disagreements"]
        assert run["drafted"] > 20 and run["acceptance_rate"] > 0.9
        assert run["verifications"] > 0 and run["mean_accepted_length"] > 1.5


@pytest.mark.parametrize("norm_before_fc", [False, True], ids=["eagle3", "eagle3.1-input-norm"])
def test_eagle3_head_exports_through_the_converter_and_decodes_exactly(
    target, engine, tmp_path, norm_before_fc
):
    """An EAGLE-3 head (reduced draft vocabulary: d2t; and with EAGLE-3.1's norm over the fused
    features, which llama.cpp computes) goes through llama.cpp's converter with its target and is
    served by draft-eagle3: its target layers and width are in the file, and llama.cpp's output
    with it equals its plain decoding's (the random head drafts, llama.cpp rejects what it
    drafts)."""
    _, t = target
    torch.manual_seed(0)
    cfg = EagleConfig(feature_layers=[1, 2, 4], draft_vocab_size=100, norm_before_fc=norm_before_fc)
    head = EagleDrafter.build(cfg, t)
    perturb(head.parameters(), 0.05)
    decode = DecodeConfig(gamma=3)  # the length it is served at by default, recorded
    out = export_gguf(engine, head, t, tmp_path / "eagle", decode, "f16", log=lambda *a: None)
    fields = gguf_fields(out / "draft.gguf")
    assert fields["general.architecture"] == "eagle3"
    assert list(fields["eagle3.target_layers"]) == [1, 2, 4]
    assert fields["eagle3.target_hidden_size"] == t.hidden_size
    assert bool(fields.get("eagle3.norm_before_fc", False)) is norm_before_fc
    json_out = tmp_path / "v.json"
    args = ["--engine", "llama.cpp", "--num-prompts", "2", "--max-new-tokens", "16"]
    assert verify_export.main([str(out), *args, "--json", str(json_out)]) == 0
    run = json.loads(json_out.read_text())["runs"][0]
    assert run["length"] == 3 and run["drafted"] > 0 and not run["disagreements"]


def test_dspark_exports_through_the_converter_and_decodes_exactly(target, engine, tmp_path):
    """A DSpark drafter (speculators' layout, its Markov and confidence heads) goes through
    llama.cpp's converter with its target and is served by draft-dspark: the block size, the
    anchor layout and the heads are in the file, and llama.cpp's output with it equals its plain
    decoding's (the random drafter drafts, llama.cpp rejects what it drafts)."""
    _, t = target
    torch.manual_seed(0)
    drafter = DSparkDrafter.build(
        DSparkConfig(block_size=4, aux_layers=[1, 2, 4], markov_rank=8), t
    )
    perturb(drafter.parameters(), 0.05)
    out = export_gguf(
        engine, drafter, t, tmp_path / "dspark", DecodeConfig(gamma=4), "f16", log=lambda *a: None
    )
    fields = gguf_fields(out / "draft.gguf")
    assert fields["general.architecture"] == "dflash"
    assert fields["dflash.block_size"] == 4 and fields["dflash.sample_from_anchor"] is True
    assert fields["dflash.has_confidence_head"] is True
    assert json.loads((out / "specdraft_gguf.json").read_text())["spec_type"] == "draft-dspark"
    json_out = tmp_path / "v.json"
    args = ["--engine", "llama.cpp", "--num-prompts", "2", "--max-new-tokens", "16"]
    assert verify_export.main([str(out), *args, "--json", str(json_out)]) == 0
    run = json.loads(json_out.read_text())["runs"][0]
    assert run["length"] == 4 and run["drafted"] > 0 and not run["disagreements"]


def test_a_draft_with_another_tokenizer_is_refused_before_llamacpp_runs(tiny_target, tmp_path):
    """gguf_problems compares the files' vocabularies as llama.cpp's draft check does: a token
    renamed is named with its id; an EAGLE-3 head for a wider target is refused."""
    folder = tmp_path / "model"
    tiny_target.model.save_pretrained(folder)
    tiny_target.tokenizer.save_pretrained(folder)
    a = write_llama_gguf(folder, tmp_path / "a.gguf")
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    token = next(k for k, v in vocab.items() if v == 40)
    vocab["renamed"] = vocab.pop(token)
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    b = write_llama_gguf(folder, tmp_path / "b.gguf")
    assert gguf_problems(a, a, "draft-simple") == []
    (problem,) = gguf_problems(a, b, "draft-simple")
    assert "another tokenizer" in problem and "id 40" in problem and "'renamed'" in problem


def test_kinds_llamacpp_cannot_serve_are_refused_by_name(tiny_target, tmp_path, capsys):
    """Medusa and DFlash folders: exit 2 before llama.cpp is built or the target loaded, saying
    why and which format to use instead."""
    from specdraft.kinds.dflash.dflash import DFlashConfig, DFlashDrafter
    from specdraft.kinds.medusa.medusa import MedusaDrafter
    from specdraft.kinds.medusa.medusa_config import MedusaConfig

    for drafter, why in (
        (MedusaDrafter.build(MedusaConfig(num_heads=2), tiny_target), "no Medusa heads"),
        (DFlashDrafter.build(DFlashConfig(block_size=4), tiny_target), "z-lab's layout"),
    ):
        fingerprint = tiny_target.fingerprint
        folder = save_drafter(drafter, tmp_path / drafter.kind, target_fingerprint=fingerprint)
        code = export.main([str(folder), str(tmp_path / "out"), "--format", "gguf"])
        err = capsys.readouterr().err
        assert code == 2 and why in err and "cannot be exported to GGUF" in err, err
        assert not (tmp_path / "out").exists()


def test_a_gguf_llamacpp_cannot_load_is_its_own_error(engine, tmp_path):
    """A file that is not a model: llama-server stops, and the error quotes llama.cpp."""
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(llamacpp_build.LlamaCppError) as caught, LlamaServer(engine, bad):
        pass
    message = str(caught.value)
    assert "llama-server stopped" in message and "model.gguf" in message
    assert "llama.cpp said:" in message and len(message.splitlines()) > 2


def test_verify_refuses_a_folder_that_is_not_a_gguf_export(tmp_path, capsys, draft_folder):
    code = verify_export.main([str(draft_folder), "--engine", "llama.cpp"])
    assert code == 2 and "specdraft_gguf.json" in capsys.readouterr().err


def test_an_export_without_its_target_needs_one_given(distill_gguf, tmp_path):
    folder = tmp_path / "no-target"
    folder.mkdir()
    manifest = json.loads((distill_gguf / "specdraft_gguf.json").read_text())
    (folder / "draft.gguf").symlink_to(distill_gguf / "draft.gguf")
    (folder / "specdraft_gguf.json").write_text(json.dumps({**manifest, "target": None}))
    with pytest.raises(llamacpp_build.LlamaCppError, match="--target-gguf"):
        read_gguf_export(folder)
    found = read_gguf_export(folder, str(distill_gguf / "target.gguf"))
    assert found.target == distill_gguf / "target.gguf" and found.spec_type == "draft-simple"


def test_bench_measures_plain_ngram_and_the_drafter(distill_gguf, engine, tmp_path):
    out = tmp_path / "bench"
    args = ["--export", str(distill_gguf), "--lengths", "2", "--ngram", "ngram-simple"]
    args += ["--prompts", "demo", "--num-prompts", "2", "--max-new-tokens", "16"]
    assert bench_llamacpp.main([*args, "--output", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    methods = [(r["method"], r["length"]) for r in report["runs"]]
    assert methods == [("plain", None), ("ngram-simple", None), ("distill (distill, f32)", 2)]
    drafted = report["runs"][-1]
    assert drafted["equal_outputs"] + drafted["near_ties"] == report["turns"] == 2
    assert not drafted["disagreements"]
    assert drafted["tau"] > 1.5  # the draft is the target
    assert drafted["drafted"] > 0 and drafted["accepted"] > 0
    assert set(report["block_costs"]) >= {"1", "2", "3", "one_token_ms"}
    assert "best speedup" in (out / "report.md").read_text()


def test_missing_build_tools_are_named(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_ENGINES", str(tmp_path))
    monkeypatch.setattr(
        llamacpp_build.shutil, "which", lambda exe: None if exe == "cmake" else "/x"
    )
    with pytest.raises(llamacpp_build.LlamaCppError, match=r"needs cmake.*apt install cmake"):
        llamacpp_build.ensure_llamacpp(log=lambda *a: None)
    assert not any(tmp_path.iterdir())


def test_an_interrupted_build_leaves_nothing_and_the_next_call_builds(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDRAFT_ENGINES", str(tmp_path))
    monkeypatch.setattr(llamacpp_build.shutil, "which", lambda exe: "/x")

    def interrupted(out: Path) -> None:
        (out / "src").mkdir()
        raise KeyboardInterrupt

    monkeypatch.setattr(llamacpp_build, "_build", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llamacpp_build.ensure_llamacpp(log=lambda *a: None)
    assert llamacpp_build.built_llamacpp() is None
    assert [p.name for p in tmp_path.iterdir()] == [f"{llamacpp_build.NAME}.lock"]

    def complete(out: Path) -> None:
        (out / llamacpp_build.MARKER).write_text(json.dumps({"commit": llamacpp_build.COMMIT}))

    monkeypatch.setattr(llamacpp_build, "_build", complete)
    built = llamacpp_build.ensure_llamacpp(log=lambda *a: None)
    assert built.build_info["commit"] == llamacpp_build.COMMIT
    assert llamacpp_build.built_llamacpp() == built


def test_draft_lengths_go_to_each_kind_of_drafting():
    assert Drafting("draft-eagle3", Path("d.gguf"), 4).args()[-2:] == ["--spec-draft-n-max", "4"]
    both = Drafting("ngram-simple,draft-eagle3", Path("d.gguf"), 2).args()
    assert both[:2] == ["--spec-type", "ngram-simple,draft-eagle3"]
    assert both[-2:] == ["--spec-draft-n-max", "2"]
    assert Drafting("ngram-simple", length=8).args()[-2:] == ["--spec-ngram-simple-size-m", "8"]
    with pytest.raises(llamacpp_build.LlamaCppError, match="ngram-cache takes no draft length"):
        Drafting("ngram-cache", length=3).args()


def test_an_eagle1_head_is_refused_saying_what_serves_it(target, engine, tmp_path):
    _, t = target
    head = EagleDrafter.build(EagleConfig(version="eagle1"), t)
    with pytest.raises(ExportError, match=r"EAGLE-3 heads.*--format eagle"):
        export_gguf(engine, head, t, tmp_path / "e1", log=lambda *a: None)
    assert not (tmp_path / "e1").exists()
    # EAGLE-3.1's feedback of the normed output is not what llama.cpp's draft-eagle3 computes
    cfg = EagleConfig(feature_layers=[1, 2, 4], norm_before_fc=True, norm_output=True)
    with pytest.raises(ExportError, match=r"not its norm_output.*--format speculators"):
        export_gguf(engine, EagleDrafter.build(cfg, t), t, tmp_path / "e31", log=lambda *a: None)
    assert not (tmp_path / "e31").exists()


def test_an_eagle3_head_for_another_target_is_refused(target, engine, tmp_path, tiny_target):
    path, t = target
    head = EagleDrafter.build(EagleConfig(feature_layers=[1, 2, 4], draft_vocab_size=100), t)
    out = export_gguf(engine, head, t, tmp_path / "eagle", gguf_type="f16", log=lambda *a: None)
    config = tiny_target.config.__class__(
        **{**tiny_target.config.to_dict(), "hidden_size": 2 * t.hidden_size}
    )
    wide = tmp_path / "wide"
    LlamaForCausalLM(config).save_pretrained(wide)
    tiny_target.tokenizer.save_pretrained(wide)
    other = write_llama_gguf(wide, tmp_path / "wide.gguf")
    problems = gguf_problems(other, out / "draft.gguf", "draft-eagle3", t.fingerprint)
    assert any("exported for another target" in p for p in problems), problems
    assert any(f"hidden_size {t.hidden_size} (trained for)" in p for p in problems), problems
    # llama.cpp's Gemma-3 model hands no layer inputs to a drafter: it would abort
    gemma = write_llama_gguf(path, tmp_path / "gemma.gguf", architecture="gemma3")
    (problem,) = gguf_problems(gemma, out / "draft.gguf", "draft-eagle3", None, engine.source)
    assert "cannot serve a draft-eagle3 drafter for a gemma3 target" in problem
    code = verify_export.main([str(out), "--engine", "llama.cpp", "--target-gguf", str(other)])
    assert code == 2


def test_counters_count_target_passes_as_llamacpp_decodes():
    """Two answers of 9 tokens: the first token of each comes from the prompt's pass; one
    decoded with 3 verification passes accepting 4 drafts (so 8 = 3 + 4 + 1 plain pass), one
    plainly (8 passes). tau = 16 tokens after the first over 12 passes."""
    drafted = Completion(list(range(9)), "", 1.0, drafted=6, accepted=4, verifications=3)
    plain = Completion(list(range(9)), "", 2.0)
    assert drafted.passes == 4 and plain.passes == 8
    figures = counters([drafted, plain])
    assert figures["tau"] == round(16 / 12, 3) and figures["tokens_per_second"] == round(16 / 3, 2)
    assert figures["acceptance_rate"] == round(4 / 6, 4)
    assert figures["mean_accepted_length"] == round(1 + 4 / 3, 3)


def test_agreement_tells_a_near_tie_from_a_disagreement():
    """Where outputs part, the gap of the two tokens in plain decoding decides; a drafted token
    outside plain decoding's top tokens is a disagreement, never a tie."""

    class Plain:  # plain decoding's top log-probabilities at each position
        def logprobs_along(self, ids, steps, top=20):
            return [{1: -0.1, 2: -2.0}, {3: -0.5, 4: -0.6, 5: -3.0}][:steps]

    out = [Completion(t, "", 1.0) for t in ([1, 3], [1, 3], [1, 3])]
    drafted = [Completion(t, "", 1.0) for t in ([1, 3], [1, 4], [1, 9])]
    same, tie, far = agreement(Plain(), [[0], [0], [0]], out, drafted, tie_gap=0.2)
    assert same.equal and not same.disagrees
    assert tie.first_difference == 1 and tie.gap == 0.1 and tie.near_tie
    assert far.gap is None and far.disagrees
