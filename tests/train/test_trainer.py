"""train/trainer.py: schedules, data order, exact resume, preemption, bad states, trackers.

Runs the real loop on the tiny demo target with a one-layer distilled student and synthetic
token data, a few steps each.
"""

from __future__ import annotations

import glob
import json
import math
import os
import signal
import struct
import time
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file

from specdraft.core import DecodeConfig
from specdraft.data.formats import Example
from specdraft.formats.checkpoint import check_complete
from specdraft.inference.metrics import simulated_tau
from specdraft.kinds.distill.distill import DistillConfig, DistillDrafter
from specdraft.kinds.distill.distill_trainer import DistillTrainConfig
from specdraft.train.lr_schedule import eval_chunks, examples_for, lr_at
from specdraft.train.train_config import TrainConfig
from specdraft.train.trainer import NonFiniteLossError, ResumeError, train

# Exactness: CI runs these once more with native bf16 forced off (tests/conftest.py).
pytestmark = pytest.mark.exact


def _examples(n: int, length: int, vocab: int, seed: int) -> list[Example]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        size = length - (i % 3)  # ragged, so padding is exercised
        ids = torch.randint(0, vocab, (size,), generator=g).tolist()
        out.append(Example(input_ids=ids, loss_mask=[0] * 3 + [1] * (size - 3)))
    return out


@pytest.fixture(scope="module")
def data(tiny_target):
    vocab = tiny_target.vocab_size
    return _examples(48, 24, vocab, seed=0), _examples(8, 24, vocab, seed=1)


def _cfg(tmp_path, **overrides) -> DistillTrainConfig:
    values = dict(
        target="tiny", output_dir=str(tmp_path / "run"), max_steps=6, micro_batch_size=4,
        grad_accum=2, lr=3e-3, warmup_steps=2, eval_every=3, eval_batches=2, save_every=0,
        log_every=1, seed=3, drafter=DistillConfig(init="random", num_layers=1), decode=DecodeConfig(gamma=3),
    )  # fmt: skip
    values.update(overrides)
    return DistillTrainConfig(**values)


def _drafter(cfg, target, cls=DistillDrafter):
    torch.manual_seed(cfg.seed)
    return cls.build(cfg.drafter, target)


def _run(cfg, target, data, cls=DistillDrafter):
    return train(cfg, _drafter(cfg, target, cls), target, *data, tokenizer=target.tokenizer)


def _weights(folder) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, "model.safetensors"))


# --- pure functions ----------------------------------------------------------------------------


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    cfg = TrainConfig(lr=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, cfg) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, cfg) == pytest.approx(1.0)
    assert lr_at(9, cfg) == pytest.approx(0.55)  # cosine midpoint: halfway to the floor
    assert lr_at(14, cfg) == pytest.approx(0.1)
    assert lr_at(100, cfg) == pytest.approx(0.1)
    linear = TrainConfig(lr=1.0, warmup_steps=0, max_steps=10, lr_schedule="linear", min_lr_ratio=0)
    assert [round(lr_at(s, linear), 6) for s in (0, 5, 10)] == [1.0, 0.5, 0.0]
    constant = TrainConfig(lr=2.0, warmup_steps=0, lr_schedule="constant")
    assert lr_at(0, constant) == lr_at(10**6, constant) == 2.0


def test_simulated_tau_is_leviathans_closed_form():
    for alpha in (0.0, 0.3, 0.8, 0.99):
        for gamma in (1, 4, 7):
            closed = (1 - alpha ** (gamma + 1)) / (1 - alpha)
            assert simulated_tau([alpha] * gamma) == pytest.approx(closed)
    assert simulated_tau([1.0] * 5) == 6.0
    assert simulated_tau([0.5, 0.0, 1.0]) == 1.5  # nothing passes a depth that rejects all


def test_processes_split_the_same_global_batch():
    one = TrainConfig(micro_batch_size=4, grad_accum=2, seed=5)
    two = TrainConfig(micro_batch_size=2, grad_accum=2, seed=5)
    n = 13  # not a multiple of the batch: steps cross epochs
    for step in range(5):
        for micro in range(2):
            single = examples_for(step, micro, 0, n, one, world=1)
            split = examples_for(step, micro, 0, n, two, 2) + examples_for(
                step, micro, 1, n, two, 2
            )
            assert single == split
    # every example is seen once per epoch
    first_epoch = [i for s in range(2) for m in range(2) for i in examples_for(s, m, 0, 16, one, 1)]
    assert sorted(first_epoch) == list(range(16))


# --- the loop ----------------------------------------------------------------------------------


class _SigtermAt(DistillDrafter):
    """Sends SIGTERM to its own process during the forward of micro-batch `at` (counted from 1)."""

    at = 5
    calls = 0

    def forward(self, batch, target_out):
        if self.training:
            type(self).calls += 1
            if type(self).calls == self.at:
                os.kill(os.getpid(), signal.SIGTERM)
        return super().forward(batch, target_out)


def test_sigterm_saves_and_resume_equals_an_uninterrupted_run(tiny_target, data, tmp_path):
    # On-policy batches too: the student's sampling must replay identically after the resume.
    student = DistillConfig(init="random", num_layers=1, on_policy_ratio=0.5, on_policy_tokens=4)
    straight = _run(_cfg(tmp_path / "a", drafter=student), tiny_target, data)
    assert straight.step == 6 and len(straight.losses) == 6

    # grad_accum=2: the 5th micro-batch forward is in step 3, which finishes, saves and stops.
    _SigtermAt.calls = 0
    cut = _run(_cfg(tmp_path / "b", drafter=student), tiny_target, data, cls=_SigtermAt)
    assert cut.stopped_by_signal == "SIGTERM" and cut.step == 3
    out = tmp_path / "b" / "run"
    check_complete(out / "checkpoint-3")
    assert not (out / "final").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is put back

    resumed = _run(_cfg(tmp_path / "b", resume_from="latest", drafter=student), tiny_target, data)
    assert resumed.step == 6
    assert resumed.losses == straight.losses  # the whole curve, bit for bit
    assert [e["tau"] for e in resumed.evals] == [e["tau"] for e in straight.evals]
    a, b = _weights(tmp_path / "a" / "run" / "final"), _weights(out / "final")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # and the run learned something, so equality is not of two untrained models
    assert straight.evals[-1]["tau"] > straight.evals[0]["tau"]


def test_keep_last_best_and_final_folders(tiny_target, data, tmp_path):
    result = _run(_cfg(tmp_path, save_every=1, keep_last=2, best_within=0), tiny_target, data)
    out = tmp_path / "run"
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "best", "checkpoint-5", "checkpoint-6", "final", "throughput.json", "train_config.yaml"
    ]  # fmt: skip
    throughput = json.loads((out / "throughput.json").read_text())  # for scripts/compare.py
    assert throughput["tokens_per_s"] > 0 and throughput["steps"] == 5
    best = json.loads((out / "best" / "config.json").read_text())["specdraft"]
    assert best["provenance"]["simulated_tau"] == pytest.approx(result.best_tau)
    # served greedy (eval_loop.temperature 0): best/ is picked by the greedy simulated tau, and
    # with best_within 0 only a higher one replaces it
    assert result.best_tau == max(e["tau_greedy"] for e in result.evals if e["step"] > 0)


@pytest.mark.parametrize(
    ("best_by", "temperature", "key"),
    [("auto", 0.0, "tau_greedy"), ("auto", 1.0, "tau"), ("greedy", 1.0, "tau_greedy"),
     ("sampled", 0.0, "tau")],
)  # fmt: skip
def test_best_is_chosen_by_the_simulated_tau_of_how_the_drafter_is_served(
    tiny_target, data, tmp_path, best_by, temperature, key
):
    """Greedy verification accepts a draft token when it is the target's argmax, sampling with
    probability sum min(p, q): the evaluation reports both, and best/ follows the one that
    matches the decoding the drafter is measured with."""
    from specdraft.train.train_config import LoopEvalConfig

    cfg = _cfg(tmp_path, best_by=best_by, eval_loop=LoopEvalConfig(temperature=temperature))
    result = _run(cfg, tiny_target, data)
    assert all(e["served"] == e[key] for e in result.evals)
    # the latest evaluation within best_within (2%) of the best before it
    taus = [e[key] for e in result.evals if e["step"] > 0]
    kept = [t for i, t in enumerate(taus) if i == 0 or t >= max(taus[:i]) * 0.98][-1]
    assert result.best_tau == kept and kept >= max(taus) * 0.98
    greedy = [e["tau_greedy"] for e in result.evals]
    assert greedy != [e["tau"] for e in result.evals] and all(t >= 1 for t in greedy)
    # on continuations sampled at T = 1 the sampled tau is the loop's walk in expectation
    walked = "walk" if temperature else "acceptance"
    assert all(e["sampled_simulation"] == walked for e in result.evals)


def test_a_cpu_run_trains_on_cpu_threads_and_gives_the_old_count_back(
    tiny_target, data, tmp_path, capfd, monkeypatch
):
    seen = []
    monkeypatch.setattr(DistillDrafter, "loss", _spy(DistillDrafter.loss, seen))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _run(_cfg(tmp_path, max_steps=2, eval_every=0, cpu_threads=1), tiny_target, data)
        assert set(seen) == {1} and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "1 process(es) x 1 thread(s)" in capfd.readouterr().err


def test_cpu_threads_default_follows_the_user_not_accelerates_default(monkeypatch):
    import psutil

    from specdraft.measuring.measure import usable_cores
    from specdraft.train.launch import cpu_threads as _cpu_threads

    for key in ("OMP_NUM_THREADS", "ACCELERATE_USE_CPU", "ACCELERATE_MIXED_PRECISION",
                "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                "MV2_COMM_WORLD_LOCAL_SIZE"):  # fmt: skip
        monkeypatch.delenv(key, raising=False)
    cores = min(usable_cores(), psutil.cpu_count(logical=False) or usable_cores())
    assert _cpu_threads(3, 1) == 3
    assert _cpu_threads(0, 1) == cores
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a plain python run: the user asked
    assert _cpu_threads(0, 1) == torch.get_num_threads()
    monkeypatch.setenv("ACCELERATE_USE_CPU", "False")  # accelerate launch set it: its default
    assert _cpu_threads(0, 1) == cores
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", str(2 * cores))  # more processes than cores
    assert _cpu_threads(0, 2) == 1


def _spy(loss, seen):
    def spying(self, *args, **kwargs):
        seen.append(torch.get_num_threads())
        return loss(self, *args, **kwargs)

    return spying


def test_truncated_checkpoint_is_skipped_with_a_warning(tiny_target, data, tmp_path):
    _run(_cfg(tmp_path, save_every=2, keep_last=0, max_steps=4), tiny_target, data)
    out = tmp_path / "run"
    weights = out / "checkpoint-4" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.warns(UserWarning, match="skipping .*checkpoint-4"):
        result = _run(_cfg(tmp_path, resume_from="latest", max_steps=4), tiny_target, data)
    assert result.step == 4 and len(result.losses) == 4  # steps 3-4 were redone from checkpoint-2


def test_bad_resume_targets_are_errors_that_lose_nothing(tiny_target, data, tmp_path):
    with pytest.raises(ResumeError, match="no such folder"):
        _run(_cfg(tmp_path, resume_from=str(tmp_path / "missing")), tiny_target, data)
    _run(_cfg(tmp_path, save_every=2, max_steps=2, eval_every=0), tiny_target, data)
    out = tmp_path / "run"
    before = (out / "checkpoint-2" / "model.safetensors").read_bytes()
    with pytest.raises(ResumeError, match="resume_from=latest"):  # a fresh run would overwrite
        _run(_cfg(tmp_path, max_steps=2), tiny_target, data)
    with pytest.raises(ResumeError, match="weights only"):  # best/ has no resume state
        _run(_cfg(tmp_path, resume_from=str(out / "final")), tiny_target, data)
    (out / "checkpoint-2" / "trainer_state.json").write_text("{")
    with pytest.raises(ResumeError, match="damaged"):
        _run(_cfg(tmp_path, resume_from=str(out / "checkpoint-2")), tiny_target, data)
    assert (out / "checkpoint-2" / "model.safetensors").read_bytes() == before


class _NanAt(DistillDrafter):
    calls = 0

    def forward(self, batch, target_out):
        loss, metrics = super().forward(batch, target_out)
        type(self).calls += 1
        if self.training and type(self).calls > 4:  # step 3 with grad_accum=2
            loss = loss * float("nan")
        return loss, metrics


def test_non_finite_loss_stops_naming_the_step_and_keeps_the_good_checkpoint(
    tiny_target, data, tmp_path
):
    _NanAt.calls = 0
    cfg = _cfg(tmp_path, save_every=2, eval_every=0)
    with pytest.raises(NonFiniteLossError, match="step 3"):
        _run(cfg, tiny_target, data, cls=_NanAt)
    out = tmp_path / "run"
    check_complete(out / "checkpoint-2")
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "train_config.yaml"]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["step"] == 2 and all(math.isfinite(x) for x in state["losses"])


# --- trackers ----------------------------------------------------------------------------------


def _wandb_records(run_dir) -> list:
    """Records of an offline W&B run, read from its .wandb file (LevelDB-style log)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data, pos, block, buf, records = Path(path).read_bytes(), 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # block trailer padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            records.append(pb.Record())
            records[-1].ParseFromString(buf)
    return records


def _wandb_history(run_dir) -> list[dict]:
    # W&B's writer process may still be flushing when finish() returns under load: wait for the
    # run's exit record rather than read a file that is still being written.
    deadline = time.monotonic() + 60
    while True:
        records = _wandb_records(run_dir)
        if (
            any(r.WhichOneof("record_type") == "exit" for r in records)
            or time.monotonic() > deadline
        ):
            break
        time.sleep(0.5)
    return [
        {i.key or "/".join(i.nested_key): i.value_json for i in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]


def test_wandb_offline_run_holds_the_logged_keys(tiny_target, data, tmp_path):
    cfg = _cfg(tmp_path, report_to="wandb", max_steps=3, eval_every=3, tags=["t1"])
    result = _run(cfg, tiny_target, data)
    rows = _wandb_history(tmp_path / "run")
    keys = set().union(*rows)
    for key in ("train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s",
                "train/peak_memory_mb", "train/target_forward_share", "train/loss_fkl",
                "eval/simulated_tau", "eval/simulated_tau_greedy", "eval/alpha_1", "eval/alpha_3",
                "eval/loss"):  # fmt: skip
        assert key in keys, key
    losses = [float(r["train/loss"]) for r in rows if "train/loss" in r]
    assert losses == pytest.approx(result.losses)
    taus = [float(r["eval/simulated_tau"]) for r in rows if "eval/simulated_tau" in r]
    assert taus == pytest.approx([e["tau"] for e in result.evals])
    # The alpha-per-depth table at each evaluation, and the resolved config as flat keys.
    assert sum("eval/alpha_table/_type" in r for r in rows) == len(result.evals)
    records = _wandb_records(tmp_path / "run")
    config = {
        u.key: json.loads(u.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for u in r.config.update
    }
    assert config["kind"] == "distill" and config["max_steps"] == 3
    assert config["data.max_length"] == cfg.data.max_length and config["tags"] == '["t1"]'


def test_tensorboard_event_file_holds_the_logged_scalars(tiny_target, data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = _run(
        _cfg(tmp_path, report_to="tensorboard", max_steps=2, eval_every=2), tiny_target, data
    )
    (logdir,) = glob.glob(str(tmp_path / "run" / "tensorboard" / "*"))
    events = EventAccumulator(logdir)
    events.Reload()
    assert [e.value for e in events.Scalars("train/loss")] == pytest.approx(result.losses)
    assert [e.step for e in events.Scalars("eval/simulated_tau")] == [0, 2]


class _ModeRecorder(DistillDrafter):
    """Records whether each training forward ran in train mode (dropout on)."""

    modes: ClassVar[list[bool]] = []

    def forward(self, batch, target_out):
        type(self).modes.append(self.training)
        return super().forward(batch, target_out)


def test_training_forwards_run_in_train_mode_from_a_drafter_in_eval_mode(
    tiny_target, data, tmp_path
):
    """A student loaded with from_pretrained (or a resumed run, which skips the step-0
    evaluation that used to switch modes) starts in eval mode; every training step must still
    run in train mode, or dropout silently differs from the run that was not interrupted."""
    cfg = _cfg(tmp_path, eval_every=0, max_steps=2)
    drafter = _drafter(cfg, tiny_target, _ModeRecorder).eval()
    _ModeRecorder.modes = []
    train(cfg, drafter, tiny_target, *data, tokenizer=tiny_target.tokenizer)
    assert len(_ModeRecorder.modes) == 4 and all(_ModeRecorder.modes)


class _InfGradAt(DistillDrafter):
    """A finite loss whose gradients are infinite during optimizer step `at` (0-based)."""

    at = 2
    forwards = 0

    def forward(self, batch, target_out):
        loss, metrics = super().forward(batch, target_out)
        if self.training:
            type(self).forwards += 1
            if (type(self).forwards - 1) // 2 == self.at:  # grad_accum=2 forwards per step
                loss.register_hook(lambda g: g * float("inf"))
        return loss, metrics


def test_a_step_with_non_finite_gradients_is_skipped_and_counted(tiny_target, data, tmp_path):
    """An overflow step (routine with fp16's grad scaler) is not fatal: its update is not
    applied, the run goes on, and the step is counted in the result, the logs and the resume
    state. Only a non-finite loss stops a run."""
    _InfGradAt.forwards = 0
    cfg = _cfg(tmp_path, max_steps=4, save_every=3, eval_every=0)
    result = _run(cfg, tiny_target, data, _InfGradAt)
    assert result.step == 4 and result.skipped_steps == [2]
    assert all(math.isfinite(x) for x in result.losses)
    weights = _weights(tmp_path / "run" / "final")
    assert all(torch.isfinite(w).all() for w in weights.values())
    state = json.loads((tmp_path / "run" / "checkpoint-3" / "trainer_state.json").read_text())
    assert state["skipped_steps"] == [2]


def test_every_process_runs_the_same_number_of_eval_forwards():
    """ZeRO-3 hangs when processes run different numbers of forwards; evaluation pads the short
    ones with weight-0 batches, and still counts every example exactly once."""
    for n, world, size in [(5, 2, 2), (9, 4, 2), (1, 2, 4), (8, 2, 4), (7, 3, 1), (0, 2, 2)]:
        chunks = [eval_chunks(n, rank, world, size) for rank in range(world)]
        assert len({len(c) for c in chunks}) == 1, (n, world, size)
        counted = sorted(i for c in chunks for batch, w in c if w for i in batch)
        assert counted == list(range(n))
        assert all(len(batch) <= size for c in chunks for batch, _ in c)
