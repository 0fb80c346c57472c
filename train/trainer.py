"""The one training loop, shared by every drafter kind (docs/architecture.md, "Trainer").

`train(cfg, drafter, target, train_examples, eval_examples)` runs it. The loop knows a drafter
only through the hooks `Drafter` declares (drafters/base.py, each with its default): its forward
is its loss, the sum over the batch's scored tokens, with `loss_tokens` counting them from the
batch alone; `acceptance` gives the simulated tau of evaluation at the depth the run will serve
(`cfg.decode`); `prepare_batch`, `begin_step`, `param_groups`, `eval_statistics` /
`finish_evaluation`, `runs_target` and `trained_fingerprint` are there for the kinds that need
them. The parameters with requires_grad are what the optimizer trains.

A batch is a dict of (batch, seq) tensors: input_ids, attention_mask, loss_mask.

Reproducibility rests on one rule: everything random or scheduled is a pure function of the step.
The learning rate is `lr_at(step)`, the examples of a step are a seeded permutation indexed by
the step, and torch's generators are reseeded from (seed, step, rank) before each step. Resuming
therefore needs only the weights, the optimizer state and the step, and a run split over N
processes sees the same global batch as one process; its loss is the sum over the global batch's
scored tokens divided by their all-reduced count, so it is the same exact token mean too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import io
import json
import math
import os
import re
import resource
import shlex
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import (
    DistributedType,
    InitProcessGroupKwargs,
    ProjectConfiguration,
)
from safetensors.torch import load_file
from tqdm.auto import tqdm

from specdraft.config import config_to_dict, save_config
from specdraft.core import check_fingerprint
from specdraft.drafters import checkpoint
from specdraft.drafters.base import Drafter
from specdraft.inference.measure import usable_cores
from specdraft.train.config import CONFIG_FILENAME, TrainConfig

STATE_NAME = "trainer_state.json"
OPTIMIZER_NAME = "optimizer.pt"
_CHECKPOINT_RE = re.compile(r"^checkpoint-(\d+)$")


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became inf/nan; nothing was saved after the last good step."""


class ResumeError(ValueError):
    """resume_from points at nothing usable, or a fresh run would overwrite a previous one."""


@dataclass
class TrainResult:
    step: int  # optimizer steps completed
    losses: list[float]  # training loss of every step from 0, resumed runs included
    # per eval: step, loss, tau and alpha (sampled), tau_greedy and alpha_greedy, and "served":
    # the one of the two that matches how the drafter is served (TrainConfig.served_tau_key)
    evals: list[dict] = field(default_factory=list)
    best_tau: float | None = None  # the best "served" simulated tau, which picked best/
    stopped_by_signal: str | None = None  # "SIGTERM" / "SIGINT" when preempted
    output_dir: Path | None = None
    main_process: bool = True  # False on the other processes of a multi-process run
    # tokens_per_s (all processes), target_forward_share, peak_memory_mb; steps after the first
    throughput: dict = field(default_factory=dict)
    # steps whose gradients were not finite and were not applied (fp16 overflow, mostly)
    skipped_steps: list[int] = field(default_factory=list)


# --- schedules: pure functions of the step -----------------------------------------------------


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Learning rate of optimizer step `step` (0-based): linear warmup, then the decay."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.lr_schedule == "cosine":
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))
    return cfg.lr - (cfg.lr - floor) * progress


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of torch's generators for `step` on process `rank` (fits in 63 bits)."""
    return (seed * 1_000_003 + step * 9_176 + rank * 7_919_111) % (2**63 - 1)


def eval_chunks(n: int, rank: int, world: int, size: int) -> list[tuple[list[int], float]]:
    """The held-out micro-batches of process `rank`: (example indices, weight) pairs.

    Every process runs the same number of forwards (ZeRO-3 gathers parameters in each one, so
    a process that stopped early would leave the others waiting forever), and each example of
    range(n) counts once over all processes: a process with fewer examples of its own pads with
    example 0 at weight 0.
    """
    mine = list(range(rank, n, world))
    chunks = max(1, math.ceil(math.ceil(n / world) / size))
    return [
        (mine[i * size : (i + 1) * size], 1.0) if mine[i * size : (i + 1) * size] else ([0], 0.0)
        for i in range(chunks)
    ]


def examples_for(
    step: int, micro: int, rank: int, n_examples: int, cfg: TrainConfig, world: int
) -> list[int]:
    """Indices of the examples micro-batch `micro` of `step` uses on process `rank`.

    The data is a stream of epochs, each a permutation seeded by (seed, epoch). A step takes the
    next micro_batch_size * grad_accum * world examples; micro-batch m of rank r takes slice
    (m * world + r), so one process with world x the micro-batch sees the same examples per step.
    """
    mb = cfg.micro_batch_size
    start = (step * cfg.grad_accum * world + micro * world + rank) * mb
    indices = []
    for pos in range(start, start + mb):
        epoch, offset = divmod(pos, n_examples)
        indices.append(int(_epoch_order(cfg.seed, epoch, n_examples)[offset]))
    return indices


@functools.lru_cache(maxsize=2)  # a memo of a pure function: the current and the next epoch
def _epoch_order(seed: int, epoch: int, n: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch))


def simulated_tau(alphas: Sequence[float]) -> float:
    """Expected tokens per target pass for per-depth acceptance rates alpha_1..alpha_gamma.

    tau = 1 + sum_k prod_{i<=k} alpha_i; with every alpha_i = alpha this is Leviathan et al.'s
    (1 - alpha^(gamma+1)) / (1 - alpha).
    """
    tau, reach = 1.0, 1.0
    for alpha in alphas:
        reach *= alpha
        tau += reach
    return tau


def collate(examples: Sequence[Any], device: torch.device) -> dict[str, torch.Tensor]:
    """Right-pad examples (input_ids, loss_mask lists) into a batch of (batch, seq) tensors."""
    length = max(len(e.input_ids) for e in examples)
    ids = torch.zeros(len(examples), length, dtype=torch.long)
    attention = torch.zeros_like(ids)
    loss_mask = torch.zeros_like(ids)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids)
        attention[i, :n] = 1
        loss_mask[i, :n] = torch.tensor(e.loss_mask)
    loss_mask[:, 0] = 0  # the first token has nothing before it to predict it from
    return {
        "input_ids": ids.to(device),
        "attention_mask": attention.to(device),
        "loss_mask": loss_mask.to(device),
    }


# --- the loop ----------------------------------------------------------------------------------


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
        run = _Run(cfg, drafter, target, train_examples, eval_examples, tokenizer, provenance)
        return run.run()
    finally:
        torch.set_num_threads(threads)


class _Run:
    """One call of `train`: the prepared objects and the handful of counters the loop updates."""

    def __init__(self, cfg, drafter, target, train_examples, eval_examples, tokenizer, provenance):
        if not train_examples:
            raise ValueError("no training examples: check the data section of the config")
        self.cfg = cfg
        self.acc = Accelerator(
            mixed_precision=cfg.mixed_precision,
            gradient_accumulation_steps=cfg.grad_accum,
            cpu=_cpu_only(),
            log_with=None if cfg.report_to == "none" else cfg.report_to,
            project_config=ProjectConfiguration(
                project_dir=str(cfg.output_dir),
                logging_dir=os.path.join(str(cfg.output_dir), "tensorboard"),
            ),
            kwargs_handlers=_process_group_kwargs(),
        )
        _check_process_group(self.acc)
        if self.acc.device.type == "cpu":
            torch.set_num_threads(_cpu_threads(cfg.cpu_threads, self.acc.num_processes))
            if self.acc.is_main_process:
                print(
                    f"[specdraft] training on CPU: {self.acc.num_processes} process(es) x "
                    f"{torch.get_num_threads()} thread(s) (cpu_threads)",
                    file=sys.stderr,
                )
        if self.acc.distributed_type == DistributedType.DEEPSPEED:
            # There is no DataLoader for accelerate to read these from; the config is the truth.
            ds = self.acc.state.deepspeed_plugin.deepspeed_config
            ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
            ds["gradient_accumulation_steps"] = cfg.grad_accum
            ds["gradient_clipping"] = cfg.max_grad_norm
        self.main = self.acc.is_main_process
        self.world = self.acc.num_processes
        self.rank = self.acc.process_index
        self.out = Path(cfg.output_dir)
        self.target = target.to(self.acc.device)  # a cache stand-in moves only what it uses
        self.train_examples, self.eval_examples = train_examples, eval_examples
        self.tokenizer = tokenizer
        self.provenance = {"target": cfg.target, "data": cfg.data.path, **(provenance or {})}
        self.losses: list[float] = []
        self.evals: list[dict] = []
        self.best_tau: float | None = None
        self.skipped_steps: list[int] = []
        self.signal: str | None = None

        resume = self._find_resume()  # before anything is written into output_dir
        drafter.to(self.acc.device)
        if resume is not None:
            self._load_weights(drafter, resume)
        optimizer = torch.optim.AdamW(
            _param_groups(drafter, cfg), lr=lr_at(0, cfg), betas=(cfg.adam_beta1, cfg.adam_beta2)
        )
        self.start_step = 0
        self.model, self.optimizer = self.acc.prepare(drafter, optimizer)
        if resume is not None:  # after prepare: a DeepSpeed optimizer has its own state format
            self.start_step = self._load_state(self.optimizer, resume)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            for stale in self.out.glob(".*.tmp-*"):  # left by a crash mid-save
                shutil.rmtree(stale, ignore_errors=True)
            self.config_yaml = save_config(cfg, self.out / CONFIG_FILENAME).read_text()
        # The tracker (main process only): W&B under output_dir/wandb, TensorBoard under
        # output_dir/tensorboard/<run_name>; accelerate's project name is W&B's project and
        # TensorBoard's run folder.
        self.acc.init_trackers(
            cfg.wandb_project if cfg.report_to == "wandb" else str(cfg.run_name),
            config=_tracker_config(cfg),
            init_kwargs={
                "wandb": {
                    "name": cfg.run_name, "tags": list(cfg.tags), "dir": str(self.out),
                    "resume": "allow",
                }
            },
        )  # fmt: skip

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
            if self.start_step == 0 and cfg.eval_every > 0 and self.eval_examples:
                self._evaluate(0, bar, label="before training")
            step = self.start_step
            timed = {"tokens": 0.0, "seconds": 0.0, "target_seconds": 0.0, "steps": 0}
            while step < cfg.max_steps:
                logs = self._step(step)
                if self.skipped_steps and self.skipped_steps[-1] == step:
                    bar.write(
                        f"[specdraft] step {step + 1}: the gradients were not finite, so the step "
                        f"was skipped ({len(self.skipped_steps)} so far; routine with fp16)",
                        file=sys.stderr,
                    )
                if step > self.start_step:  # the first step warms up (allocations, kernels)
                    timed["tokens"] += logs["tokens"]
                    timed["seconds"] += logs["step_time_s"]
                    timed["target_seconds"] += logs["target_forward_share"] * logs["step_time_s"]
                    timed["steps"] += 1
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
                if (
                    cfg.eval_every > 0
                    and self.eval_examples
                    and (step % cfg.eval_every == 0 or step == cfg.max_steps)
                ):
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
            throughput = _throughput(timed, self.acc.device)
            if self.main and throughput:  # what training cost, for scripts/compare.py
                (self.out / "throughput.json").write_text(json.dumps(throughput, indent=2) + "\n")
                share = (
                    f"{throughput['target_forward_share']:.0%} of step time in the target forward"
                )
                if self.acc.unwrap_model(self.model).runs_target:
                    share = "the target's forward and backward inside the drafter's loss"
                bar.write(
                    f"[specdraft] throughput over {timed['steps']} steps after the first: "
                    f"{throughput['tokens_per_s']:.0f} tokens/s ({self.world} process"
                    f"{'es' if self.world > 1 else ''}), {share}, peak memory "
                    f"{throughput['peak_memory_mb']:.0f} MiB",
                    file=sys.stderr,
                )
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
        torch.manual_seed(step_seed(cfg.seed, step, self.rank))
        generator = torch.Generator(acc.device).manual_seed(step_seed(cfg.seed, step, self.rank))
        # the same on every process: for decisions that change which forwards run
        shared = torch.Generator(acc.device).manual_seed(step_seed(cfg.seed, step, -1))
        lr = lr_at(step, cfg)
        for group in self.optimizer.param_groups:  # a group waiting for its start trains nothing
            started = step >= group.get("start_step", 0)
            group["lr"] = lr * group.get("lr_scale", 1.0) if started else 0.0

        unwrapped = acc.unwrap_model(self.model)
        unwrapped.begin_step(step, cfg.max_steps)  # a schedule inside the loss (LayerSkip's)
        batches = []
        for micro in range(cfg.grad_accum):
            idx = examples_for(step, micro, self.rank, len(self.train_examples), cfg, self.world)
            batch = collate([self.train_examples[i] for i in idx], acc.device)
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
            _sync(acc.device)
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
        if self.acc.distributed_type != DistributedType.DEEPSPEED:
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

        _sync(acc.device)
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
            "peak_memory_mb": _peak_memory_mb(acc.device),
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
        with self.acc.autocast():
            return self.target.forward(
                batch["input_ids"], attention_mask=batch["attention_mask"],
                capture_layers=drafter.capture_layers,
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
        loss_sum = torch.zeros((), device=acc.device)
        tokens = torch.zeros((), device=acc.device)
        alpha_sum = greedy_sum = count = 0.0
        # A drafter may measure more on the held-out data (Medusa: per-rank head accuracies for
        # its tree): sums of `eval_statistics`, reduced, handed to `finish_evaluation` before
        # best/ is saved, so a checkpoint carries what its own evaluation measured.
        extra_sums: dict[str, torch.Tensor] = {}
        model.eval()
        for chunk, weight in eval_chunks(n, self.rank, self.world, cfg.micro_batch_size):
            batch = collate([self.eval_examples[i] for i in chunk], acc.device)
            target_out = self._target_out(model, batch, training=False)
            with acc.autocast():
                loss, _ = model(batch, target_out)
                a, g, c = model.acceptance(batch, target_out, cfg.decode)
                for key, v in model.eval_statistics(batch, target_out).items():
                    extra_sums[key] = extra_sums.get(key, 0) + v.float() * weight
            loss_sum += loss.float() * weight
            tokens += model.loss_tokens(batch) * weight
            alpha_sum = alpha_sum + a.float() * weight
            greedy_sum = greedy_sum + g.float() * weight
            count = count + c.float() * weight
        model.train()
        loss_sum, tokens = acc.reduce(loss_sum, "sum"), acc.reduce(tokens, "sum")
        alpha_sum, greedy_sum = acc.reduce(alpha_sum, "sum"), acc.reduce(greedy_sum, "sum")
        count = acc.reduce(count, "sum")
        model.finish_evaluation({k: acc.reduce(v, "sum") for k, v in extra_sums.items()})
        alphas = (alpha_sum / count.clamp(min=1)).tolist()
        agreement = (greedy_sum / count.clamp(min=1)).tolist()
        result = {
            "step": step,
            "loss": float(loss_sum / tokens.clamp(min=1)),
            "tau": simulated_tau(alphas),
            "alpha": alphas,
            "tau_greedy": simulated_tau(agreement),
            "alpha_greedy": agreement,
        }
        result["served"] = result[cfg.served_tau_key()]
        self.evals.append(result)
        logs = {
            "eval/loss": result["loss"],
            "eval/simulated_tau": result["tau"],
            "eval/simulated_tau_greedy": result["tau_greedy"],
        }
        logs.update({f"eval/alpha_{i + 1}": a for i, a in enumerate(alphas)})
        self.acc.log(logs, step=step)
        if self.main and self.cfg.report_to == "wandb":
            self.acc.get_tracker("wandb").log_table(
                "eval/alpha_table", columns=["depth", "alpha"],
                data=[[i + 1, a] for i, a in enumerate(alphas)], step=step,
            )  # fmt: skip
        bar.write(
            f"[specdraft] step {step}{' (' + label + ')' if label else ''}: eval loss "
            f"{result['loss']:.4f}, simulated tau {result['tau']:.3f} sampled, "
            f"{result['tau_greedy']:.3f} greedy, for gamma={len(alphas)} (alpha per depth "
            f"{', '.join(f'{a:.3f}' for a in alphas)})",
            file=sys.stderr,
        )
        if step > 0 and (self.best_tau is None or result["served"] > self.best_tau):
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
        with _full_parameters(self.acc, self.model):  # a collective under ZeRO-3: all processes
            if self.main:
                drafter = self.acc.unwrap_model(self.model)
                checkpoint.save_drafter(
                    drafter,
                    folder,
                    decode=self.cfg.decode,
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
        # DeepSpeed ZeRO partitions the optimizer state: every process writes its own part beside
        # the checkpoint (output_dir is shared by every process that saves), and the main
        # process moves the files in, so no process holds another's part in memory.
        sharded = self.acc.distributed_type == DistributedType.DEEPSPEED
        extra: dict[str, bytes | Path] = {}
        if sharded:
            staging = self.out / f".checkpoint-{step}.tmp-shards"
            staging.mkdir(parents=True, exist_ok=True)
            mine = staging / _optimizer_file(sharded, self.rank)
            torch.save(self.optimizer.state_dict(), mine.with_suffix(".part"))
            os.replace(mine.with_suffix(".part"), mine)
            self.acc.wait_for_everyone()
            extra = {
                _optimizer_file(True, r): staging / _optimizer_file(True, r)
                for r in range(self.world)
            }
        else:
            buffer = io.BytesIO()
            torch.save(self.optimizer.state_dict(), buffer)
            extra[OPTIMIZER_NAME] = buffer.getvalue()
        state = {
            "step": step,
            "losses": self.losses,
            "evals": self.evals,
            "best_tau": self.best_tau,
            "skipped_steps": self.skipped_steps,
            "world_size": self.world,
            "global_batch": self.cfg.micro_batch_size * self.cfg.grad_accum * self.world,
            "seed": self.cfg.seed,
        }
        extra[STATE_NAME] = json.dumps(state, indent=1).encode()
        self._save_drafter(self.out / f"checkpoint-{step}", step, extra_files=extra)
        if sharded and self.main:
            shutil.rmtree(self.out / f".checkpoint-{step}.tmp-shards", ignore_errors=True)
        if self.main and self.cfg.keep_last > 0:
            for old in _checkpoints(self.out)[: -self.cfg.keep_last]:
                shutil.rmtree(old, ignore_errors=True)

    # -- resuming -----------------------------------------------------------------------------

    def _find_resume(self) -> Path | None:
        cfg = self.cfg
        existing = _checkpoints(self.out)
        if cfg.resume_from is None:
            if existing:
                raise ResumeError(
                    f"{self.out} already holds {existing[-1].name}; pass resume_from=latest to "
                    "continue that run, or set output_dir to a new folder (nothing was overwritten)"
                )
            return None
        if cfg.resume_from != "latest":
            path = Path(cfg.resume_from).expanduser()
            problem = _resume_problem(path)
            if problem:
                raise ResumeError(
                    f"resume_from={cfg.resume_from}: {problem}. Pass resume_from=latest to use the "
                    f"newest complete checkpoint in {self.out}, or another checkpoint-<step> folder."
                )
            return path
        for path in reversed(existing):
            problem = _resume_problem(path)
            if problem is None:
                return path
            if self.main:
                warnings.warn(f"skipping {path}: {problem}", stacklevel=2)
                print(f"[specdraft] warning: skipping {path}: {problem}", file=sys.stderr)
        if existing:
            raise ResumeError(
                f"resume_from=latest: none of the {len(existing)} checkpoints in {self.out} is "
                "complete (see the warnings above); move them away to start afresh"
            )
        if self.main:
            print(
                f"[specdraft] resume_from=latest: no checkpoint in {self.out} yet, starting fresh",
                file=sys.stderr,
            )
        return None

    def _load_weights(self, drafter, path: Path) -> None:
        """The checkpoint's weights, read straight into the drafter being trained: not through
        load_drafter, whose from_pretrained would build the student partitioned under ZeRO-3
        (a vocabulary of 0 rows), and which drops training-only weights (Medusa-2's adapters).
        The fine-tuned target's adapter hash changes as it trains; the base must match."""
        meta, _ = checkpoint.read_metadata(path)
        if meta is None:
            raise ResumeError(
                f"{path} is not a specdraft checkpoint (no specdraft block in its config.json); "
                "resume from a checkpoint-<step> folder a run wrote"
            )
        expected = dict(meta.get("target_fingerprint") or {})
        expected.pop("adapter", None)
        check_fingerprint(
            expected, self.target.fingerprint, f"the checkpoint {path}", error=ResumeError,
            fix="resume with the target it was trained against",
        )  # fmt: skip
        hf_model = drafter.as_hf_model()
        if hf_model is not None:  # a HF model folder (distill): its own names, maybe sharded
            state: dict[str, torch.Tensor] = {}
            for weights in sorted(path.glob("*.safetensors")):
                state.update(load_file(weights, device=str(self.acc.device)))
            missing, unexpected = _load_fitting(hf_model, state, path, meta, drafter)
            # a tied weight (the LM head of tied embeddings) is saved once, under one name
            ptrs = {k: v.data_ptr() for k, v in hf_model.state_dict(keep_vars=True).items()}
            loaded = {ptrs[k] for k in state if k in ptrs}
            missing = [k for k in missing if ptrs.get(k) not in loaded]
            if missing or unexpected:
                why = f"missing {missing[:5]}, unexpected {unexpected[:5]}"
                raise ResumeError(_misfit(path, meta, drafter, why))
            return
        state = load_file(path / checkpoint.WEIGHTS_NAME, device=str(self.acc.device))
        missing, unexpected = _load_fitting(drafter, state, path, meta, drafter)
        missing = [k for k in missing if k not in set(meta.get("shared_with_target", ()))]
        if missing or unexpected:
            why = f"missing {missing[:5]}, unexpected {unexpected[:5]}"
            raise ResumeError(_misfit(path, meta, drafter, why))

    def _load_state(self, optimizer, path: Path) -> int:
        state = json.loads((path / STATE_NAME).read_text())
        global_batch = self.cfg.micro_batch_size * self.cfg.grad_accum * self.world
        if state["global_batch"] != global_batch or state["seed"] != self.cfg.seed:
            raise ResumeError(
                f"{path} was trained with global batch {state['global_batch']} and seed "
                f"{state['seed']}; this run has {global_batch} and {self.cfg.seed}. The data order "
                "depends on both: resume with the same micro_batch_size x grad_accum x processes "
                "and seed."
            )
        # weights_only: tensors, numbers and (DeepSpeed) three allowlisted classes; no pickle runs.
        sharded = self.acc.distributed_type == DistributedType.DEEPSPEED
        files = [_optimizer_file(sharded, r) for r in range(self.world if sharded else 1)]
        with torch.serialization.safe_globals(_deepspeed_state_classes() if sharded else []):
            states = [
                torch.load(path / f, map_location=self.acc.device, weights_only=True) for f in files
            ]
        # ZeRO's load_state_dict takes every process's part and picks its own.
        optimizer.load_state_dict(states if sharded else states[0])
        self.losses = list(state["losses"])
        self.evals = list(state["evals"])
        self.best_tau = state["best_tau"]
        self.skipped_steps = list(state.get("skipped_steps", []))
        if self.main:
            print(f"[specdraft] resuming from {path} at step {state['step']}", file=sys.stderr)
        return int(state["step"])

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


def _load_fitting(module, state: dict, path: Path, meta: dict, drafter) -> tuple[list, list]:
    """module.load_state_dict(state, strict=False)'s (missing, unexpected), with a weight of
    another shape a ResumeError naming the settings that differ."""
    try:
        return module.load_state_dict(state, strict=False)
    except RuntimeError as err:
        if "size mismatch" not in str(err):
            raise
        raise ResumeError(_misfit(path, meta, drafter, err)) from err


def _misfit(path: Path, meta: dict, drafter, why) -> str:
    """Why a checkpoint's weights do not fit the drafter this run builds: the drafter settings
    that differ between the two (a saved config's missing keys read as legacy_defaults say),
    each as the command-line override that resumes it, and what to do. Nothing is changed on
    disk."""
    saved = {**type(drafter).legacy_defaults, **(meta.get("config") or {})}
    now = dataclasses.asdict(drafter.config) if dataclasses.is_dataclass(drafter.config) else {}
    differ = _differences(saved, now, "drafter")
    said = "; ".join(str(why).splitlines()[:2])
    if differ:
        listed = ", ".join(f"{key}: {old!r} there, {new!r} here" for key, old, new in differ)
        override = " ".join(
            shlex.quote(
                f"{key}={old if isinstance(old, str) else json.dumps(old, separators=(',', ':'))}"
            )
            for key, old, _ in differ
        )  # YAML on the command line: null, true, [1,2], strings bare
        return (
            f"{path} does not fit the drafter this config builds ({said}). Its drafter settings "
            f"differ: {listed}. Resume with the settings it was trained with ({override}), or "
            "start afresh in a new output_dir; the checkpoint is untouched."
        )
    return (
        f"{path} does not fit the drafter this config builds ({said}); resume with the config "
        "it was trained with, or start afresh in a new output_dir; the checkpoint is untouched."
    )


def _differences(saved: dict, now: dict, prefix: str) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) of every leaf setting that differs; keys only
    one side has are skipped (a newer section's field, an older one's)."""
    out = []
    for key, value in now.items():
        if key not in saved:
            continue
        if isinstance(value, dict) and isinstance(saved[key], dict):
            out += _differences(saved[key], value, f"{prefix}.{key}")
        elif saved[key] != value:
            out.append((f"{prefix}.{key}", saved[key], value))
    return out


def _resume_problem(path: Path) -> str | None:
    """Why `path` cannot be resumed from, or None when it can."""
    if not path.is_dir():
        return "no such folder"
    try:
        checkpoint.check_complete(path)
    except checkpoint.CheckpointError as e:
        return str(e)
    if not any(path.glob("optimizer*.pt")):
        return "it has no optimizer state (a best/ or final/ folder holds weights only, not the resume state)"
    for name in (STATE_NAME,):
        if not (path / name).is_file():
            return f"it has no {name} (a best/ or final/ folder holds weights only, not the resume state)"
    try:
        json.loads((path / STATE_NAME).read_text())
    except json.JSONDecodeError as e:
        return f"{STATE_NAME} is damaged ({e})"
    return None


def _checkpoints(out: Path) -> list[Path]:
    """checkpoint-<step> folders in `out`, oldest step first."""
    if not out.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in out.iterdir() if (m := _CHECKPOINT_RE.match(p.name))]
    return [p for _, p in sorted(found)]


# --- tracking ----------------------------------------------------------------------------------


def _tracker_config(cfg: TrainConfig) -> dict[str, Any]:
    """The config as flat `section.key` values, as W&B and TensorBoard both take it (TensorBoard's
    hparams hold no sections or lists, so a list goes in as its JSON text)."""
    flat: dict[str, Any] = {"kind": cfg.kind}

    def add(values: dict, prefix: str) -> None:
        for key, value in values.items():
            if isinstance(value, dict):
                add(value, f"{prefix}{key}.")
            else:
                flat[prefix + key] = json.dumps(value) if isinstance(value, list) else value

    add(config_to_dict(cfg), "")
    return flat


# --- small helpers -----------------------------------------------------------------------------


def _param_groups(drafter, cfg: TrainConfig) -> list[dict]:
    """AdamW's groups: the drafter's own (`param_groups`: an lr_scale and a start_step each),
    else one group of everything trainable; each split so that only matrices decay."""
    out = []
    for group in drafter.param_groups():
        trainable = [p for p in group["params"] if p.requires_grad]
        extra = {k: v for k, v in group.items() if k != "params"}
        for params, decay in (
            ([p for p in trainable if p.ndim >= 2], cfg.weight_decay),
            ([p for p in trainable if p.ndim < 2], 0.0),
        ):
            if params:
                out.append({"params": params, "weight_decay": decay, **extra})
    return out


def _optimizer_file(sharded: bool, rank: int) -> str:
    return f"optimizer-rank{rank}.pt" if sharded else OPTIMIZER_NAME


def _deepspeed_state_classes() -> list:
    """The classes a DeepSpeed ZeRO optimizer state holds besides tensors and numbers."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


@contextlib.contextmanager
def plain_loading():
    """A context in which from_pretrained loads a whole model, as in a single process, even after
    a ZeRO-3 run: the end of a training script loads the saved checkpoint on the main process
    alone, where ZeRO-3's partitioned loading would wait for the other processes forever.
    (accelerate leaves transformers' DeepSpeed config set after training; transformers loads
    partitioned while it is set, whatever accelerate's zero3_init flag says.)"""
    from transformers.integrations import deepspeed as hf_deepspeed

    saved = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = saved


def _full_parameters(acc: Accelerator, model):
    """Under ZeRO-3, gather the partitioned parameters for saving; otherwise nothing to do."""
    plugin = (
        acc.state.deepspeed_plugin if acc.distributed_type == DistributedType.DEEPSPEED else None
    )
    if plugin is None or plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def _cpu_threads(asked: int, processes: int) -> int:
    """Threads for a CPU training process: `asked` (cpu_threads) when > 0; else OMP_NUM_THREADS
    where the user set it for a plain `python` run; else the physical cores this process may use
    shared by the processes on this machine, as `accelerate launch --cpu` counts them. Under
    `accelerate launch` OMP_NUM_THREADS is the launcher's (1 without --cpu, or what was passed
    to it), which a child cannot tell from a choice: cpu_threads is the way to ask there."""
    if asked > 0:
        return asked
    launched = any(k in os.environ for k in ("ACCELERATE_MIXED_PRECISION", "ACCELERATE_USE_CPU"))
    if "OMP_NUM_THREADS" in os.environ and not launched:
        return torch.get_num_threads()
    local = next(
        (int(os.environ[k]) for k in _LOCAL_SIZE_VARS if os.environ.get(k, "").isdigit()),
        processes,
    )
    cores = usable_cores()
    with contextlib.suppress(ImportError):
        import psutil  # accelerate's own dependency

        cores = min(cores, psutil.cpu_count(logical=False) or cores)
    return max(1, cores // max(1, local))


# Processes on this machine, as torchrun and the MPI launchers accelerate supports report them.
_LOCAL_SIZE_VARS = (
    "LOCAL_WORLD_SIZE", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "MV2_COMM_WORLD_LOCAL_SIZE",
)  # fmt: skip


def _cpu_only() -> bool:
    """True on a machine without CUDA, unless DeepSpeed was asked for.

    Without a GPU, accelerate picks no process-group backend unless told cpu=True, and every
    process would then think it is the main one; cpu=True gives MULTI_CPU over gloo. cpu=True
    would also silently drop a DeepSpeed config, so DeepSpeed is left to itself.
    """
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return not torch.cuda.is_available() and not deepspeed


def _process_group_kwargs() -> list:
    """DeepSpeed on several CPU processes: accelerate selects no process-group backend without a
    GPU (and then runs every process as the only one), so name gloo, which DeepSpeed's CPU
    accelerator uses when oneCCL is not installed."""
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if deepspeed and several and not torch.cuda.is_available():
        return [InitProcessGroupKwargs(backend="gloo")]
    return []


def _check_process_group(acc: Accelerator) -> None:
    """Refuse to run when accelerate and torch.distributed disagree on the number of processes."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world != acc.num_processes:
            raise RuntimeError(
                f"torch.distributed has {world} processes but accelerate sees {acc.num_processes} "
                f"({acc.distributed_type}): every process would act as the main one and write the "
                "same files. This happens with DeepSpeed on a machine without GPUs (accelerate "
                "selects no backend there). Run DeepSpeed with one process on CPU, or use "
                "configs/accelerate/cpu_2proc.yaml for several CPU processes."
            )


def _throughput(timed: dict, device: torch.device) -> dict:
    if not timed["steps"]:
        return {}
    return {
        "tokens_per_s": timed["tokens"] / timed["seconds"],
        "target_forward_share": timed["target_seconds"] / timed["seconds"],
        "peak_memory_mb": _peak_memory_mb(device),
        "steps": timed["steps"],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
