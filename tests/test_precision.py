"""bf16 where the CPU has it natively, fp32 elsewhere, and the one line that says so.

The test session runs as the machine is (bf16 "auto" where the CPU has it natively); these tests
force each branch, whatever the machine: `native` pretends the hardware has bf16, `without`
forces the fallback as SPECDRAFT_NO_BF16=1 does for users.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdraft import precision
from specdraft.targets.demo_target import demo_target_dir, resolve_spec
from specdraft.tools import evaluate
from specdraft.train.entry import main as train_main
from specdraft.train.train_config import TrainConfig

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


@pytest.fixture
def native(monkeypatch):
    """A CPU with native bf16, whatever this machine is."""
    monkeypatch.delenv(precision.FORCE_FALLBACK_ENV, raising=False)
    monkeypatch.setattr(precision, "_native_cpu_bf16", lambda: True)
    precision._said.clear()


@pytest.fixture
def without(monkeypatch):
    """A CPU without native bf16 (forced, as SPECDRAFT_NO_BF16=1 forces it for users)."""
    monkeypatch.setenv(precision.FORCE_FALLBACK_ENV, "1")
    precision._said.clear()


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f AVX512_BF16 amx_tile\n\n")
    assert {"avx512_bf16", "amx_tile"} <= precision.cpu_flags(info)
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd bf16 i8mm\n")
    assert precision.cpu_flags(arm) & precision.BF16_CPU_FLAGS == {"bf16"}
    assert precision.cpu_flags(tmp_path / "missing") == set()


def test_auto_is_bf16_with_native_support(native, capsys):
    assert precision.native_bf16("cpu")
    assert precision.resolve_precision("auto", "cpu") == "bf16"
    assert precision.resolve_precision("fp32", "cpu") == "fp32"  # fp32 stays selectable
    assert capsys.readouterr().err == ""


def test_without_native_bf16_auto_falls_back_to_fp32_with_one_line(without, capsys):
    assert not precision.native_bf16("cpu")
    assert precision.resolve_precision("auto", "cpu", "training") == "fp32"
    assert precision.resolve_precision("auto", "cpu", "training") == "fp32"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "[specdraft] cpu has no native bf16 (SPECDRAFT_NO_BF16 is set): using fp32 for training"
    ]
    # asked for explicitly, bf16 is kept (emulated), and the line says it will be slow
    assert precision.resolve_precision("bf16", "cpu", "decoding") == "bf16"
    assert "emulated, slower than fp32" in capsys.readouterr().err
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        precision.resolve_precision("fp8")


def test_to_dtype_names_and_errors():
    assert (
        precision.to_dtype("bf16") is torch.bfloat16 and precision.to_dtype("no") is torch.float32
    )
    assert precision.to_dtype(torch.float16) is torch.float16
    with pytest.raises(ValueError, match="unknown dtype 'bf61'"):
        precision.to_dtype("bf61")


def test_training_autocast_follows_the_hardware(native):
    cfg = TrainConfig()
    assert cfg.mixed_precision == "bf16" and cfg.target_dtype() == "bfloat16"
    assert TrainConfig(mixed_precision="no").target_dtype() == "float32"


def test_training_falls_back_to_fp32(without):
    cfg = TrainConfig()
    assert cfg.mixed_precision == "no" and cfg.target_dtype() == "float32"


def test_the_demo_builds_cache_folder_names_the_precision_used(native, monkeypatch):
    bf16 = resolve_spec("tiny")
    assert bf16.precision == "bf16"
    assert resolve_spec("tiny", overrides={"precision": "fp32"}).precision == "fp32"
    monkeypatch.setenv(precision.FORCE_FALLBACK_ENV, "1")
    fp32 = resolve_spec("tiny")
    assert fp32.precision == "fp32"
    assert demo_target_dir(bf16, "tiny") != demo_target_dir(fp32, "tiny")
    with pytest.raises(ValueError, match="precision 'int4'"):
        resolve_spec("tiny", overrides={"precision": "int4"})


def test_bf16_training_on_cpu_then_measured_as_saved(native, tiny_target_path, tmp_path):
    """mixed_precision=bf16 on a CPU (accelerate's CPU autocast) against a bf16 copy of the
    target; the end-of-run measurement decodes the target as saved (fp32), exactly."""
    out = tmp_path / "run"
    code = train_main("eagle", [
        f"target={tiny_target_path}", f"output_dir={out}", "max_steps=6", "micro_batch_size=4",
        "eval_every=6", "eval_batches=2", "save_every=0", "data.max_samples=40",
        "data.max_length=32", "warmup_steps=1", "lr=3e-3", "drafter.version=eagle1",
        "drafter.ttt_steps=2", "decode.gamma=3", "eval_loop.num_prompts=2",
        "eval_loop.max_new_tokens=12", "eval_loop.threads=1",
    ])  # fmt: skip
    assert code == 0
    assert "mixed_precision: bf16" in (out / "final" / "train_config.yaml").read_text()
    state = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in state["evals"])
    served = json.loads((out / "eval_loop.json").read_text())
    assert served["matches_ar"] is True  # decoded in fp32, as saved: exact


def test_evaluate_measures_precisions_side_by_side(native, tiny_target_path, tmp_path):
    out = tmp_path / "eval"
    evaluate.main([
        "--target", tiny_target_path, "--baselines", "ar,prompt_lookup", "--num-prompts", "2",
        "--max-new-tokens", "12", "--dtype", "float32,bfloat16", "--output", str(out),
    ])  # fmt: skip
    report = json.loads((out / "report.json").read_text())
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"ar@fp32", "prompt_lookup@fp32", "ar@bf16", "prompt_lookup@bf16"}
    assert runs["ar@bf16"]["dtype"] == "bfloat16" and runs["ar@fp32"]["dtype"] == "float32"
    # the headline is against the fastest plain decoding, whatever its precision
    fastest = report["settings"]["fastest_plain"]
    assert runs[fastest]["speedup_vs_ar"] == pytest.approx(1.0)
    slower = ({"ar@fp32", "ar@bf16"} - {fastest}).pop()
    assert runs[slower]["speedup_vs_ar"] <= 1.0
    for r in runs.values():  # and against its own precision's plain decoding beside it
        own = runs[f"ar@{r['name'].split('@')[1]}"]
        assert r["speedup_vs_ar_same_dtype"] == pytest.approx(
            r["tokens_per_s"] / own["tokens_per_s"]
        )
    assert runs["prompt_lookup@fp32"]["matches_ar"] is True  # fp32 stays exact
    assert isinstance(runs["prompt_lookup@bf16"]["matches_ar"], bool)  # bf16: as measured
    assert "| same dtype |" in (out / "report.md").read_text()


@pytest.mark.parametrize("bad", ["float33", "float32,float32", ","])
def test_evaluate_rejects_bad_dtypes(bad, tiny_target_path, tmp_path, capsys):
    with pytest.raises(SystemExit):
        evaluate.main(["--target", tiny_target_path, "--dtype", bad, "--output", str(tmp_path)])
    assert "--dtype" in capsys.readouterr().err
