"""DeepSpeed ZeRO through accelerate on this CPU: one process (the ZeRO optimizer's partitioned
state must resume exactly, loaded without unpickling code), and two processes over gloo, which
the trainer names because accelerate selects no backend without a GPU."""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from testkit import ACCELERATE, ROOT, run_script

from specdraft.train.entry import main as train_main

pytest.importorskip("deepspeed")


def assert_two_processes_equal_one(tmp_path: Path, checkpoint: str) -> None:
    """The two-process run in tmp_path/ds trained what the plain one in tmp_path/plain did: the
    same losses up to `checkpoint` and the same final weights (within float reordering)."""
    ds, plain = (
        json.loads((tmp_path / d / checkpoint / "trainer_state.json").read_text())
        for d in ("ds", "plain")
    )
    assert ds["world_size"] == 2 and ds["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("plain", "ds"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max().item() < 1e-5, k


def test_zero2_run_and_resume_equal_a_plain_run(tiny_target_path, tmp_path):
    """One ZeRO-2 process (the setup check_process_group points a CPU user to): the ZeRO
    optimizer's partitioned state resumes, and the run ends bit-exact where a plain run does."""
    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=0", "save_every=2",
        "eval_loop.enabled=false",  # the weights are compared; serving them is tested elsewhere
        "data.max_samples=20", "data.max_length=32", "grad_accum=2", "warmup_steps=1", "seed=1",
        "micro_batch_size=4", "mixed_precision=no",  # compared in fp32 on every CPU
    ]  # fmt: skip
    launch = [
        ACCELERATE, "launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml"), "--num_processes", "1",
        str(ROOT / "train" / "distill.py"), *common, f"output_dir={tmp_path / 'ds'}",
    ]  # fmt: skip
    for extra in ([], ["resume_from=latest"]):
        stderr = run_script(launch + extra)
        if not extra:  # drop the end so the second launch resumes from step 2
            ds = tmp_path / "ds"
            assert (ds / "checkpoint-2" / "optimizer-rank0.pt").exists()  # ZeRO's own state
            for name in ("checkpoint-4", "final"):
                shutil.rmtree(ds / name)
    assert "resuming from" in stderr and "checkpoint-2" in stderr

    assert train_main("distill", [*common, f"output_dir={tmp_path / 'plain'}"]) == 0
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("plain", "ds"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    plain, ds = (
        json.loads((tmp_path / d / "checkpoint-4" / "trainer_state.json").read_text())
        for d in ("plain", "ds")
    )
    assert ds["losses"] == plain["losses"]


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_two_deepspeed_processes_on_cpu_equal_one_plain_process(tiny_target_path, tmp_path, stage):
    """ZeRO on two CPU processes (gloo, which DeepSpeed's CPU accelerator uses without oneCCL;
    accelerate would select no backend there) trains what one plain process trains with the same
    global batch; every rank writes its own optimizer shard (none gathers the others'), and a
    run resumed from them ends bit-exact where the uninterrupted one did."""
    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=2", "eval_batches=2",
        "save_every=2", "eval_loop.enabled=false", "data.max_samples=20", "data.max_length=32",
        "grad_accum=2", "warmup_steps=1", "seed=1", "mixed_precision=no",  # fp32 on every CPU
    ]  # fmt: skip
    launch = [
        ACCELERATE, "launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / f"deepspeed_{stage}.yaml"), "--num_processes", "2",
        str(ROOT / "train" / "distill.py"), *common, "micro_batch_size=2",
    ]  # fmt: skip

    def run(*extra):
        return run_script([*launch, *extra])

    assert "2 process(es)" in run(f"output_dir={tmp_path / 'ds'}")
    shards = sorted(p.name for p in (tmp_path / "ds" / "checkpoint-2").glob("optimizer-rank*"))
    assert shards == ["optimizer-rank0.pt", "optimizer-rank1.pt"]
    assert not list((tmp_path / "ds").glob(".*"))  # no staging left beside the checkpoints
    # (resume reads the student's weights straight from the folder: from_pretrained there
    # would build it partitioned under ZeRO-3, with a vocabulary of 0 rows)
    (tmp_path / "again").mkdir()
    shutil.copytree(tmp_path / "ds" / "checkpoint-2", tmp_path / "again" / "checkpoint-2")
    resumed = run(f"output_dir={tmp_path / 'again'}", "resume_from=latest")
    assert "resuming from" in resumed and "checkpoint-2" in resumed
    a, b = (load_file(tmp_path / d / "final" / "model.safetensors") for d in ("ds", "again"))
    assert all(torch.equal(a[k], b[k]) for k in a)

    assert (
        train_main("distill", [*common, "micro_batch_size=4", f"output_dir={tmp_path / 'plain'}"])
        == 0
    )
    assert_two_processes_equal_one(tmp_path, "checkpoint-2")


def test_layerskip_under_zero3_on_two_processes(tiny_target_path, tmp_path):
    """LayerSkip trains the target itself, so ZeRO-3 partitions the very model that drafts: with
    layer dropout on (a layer every row of a process skips still runs, on one row weighted by
    zero, or the processes' gathers would differ), two ZeRO-3 processes train what one plain
    process does, and the end of the run loads the saved model whole on the main process (the
    partitioned loading that accelerate leaves switched on would wait for the others)."""

    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=2", "eval_batches=2",
        "save_every=0", "data.max_samples=20", "data.max_length=32", "grad_accum=2",
        "warmup_steps=1", "seed=1", "mixed_precision=no", "drafter.exit_layer=1",
        "drafter.layer_dropout=0.5", "drafter.dropout_scale=uniform",
    ]  # fmt: skip
    run_script([
        ACCELERATE, "launch", "--config_file",
        str(ROOT / "configs" / "accelerate" / "deepspeed_zero3.yaml"), "--num_processes", "2",
        str(ROOT / "train" / "layerskip.py"), *common, "micro_batch_size=2",
        "eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12", f"output_dir={tmp_path / 'ds'}",
    ])  # fmt: skip
    served = json.loads((tmp_path / "ds" / "eval_loop.json").read_text())
    assert served["matches_ar"] is True and served["drafted"] > 0
    assert "exit_agreement" in json.loads((tmp_path / "ds" / "target_quality.json").read_text())

    plain = [*common, "micro_batch_size=4", "eval_loop.enabled=false"]
    assert train_main("layerskip", [*plain, f"output_dir={tmp_path / 'plain'}"]) == 0
    assert_two_processes_equal_one(tmp_path, "checkpoint-4")


# kind -> (its settings, the launch: DeepSpeed ZeRO-2 for the drafter as the 70B recipe has it,
# or plain DDP; whether the end of the run decodes, which loads the target whole on the main
# process: every kind does here)
SHARDED = {
    "eagle": (["drafter.draft_vocab_size=256", "drafter.ttt_steps=2", "decode.gamma=3"],
              ["--config_file", str(ROOT / "configs" / "accelerate" / "deepspeed_zero2.yaml")],
              True),
    # the student is seeded from the target's layers, gathered for the copy
    "distill": (["drafter.init=target", "drafter.num_layers=1", "decode.gamma=3"],
                ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"], True),
    "medusa": (["drafter.num_heads=2", "drafter.loss=ce", "decode.gamma=2",
                "drafter.draft_vocab_size=256"],
               ["--multi_gpu", "--mixed_precision", "no", "--dynamo_backend", "no"], True),
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(SHARDED))
def test_a_drafter_trains_online_against_a_target_sharded_by_zero3(
    tiny_target_path, tmp_path, kind
):
    """target_sharding=zero3: the frozen target is partitioned over the two processes (each
    holds half of it and gathers a module's weights for its forward) while the drafter trains
    as the launcher says. It trains what one plain process with the whole target does, and the
    end of the run decodes with the target loaded whole on the main process."""

    settings, launcher, decodes = SHARDED[kind]
    common = [
        f"target={tiny_target_path}", "max_steps=4", "eval_every=2", "eval_batches=2",
        "save_every=0", "data.max_samples=20", "data.max_length=32", "grad_accum=2",
        "warmup_steps=1", "seed=1", "mixed_precision=no", *settings,  # fp32 on every CPU
    ]  # fmt: skip
    loop = ["eval_loop.num_prompts=2", "eval_loop.max_new_tokens=12"] if decodes else [
        "eval_loop.enabled=false"]  # fmt: skip
    stderr = run_script([
        ACCELERATE, "launch", *launcher,
        "--num_processes", "2", str(ROOT / "train" / f"{kind}.py"), *common, *loop,
        "micro_batch_size=2", "target_sharding=zero3", f"output_dir={tmp_path / 'ds'}",
    ])  # fmt: skip
    held = re.findall(r"sharded by ZeRO-3 over 2 process\(es\): this one holds ([\d.]+)M of its "
                      r"([\d.]+)M", stderr)  # fmt: skip
    assert len(held) == 2 and all(float(h) < 0.6 * float(n) for h, n in held)
    if decodes:
        assert "set eval_loop.enabled=false" in stderr  # said before training
        served = json.loads((tmp_path / "ds" / "eval_loop.json").read_text())
        assert served["matches_ar"] is True and served["drafted"] > 0

    plain = [*common, "micro_batch_size=4", "eval_loop.enabled=false"]
    assert train_main(kind, [*plain, f"output_dir={tmp_path / 'plain'}"]) == 0
    assert_two_processes_equal_one(tmp_path, "checkpoint-4")


def test_a_sharded_target_without_a_launcher_is_a_group_of_one(tiny_target_path, tmp_path):
    """Run directly (no accelerate launch, no torchrun), target_sharding=zero3 makes a process
    group of one, which holds the whole target, and trains."""
    args = [
        sys.executable, str(ROOT / "train" / "eagle.py"), f"target={tiny_target_path}",
        "target_sharding=zero3", "max_steps=2", "eval_every=0", "save_every=0",
        "eval_loop.enabled=false", "data.max_samples=8", "data.max_length=32",
        "micro_batch_size=4", "drafter.ttt_steps=2", "drafter.draft_vocab_size=256",
        f"output_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    stderr = run_script(args, cwd=tmp_path, env=env)
    held = re.findall(r"over 1 process\(es\): this one holds ([\d.]+)M of its ([\d.]+)M", stderr)
    assert len(held) == 1 and held[0][0] == held[0][1]
    assert (tmp_path / "run" / "final" / "model.safetensors").exists()
