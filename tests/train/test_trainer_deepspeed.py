"""DeepSpeed ZeRO-2 through accelerate on this CPU, one process (the only CPU setup accelerate
supports: with several processes and no GPU it picks no backend, and the trainer refuses to run).
The ZeRO optimizer's partitioned state must resume exactly, loaded without unpickling code."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specdraft.train.distill import main

pytest.importorskip("deepspeed")
ROOT = Path(__file__).resolve().parents[2]


def test_zero2_run_and_resume_equal_a_plain_run(tiny_target_path, tmp_path):
    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=0", "save_every=2",
        "eval_loop.enabled=false",  # the weights are compared; serving them is tested elsewhere
        "data.max_samples=20", "data.max_length=32", "grad_accum=2", "warmup_steps=1", "seed=1",
        "micro_batch_size=4",
    ]  # fmt: skip
    launch = [
        str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "1",
        str(ROOT / "train" / "distill.py"), *common, f"output_dir={tmp_path / 'ds'}",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for extra in ([], ["resume_from=latest"]):
        proc = subprocess.run(
            launch + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        if not extra:  # drop the end so the second launch resumes from step 2
            ds = tmp_path / "ds"
            assert (ds / "checkpoint-2" / "optimizer-rank0.pt").exists()  # ZeRO's own state
            for name in ("checkpoint-4", "final"):
                shutil.rmtree(ds / name)
    assert "resuming from" in proc.stderr and "checkpoint-2" in proc.stderr

    assert main([*common, f"output_dir={tmp_path / 'plain'}"]) == 0
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("plain", "ds"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain, ds = (
        json.loads((tmp_path / d / "checkpoint-4" / "trainer_state.json").read_text())
        for d in ("plain", "ds")
    )
    assert ds["losses"] == plain["losses"]
