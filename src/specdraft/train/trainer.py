"""The one training loop, shared by every drafter kind (docs/architecture.md, "Trainer").

`train(cfg, drafter, target, train_examples, eval_examples)` runs it. The loop knows a drafter
only through the hooks `Drafter` declares (drafters/base.py, each with its default): its forward
is its loss, the sum over the batch's scored tokens, with `loss_tokens` counting them from the
batch alone; `acceptance` gives the simulated tau of evaluation at the depth the run will serve
(`cfg.decode`); `prepare_batch`, `begin_step`, `param_groups`, `eval_statistics` /
`heldout_summary`, `runs_target` and `trained_fingerprint` are there for the kinds that need
them. The parameters with requires_grad are what the optimizer trains.

A batch is a dict of (batch, seq) tensors: input_ids, attention_mask, loss_mask, and for packed
rows (data.pack) document_ids and position_ids (specdraft/attention.py, "Packed rows").

Reproducibility rests on one rule: everything random or scheduled is a pure function of the step.
The learning rate is `lr_at(step)` and the examples of a step are a seeded permutation indexed by
the step (train/lr_schedule.py), and torch's generators are reseeded from (seed, step, rank) before
each step. Resuming therefore needs only the weights, the optimizer state and the step, and a
run split over N processes sees the same global batch as one process; its loss is the sum over
the global batch's scored tokens divided by their all-reduced count, so it is the same exact
token mean too.
"""

from __future__ import annotations

import json
import math
import shutil
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import DistributedType
from tqdm.auto import tqdm

from specdraft.attention import flash_varlen, target_inputs
from specdraft.config import save_config
from specdraft.drafters.base import Drafter
from specdraft.formats import checkpoint
from specdraft.inference.metrics import simulated_tau
from specdraft.simulation.continuations import SERVED_GREEDY, SERVED_SAMPLED
from specdraft.train import heldout, launch, lr_schedule, tracking
from specdraft.train.after_training import heldout_examples
from specdraft.train.resume import (
    STATE_NAME,
    ResumeError,
    checkpoints,
    find_resume,
    load_state,
    load_weights,
    optimizer_files,
)
from specdraft.train.train_config import CONFIG_FILENAME, TrainConfig

__all__ = ["NonFiniteLossError", "ResumeError", "TrainResult", "train"]


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became inf/nan; nothing was saved after the last good step."""


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    losses: list[float]  # training loss of every step from 0, resumed runs included
    # per eval: step, loss, tau and alpha (sampled), tau_greedy and alpha_greedy, and "served":
    # the one of the two that matches how the drafter is served (TrainConfig.served_tau_key)
    evals: list[dict] = field(default_factory=list)
    best_tau: float | None = None  # the "served" simulated tau of the evaluation best/ holds
    stopped_by_signal: str | None = None  # "SIGTERM" / "SIGINT" when preempted
    output_dir: Path | None = None
    main_process: bool = True  # False on the other processes of a multi-process run
    # tokens_per_s (all processes), target_forward_share, peak_memory_mb; steps after the first
    throughput: dict = field(default_factory=dict)
    # steps whose gradients were not finite and were not applied (fp16 overflow, mostly)
    skipped_steps: list[int] = field(default_factory=list)


def train(
    cfg: TrainConfig,
    drafter: Drafter,
    target: Any,
    train_examples: Sequence[Any],
    eval_examples: Sequence[Any],
    *,
    tokenizer: Any = None,
    provenance: dict | None = None,
) -> TrainResult:
    """Train `drafter` against `target` (frozen, or fine-tuned through the drafter's own
    adapters when it `runs_target`: Medusa-2); see the module docstring.

    Writes output_dir/train_config.yaml, checkpoint-<step>/ every save_every steps (keeping the
    last keep_last), best/ (best simulated tau) and final/. Raises NonFiniteLossError on inf/nan
    (nothing is written for that step) and ResumeError for an unusable resume_from. On SIGTERM
    or SIGINT it saves a checkpoint and returns with `stopped_by_signal` set. The drafter is
    trained to be served with `cfg.decode`: they are saved as its decoding defaults, and the
    simulated tau is for their depth.
    """
    threads = torch.get_num_threads()  # a CPU run sets its own (cpu_threads); put it back after
    try:
        run = _Training(cfg, drafter, target, train_examples, eval_examples, tokenizer, provenance)
        return run.run()
    finally:
        torch.set_num_threads(threads)


class _Training:
    """One call of `train`: the prepared objects and the handful of counters the loop updates."""

    def __init__(self, cfg, drafter, target, train_examples, eval_examples, tokenizer, provenance):
        if not train_examples:
            raise ValueError("no training examples: check the data section of the config")
        self.cfg = cfg
        self.acc = launch.make_accelerator(cfg)
        self.main = self.acc.is_main_process
        self.world = self.acc.num_processes
        self.rank = self.acc.process_index
        self.out = Path(cfg.output_dir)
        self.target = target.to(self.acc.device)  # a cache stand-in moves only what it uses
        if cfg.data.pack and flash_varlen(self.target.model, self.acc.device) and self.main:
            print(
                "[specdraft] packed rows: the target runs flash-attention's varlen kernel",
                file=sys.stderr,
            )
        self.train_examples = train_examples
        # the target's own continuations where the drafter is evaluated on what it serves
        self.eval_examples, self.eval_on = heldout_examples(cfg, self.target, eval_examples)
        self.tokenizer = tokenizer
        self.provenance = {"target": cfg.target, "data": cfg.data.path, **(provenance or {})}
        self.losses: list[float] = []
        self.evals: list[dict] = []
        self.best_tau: float | None = None
        self.skipped_steps: list[int] = []
        self.signal: str | None = None

        # before anything is written into output_dir
        resume = find_resume(cfg.resume_from, self.out, self.main)
        drafter.to(self.acc.device)
        drafter.loss_chunk_tokens = cfg.loss_chunk_tokens  # a memory setting: the loss is the same
        # the latest evaluation's held-out statistics, saved with every checkpoint
        self.heldout: dict = {}
        if resume is not None:
            self.heldout = load_weights(drafter, resume, target.fingerprint, self.acc.device)
        optimizer = torch.optim.AdamW(
            lr_schedule.param_groups(drafter, cfg),
            lr=lr_schedule.lr_at(0, cfg),
            betas=(cfg.adam_beta1, cfg.adam_beta2),
        )
        self.start_step = 0
        self.model, self.optimizer = self.acc.prepare(drafter, optimizer)
        if resume is not None:  # after prepare: a DeepSpeed optimizer has its own state format
            state = load_state(
                self.optimizer, resume, global_batch=self._global_batch(), seed=cfg.seed,
                sharded=self._sharded(), world=self.world, device=self.acc.device,
            )  # fmt: skip
            self.losses, self.evals = list(state["losses"]), list(state["evals"])
            self.best_tau = state["best_tau"]
            self.skipped_steps = list(state.get("skipped_steps", []))
            self.start_step = int(state["step"])
            if self.main:
                print(
                    f"[specdraft] resuming from {resume} at step {self.start_step}", file=sys.stderr
                )
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            for stale in self.out.glob(".*.tmp-*"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            self.config_yaml = save_config(cfg, self.out / CONFIG_FILENAME).read_text()
        tracking.init_trackers(self.acc, cfg, self.out)

    # -- the loop -----------------------------------------------------------------------------

    def run(self) -> TrainResult:
        cfg = self.cfg
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        bar = tqdm(
            total=cfg.max_steps, initial=self.start_step, disable=not self.main, desc=f"train {cfg.kind}",
            dynamic_ncols=True, file=sys.stderr,
        )  # fmt: skip
        try:
            # A drafter may arrive in eval mode (from_pretrained leaves a model so), and a resumed
            # run skips the step-0 evaluation that would switch it: train mode from the start,
            # so dropout is the same whether or not the run was interrupted.
            self.model.train()
            evaluates = cfg.eval_every > 0 and bool(self.eval_examples)
            if evaluates and self.start_step == 0:
                self._evaluate(0, bar, label="before training")
            step = self.start_step
            # (tokens, seconds, target forward share) of the steps after the first, which warms up
            # (allocations, kernels): a few numbers a step, as `losses` keeps
            timed: list[tuple[float, float, float]] = []
            while step < cfg.max_steps:
                logs = self._step(step)
                if self.skipped_steps and self.skipped_steps[-1] == step:
                    bar.write(
                        f"[specdraft] step {step + 1}: the gradients were not finite, so the step "
                        f"was skipped ({len(self.skipped_steps)} so far; routine with fp16)",
                        file=sys.stderr,
                    )
                if step > self.start_step:
                    timed.append(
                        (logs["tokens"], logs["step_time_s"], logs["target_forward_share"])
                    )
                step += 1
                self.losses.append(logs["loss"])
                bar.update(1)
                bar.set_postfix(
                    loss=f"{logs['loss']:.4f}",
                    lr=f"{logs['lr']:.2e}",
                    tok_s=f"{logs['tokens_per_s']:.0f}",
                )
                if step % cfg.log_every == 0 or step == cfg.max_steps:
                    self.acc.log({f"train/{k}": v for k, v in logs.items()}, step=step)
                if evaluates and (step % cfg.eval_every == 0 or step == cfg.max_steps):
                    self._evaluate(step, bar)
                stop = self._agreed_signal()
                if stop or (
                    cfg.save_every > 0 and step % cfg.save_every == 0 and step < cfg.max_steps
                ):
                    self._save_checkpoint(step)
                if stop:
                    bar.write(
                        f"[specdraft] {stop}: saved {self.out / f'checkpoint-{step}'}; rerun with "
                        "resume_from=latest to continue", file=sys.stderr,
                    )  # fmt: skip
                    self.signal = stop
                    break
            if self.signal is None:
                self._save_checkpoint(step)  # the end state is resumable too (e.g. to extend)
                self._save_drafter(self.out / "final", step)
            throughput = launch.throughput(timed, self.acc.device)
            if self.main and throughput:  # what training cost, for scripts/compare.py
                runs_target = self.acc.unwrap_model(self.model).runs_target
                tracking.record_throughput(self.out, throughput, self.world, runs_target, bar)
        finally:
            bar.close()
            # Not acc.end_training(): it also destroys the process group, which is the caller's.
            for tracker in self.acc.trackers:
                tracker.finish()
            for s, handler in previous.items():
                signal.signal(s, handler)
        self.acc.wait_for_everyone()
        return TrainResult(
            step=step, losses=self.losses, evals=self.evals, best_tau=self.best_tau,
            stopped_by_signal=self.signal, output_dir=self.out, main_process=self.main,
            throughput=throughput, skipped_steps=list(self.skipped_steps),
        )  # fmt: skip

    def _step(self, step: int) -> dict[str, float]:
        """One optimizer step: grad_accum micro-batches, their loss sums over the global token count."""
        cfg, acc = self.cfg, self.acc
        t_start = time.perf_counter()
        seed = lr_schedule.step_seed(cfg.seed, step, self.rank)
        torch.manual_seed(seed)
        generator = torch.Generator(acc.device).manual_seed(seed)
        # the same on every process: for decisions that change which forwards run
        shared = torch.Generator(acc.device).manual_seed(lr_schedule.step_seed(cfg.seed, step, -1))
        lr = lr_schedule.lr_at(step, cfg)
        for group in self.optimizer.param_groups:  # a group waiting for its start trains nothing
            started = step >= group.get("start_step", 0)
            group["lr"] = lr * group.get("lr_scale", 1.0) if started else 0.0

        unwrapped = acc.unwrap_model(self.model)
        unwrapped.begin_step(step, cfg.max_steps)  # a schedule inside the loss (LayerSkip's)
        batches = []
        for micro in range(cfg.grad_accum):
            idx = lr_schedule.examples_for(
                step, micro, self.rank, len(self.train_examples), cfg, self.world
            )
            batch = lr_schedule.collate([self.train_examples[i] for i in idx], acc.device)
            batch["example_index"] = torch.tensor(idx, device=acc.device)
            batch = unwrapped.prepare_batch(batch, self.target, generator, shared)
            batches.append(batch)
        # The step's loss is the mean over every scored token of the global batch, whatever the
        # split into processes and micro-batches: each micro-batch's loss sum is divided by the
        # global count (x world, because DDP averages gradients), known before the first
        # backward because the drafter counts its tokens from the batch alone.
        counts = [unwrapped.loss_tokens(b) for b in batches]
        global_tokens = acc.reduce(torch.stack(counts).sum(), reduction="sum").clamp(min=1)

        loss_sum = torch.zeros((), device=acc.device)
        metric_sums: dict[str, torch.Tensor] = {}  # name -> stacked (sum, count)
        target_time = 0.0
        for batch in batches:
            t0 = time.perf_counter()
            target_out = self._target_out(unwrapped, batch)
            launch.sync(acc.device)
            target_time += time.perf_counter() - t0
            # accumulate() syncs gradients (DDP all-reduce, DeepSpeed step) on the last
            # micro-batch only; backward divides by grad_accum, which the weight undoes.
            with acc.accumulate(self.model):
                with acc.autocast():
                    loss, metrics = self.model(batch, target_out)
                acc.backward(loss * (self.world * cfg.grad_accum / global_tokens))
            loss_sum += loss.detach().float()
            for k, (total, n) in metrics.items():
                metric_sums[k] = metric_sums.get(k, 0) + torch.stack([total, n]).float()

        total = acc.reduce(loss_sum, reduction="sum") / global_tokens
        if not math.isfinite(float(total)):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteLossError(
                f"step {step + 1}: the loss is {float(total)}. Nothing was saved for this step; "
                f"the last good checkpoint in {self.out} is intact. Lower lr (or raise "
                "warmup_steps), check the data for empty or extreme rows, or use "
                "mixed_precision=no, then resume with resume_from=latest."
            )
        if not self._sharded():
            # a group before its start_step (Medusa-2's adapters in the heads' warm-up): no
            # gradient, so AdamW leaves its weights and moments alone (ZeRO keeps its own
            # gradient buffers; there the group's zero lr holds its weights)
            for group in self.optimizer.param_groups:
                if step < group.get("start_step", 0):
                    for p in group["params"]:
                        p.grad = None
        # (DeepSpeed clips inside its own step and reports the norm it saw.)
        grad_norm = acc.clip_grad_norm_(self.params, cfg.max_grad_norm or float("inf"))
        grad_norm = float(grad_norm) if grad_norm is not None else 0.0
        # A finite loss with gradients that are not: with fp16 the grad scaler's overflow step,
        # which it skips (lowering its scale) and which is routine; otherwise skipped here, so no
        # inf or nan reaches the weights. Either way the step is counted, not fatal.
        if acc.scaler is not None:
            self.optimizer.step()
            skipped = bool(self.optimizer.step_was_skipped)
        else:
            skipped = not math.isfinite(grad_norm)
            if not skipped:
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if skipped:
            self.skipped_steps.append(step)

        launch.sync(acc.device)
        elapsed = time.perf_counter() - t_start
        tokens = acc.reduce(
            torch.stack([b["attention_mask"].sum().float() for b in batches]).sum(), reduction="sum"
        )
        logs = {
            "loss": float(total),
            "lr": lr,
            "grad_norm": grad_norm,
            "skipped_steps": float(len(self.skipped_steps)),
            "tokens_per_s": float(tokens) / elapsed,
            "target_forward_share": target_time / elapsed,
            "step_time_s": elapsed,
            "tokens": float(tokens),
            "peak_memory_mb": launch.peak_memory_mb(acc.device),
        }
        for k, v in metric_sums.items():
            total, n = acc.reduce(v, reduction="sum")
            if n > 0:  # a figure nothing in the step scored (a head too deep for it) is left out
                logs[k] = float(total / n)
        return logs

    def _target_out(self, drafter, batch: dict[str, torch.Tensor], training: bool = True):
        """The target's forward for `batch` (no gradients), or, while training, None for a
        drafter that runs the target inside its own loss (`runs_target`: Medusa-2, whose
        adapters train through it). Evaluation always gets the forward: one pass serves the
        loss, the acceptance and the statistics."""
        if training and drafter.runs_target:
            return None
        layers, keep = list(drafter.capture_layers), 0
        if not drafter.reads_target_logits:  # the loss makes them from the final state
            layers += [] if self.target.num_layers in layers else [self.target.num_layers]
            keep = 1 if training else 0  # evaluation's acceptance reads them all
        with self.acc.autocast():
            return self.target.forward(
                batch["input_ids"], **target_inputs(batch),
                capture_layers=layers, logits_to_keep=keep,
            )  # fmt: skip

    # -- evaluation ---------------------------------------------------------------------------

    @torch.no_grad()
    def _evaluate(self, step: int, bar, label: str = "") -> dict:
        """Held-out loss and simulated acceptance, over the first eval_batches micro-batches."""
        cfg, acc = self.cfg, self.acc
        model = acc.unwrap_model(self.model)
        n = len(self.eval_examples)
        if cfg.eval_batches:  # eval_batches per process: the same examples for any split
            n = min(n, cfg.eval_batches * cfg.micro_batch_size * self.world)
        chunks = list(lr_schedule.eval_chunks(n, self.rank, self.world, cfg.micro_batch_size))
        forward = partial(self._target_out, model, training=False)
        sums = heldout.sums(model, chunks, self.eval_examples, forward, cfg, acc)
        # saved with every checkpoint from now on (best/ below); nothing is written on the module
        self.heldout = model.heldout_summary(sums["extra"])
        alphas = (sums["alpha"] / sums["count"].clamp(min=1)).tolist()
        agreement = (sums["greedy"] / sums["count"].clamp(min=1)).tolist()
        result = {
            "step": step,
            "loss": float(sums["loss"] / sums["tokens"].clamp(min=1)),
            "tau": simulated_tau(alphas),
            "alpha": alphas,
            "tau_greedy": simulated_tau(agreement),
            "alpha_greedy": agreement,
            "eval_on": self.eval_on,
            "greedy_simulation": "agreement",  # the product of agreement per depth
            "sampled_simulation": "acceptance",  # alpha per depth as a chain of gamma
        }
        if self.eval_on == SERVED_GREEDY:  # the loop's own steps, walked on the continuations
            served, how = heldout.simulate_serving(
                model, self.heldout, chunks, self.eval_examples, forward, self.target, cfg, acc,
            )  # fmt: skip
            if served is not None:
                result["tau_greedy"] = served.tau
                result["alpha_greedy"] = served.acceptance_per_position
                result["greedy_simulation"] = how
        if self.eval_on == SERVED_SAMPLED:  # the loop's walk in expectation there
            walked = heldout.expected_tau(
                model, self.heldout, chunks, self.eval_examples, forward, cfg, acc
            )
            if walked is not None:
                result["tau"], result["sampled_simulation"] = walked, "walk"
        result["served"] = result[cfg.served_tau_key()]
        self.evals.append(result)
        tracking.log_evaluation(self.acc, self.cfg, result, bar, label)
        # best/: the latest evaluation within best_within of the best so far (train_config.py)
        best = max((e["served"] for e in self.evals[:-1] if e["step"] > 0), default=None)
        if step > 0 and (best is None or result["served"] >= best * (1 - cfg.best_within)):
            self.best_tau = result["served"]
            self._save_drafter(
                self.out / "best", step, extra_provenance={"simulated_tau": result["served"]}
            )
        return result

    # -- saving -------------------------------------------------------------------------------

    def _save_drafter(
        self, folder: Path, step: int, extra_files=None, extra_provenance=None
    ) -> None:
        self.acc.wait_for_everyone()
        # gathering the parameters is a collective under ZeRO-3: every process takes part
        with launch.full_parameters(self.acc, self.model):
            if self.main:
                drafter = self.acc.unwrap_model(self.model)
                checkpoint.save_drafter(
                    drafter,
                    folder,
                    decode=self.cfg.decode,
                    heldout=self.heldout,
                    # a drafter that fine-tunes the target belongs to the fine-tuned one
                    target_fingerprint=drafter.trained_fingerprint(self.target),
                    train_config_yaml=self.config_yaml,
                    provenance={**self.provenance, "steps": step, **(extra_provenance or {})},
                    tokenizer=self.tokenizer,
                    extra_files=extra_files,
                )
        self.acc.wait_for_everyone()

    def _save_checkpoint(self, step: int) -> None:
        """checkpoint-<step>/: the drafter plus optimizer and trainer state, one atomic folder."""
        staging = self.out / f".checkpoint-{step}.tmp-shards"
        extra = optimizer_files(
            self.optimizer, staging, sharded=self._sharded(), rank=self.rank, world=self.world,
            barrier=self.acc.wait_for_everyone,
        )  # fmt: skip
        state = {
            "step": step,
            "losses": self.losses,
            "evals": self.evals,
            "best_tau": self.best_tau,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world,
            "global_batch": self._global_batch(),
            "seed": self.cfg.seed,
        }
        extra[STATE_NAME] = json.dumps(state, indent=1).encode()
        self._save_drafter(self.out / f"checkpoint-{step}", step, extra_files=extra)
        if self.main:
            shutil.rmtree(staging, ignore_errors=True)
            if self.cfg.keep_last > 0:
                for old in checkpoints(self.out)[: -self.cfg.keep_last]:
                    shutil.rmtree(old, ignore_errors=True)

    def _sharded(self) -> bool:
        """DeepSpeed ZeRO: the optimizer state is partitioned, one part per process."""
        return self.acc.distributed_type == DistributedType.DEEPSPEED

    def _global_batch(self) -> int:
        return self.cfg.micro_batch_size * self.cfg.grad_accum * self.world

    # -- signals ------------------------------------------------------------------------------

    def _on_signal(self, signum, _frame) -> None:
        if self.signal is not None:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.signal = signal.Signals(signum).name

    def _agreed_signal(self) -> str | None:
        """The signal any process received, agreed on by all so they save and stop together."""
        mine = torch.tensor([0.0 if self.signal is None else 1.0], device=self.acc.device)
        if self.world > 1:
            mine = self.acc.reduce(mine, reduction="sum")
        if float(mine) > 0:
            self.signal = self.signal or "SIGTERM"
            return self.signal
        return None
