"""What a training run reports: the config as the trackers (W&B, TensorBoard) take it, each
evaluation (logged and printed), and the run's throughput (throughput.json, which
scripts/compare.py reads, and one printed line).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from accelerate import Accelerator

from specdraft.config import config_to_dict
from specdraft.train.train_config import TrainConfig


def init_trackers(acc: Accelerator, cfg: TrainConfig, out: Path) -> None:
    """The tracker (main process only): W&B under output_dir/wandb, TensorBoard under
    output_dir/tensorboard/<run_name>; accelerate's project name is W&B's project and
    TensorBoard's run folder."""
    wandb = {"name": cfg.run_name, "tags": list(cfg.tags), "dir": str(out), "resume": "allow"}
    acc.init_trackers(
        cfg.wandb_project if cfg.report_to == "wandb" else str(cfg.run_name),
        config=tracker_config(cfg),
        init_kwargs={"wandb": wandb},
    )


def tracker_config(cfg: TrainConfig) -> dict[str, Any]:
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


def log_evaluation(acc: Accelerator, cfg: TrainConfig, result: dict, bar, label: str) -> None:
    """One evaluation's figures to the tracker (an alpha table on W&B) and one printed line."""
    step, alphas = result["step"], result["alpha"]
    logs = {
        "eval/loss": result["loss"],
        "eval/simulated_tau": result["tau"],
        "eval/simulated_tau_greedy": result["tau_greedy"],
    }
    logs.update({f"eval/alpha_{i + 1}": a for i, a in enumerate(alphas)})
    acc.log(logs, step=step)
    if acc.is_main_process and cfg.report_to == "wandb":
        acc.get_tracker("wandb").log_table(
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


def record_throughput(out: Path, throughput: dict, world: int, runs_target: bool, bar) -> None:
    """output_dir/throughput.json and the line that says what training cost."""
    (out / "throughput.json").write_text(json.dumps(throughput, indent=2) + "\n")
    share = f"{throughput['target_forward_share']:.0%} of step time in the target forward"
    if runs_target:
        share = "the target's forward and backward inside the drafter's loss"
    bar.write(
        f"[specdraft] throughput over {throughput['steps']} steps after the first: "
        f"{throughput['tokens_per_s']:.0f} tokens/s ({world} process"
        f"{'es' if world > 1 else ''}), {share}, peak memory "
        f"{throughput['peak_memory_mb']:.0f} MiB",
        file=sys.stderr,
    )
