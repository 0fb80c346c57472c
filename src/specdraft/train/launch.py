"""Where a training process runs: the launcher's environment (accelerate, torchrun, MPI,
DeepSpeed), CPU threads, the process group, ZeRO-3 parameter gathering, and what the hardware
measured (throughput, peak memory). The loop (train/trainer.py) asks these; none of them trains.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import DistributedType, InitProcessGroupKwargs, ProjectConfiguration

from specdraft.config import SHIPPED_CONFIGS
from specdraft.measuring.measure import usable_cores
from specdraft.train.train_config import TrainConfig


def make_accelerator(cfg: TrainConfig) -> Accelerator:
    """The run's Accelerator: mixed precision, gradient accumulation, the tracker, the process
    group a CPU or DeepSpeed run needs, and on a CPU the threads (cpu_threads) it trains with.

    accelerate keeps one AcceleratorState per process, fixed by its first Accelerator (a later
    one with another mixed_precision is an error): each run starts from none, so that two runs
    in one process (scripts/compare.py trains every family in its own) each get their own
    config. The process group (accelerate's PartialState) is kept."""
    AcceleratorState._reset_state()
    GradientState._reset_state()
    find_shipped_deepspeed_config()
    # Without a GPU accelerate picks no process-group backend unless told cpu=True (every process
    # would then think it is the main one); cpu=True gives MULTI_CPU over gloo, but would silently
    # drop a DeepSpeed config, so several DeepSpeed processes get gloo named instead (which
    # DeepSpeed's CPU accelerator uses when oneCCL is not installed).
    deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    no_gpu = not torch.cuda.is_available()
    several = int(os.environ.get("WORLD_SIZE", "1")) > 1
    gloo = [InitProcessGroupKwargs(backend="gloo")] if deepspeed and several and no_gpu else []
    acc = Accelerator(
        mixed_precision=cfg.mixed_precision,
        gradient_accumulation_steps=cfg.grad_accum,
        cpu=no_gpu and not deepspeed,
        log_with=None if cfg.report_to == "none" else cfg.report_to,
        project_config=ProjectConfiguration(
            project_dir=str(cfg.output_dir),
            logging_dir=os.path.join(str(cfg.output_dir), "tensorboard"),
        ),
        kwargs_handlers=gloo,
    )
    check_process_group(acc)
    if acc.device.type == "cpu":
        torch.set_num_threads(cpu_threads(cfg.cpu_threads, acc.num_processes))
        if acc.is_main_process:
            print(
                f"[specdraft] training on CPU: {acc.num_processes} process(es) x "
                f"{torch.get_num_threads()} thread(s) (cpu_threads)",
                file=sys.stderr,
            )
    if acc.distributed_type == DistributedType.DEEPSPEED:
        # There is no DataLoader for accelerate to read these from; the config is the truth.
        ds = acc.state.deepspeed_plugin.deepspeed_config
        ds["train_micro_batch_size_per_gpu"] = cfg.micro_batch_size
        ds["gradient_accumulation_steps"] = cfg.grad_accum
        ds["gradient_clipping"] = cfg.max_grad_norm
    return acc


def find_shipped_deepspeed_config() -> None:
    """Where `accelerate launch` hands over a DeepSpeed config file by the relative path the
    shipped accelerate configs name (configs/deepspeed/zero2.json, relative to the launch
    directory) and no such file is there, the shipped one is read (an installed package has no
    checkout to launch from). Any other missing file is left for accelerate to report."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or path == "none" or os.path.isabs(path) or os.path.exists(path):
        return
    parts = Path(path).parts
    if parts[:1] == ("configs",) and SHIPPED_CONFIGS.joinpath(*parts[1:]).is_file():
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(SHIPPED_CONFIGS.joinpath(*parts[1:]))


@contextlib.contextmanager
def whole_model_loading():
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


def full_parameters(acc: Accelerator, model):
    """Under ZeRO-3, gather the partitioned parameters for saving; otherwise nothing to do."""
    deepspeed = acc.distributed_type == DistributedType.DEEPSPEED
    if not deepspeed or acc.state.deepspeed_plugin.zero_stage != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None)


def cpu_threads(asked: int, processes: int) -> int:
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


def check_process_group(acc: Accelerator) -> None:
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


def throughput(timed: list[tuple[float, float, float]], device: torch.device) -> dict:
    """Training throughput over the timed steps' (tokens, seconds, target forward share), all
    but the first step's: tokens/s, the share of step time in the target forward, peak memory;
    {} when no step was timed."""
    if not timed:
        return {}
    seconds = sum(s for _, s, _ in timed)
    target_seconds = sum(share * s for _, s, share in timed)
    return {
        "tokens_per_s": sum(tokens for tokens, _, _ in timed) / seconds,
        "target_forward_share": target_seconds / seconds,
        "peak_memory_mb": peak_memory_mb(device),
        "steps": len(timed),
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB
