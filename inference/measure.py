"""Measure decoding methods on the same prompts, as docs/architecture.md's "Metrics" define it.

Every method decodes the same prompts in this one process, after a warm-up, with new tokens
counted the same way (up to and including the first EOS); speedups are ratios to our own plain
decoding (`ar`: the loop with no drafter). scripts/evaluate.py compares many methods with this;
`measure_vs_plain` is the one-drafter case the training scripts end with.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdraft.core import DecodeConfig
from specdraft.data.demo import demo_prompts
from specdraft.drafters.base import Drafter
from specdraft.drafters.checkpoint import load_drafter, set_decode
from specdraft.drafters.target import load_target
from specdraft.inference.generate import generate
from specdraft.inference.metrics import Stats
from specdraft.inference.tune import default_space, search_decode
from specdraft.precision import to_dtype


@dataclass
class Run:
    """One method: how it decodes a (1, L) prompt, and what measuring it collected."""

    name: str
    method: str
    decode: Callable[[torch.Tensor], tuple[list[int], Stats | None]]
    extra_params: int = 0
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0
    stats: Stats = field(default_factory=Stats)
    has_stats: bool = True  # False for methods outside our loop (transformers' generate)
    settings: dict | None = None  # the DecodeConfig a trained drafter drafted with, as a dict
    # The run whose outputs this one's must equal when greedy (None: `ar`); a drafter decoding
    # with a fine-tuned target (Medusa-2) names that target's own plain decoding.
    same_as: str | None = None
    # The precision the run's target computes in ("float32", "bfloat16", ...): evaluate.py
    # measures several side by side, each against its own plain decoding and the fastest one.
    dtype: str | None = None


def loop_prompts(eval_loop, data_path: str, target, eval_examples) -> list[torch.Tensor]:
    """The prompts a training script measures its drafter on after training, loaded before
    training starts so that a bad prompt file fails at once. `eval_loop` is the config's
    `LoopEvalConfig`; prompts=auto means the demo's held-out prompts for the demo corpus, else
    the prompt part of the held-out split. Empty when the measurement is off."""
    if not eval_loop.enabled:
        return []
    source = eval_loop.prompts
    if source == "auto":
        source = "demo" if data_path == "demo" else "eval"
    return load_prompts(source, eval_loop.num_prompts, target, eval_examples)


def load_prompts(
    source: str, n: int, target, examples: Sequence | None = None
) -> list[torch.Tensor]:
    """(1, L) token ids for up to n prompts.

    source: "demo" (the demo corpus's held-out prompts), "eval" (the prompt part of held-out
    training examples: the tokens before the first loss-bearing one, or the first half of a
    plain-text example), or a .txt (blank-line separated) / .json / .jsonl file (strings, or
    objects with a "prompt" field).
    """
    if source == "eval":
        if not examples:
            raise ValueError(
                "prompts=eval needs held-out examples, and the data gave none: raise "
                "data.eval_fraction, point eval_loop.prompts at a prompt file, or set "
                "eval_loop.enabled=false"
            )
        prompts = []
        for ex in examples[:n]:
            first = ex.loss_mask.index(1) if 1 in ex.loss_mask else len(ex.input_ids)
            cut = first if first >= 2 else len(ex.input_ids) // 2
            if cut:
                prompts.append(torch.tensor([ex.input_ids[:cut]], device=target.device))
        return prompts
    if source == "demo":
        texts = demo_prompts(n)
    else:
        path = Path(source)
        if not path.is_file():
            raise ValueError(f"prompts {source!r}: no such file (use demo, eval or a file)")
        if path.suffix in (".json", ".jsonl"):
            text = path.read_text()
            rows = (
                json.loads(text)
                if path.suffix == ".json"
                else [json.loads(line) for line in text.splitlines() if line.strip()]
            )
            texts = [r["prompt"] if isinstance(r, dict) else r for r in rows]
        else:  # plain text: prompts separated by blank lines
            texts = [t for t in path.read_text().split("\n\n") if t.strip()]
        texts = texts[:n]
    return [target.tokenizer(t, return_tensors="pt").input_ids.to(target.device) for t in texts]


def loop_decoder(target, drafter, **options) -> Callable[[torch.Tensor], tuple[list[int], Stats]]:
    """A Run's decode through our loop: `generate(target, ids, drafter, **options)`."""

    def decode(ids: torch.Tensor) -> tuple[list[int], Stats]:
        out = generate(target, ids, drafter, **options)
        return out.tokens[0].tolist(), out.stats

    return decode


def measure(runs: Sequence[Run], prompts: Sequence[torch.Tensor], target, log=None) -> None:
    """Decode every prompt with every run, filling in its outputs, seconds and stats; the runs
    take turns on each prompt."""
    sync = torch.cuda.synchronize if target.device.type == "cuda" else lambda: None
    # 1. Warm-up: every method once on a short decode, so no method pays for first-call costs.
    for run in runs:
        run.decode(prompts[0][:, :16])
    # 2. Measure on the same prompts, the methods taking turns on each prompt: a machine whose
    # speed drifts during the measurement (shared cores, thermal limits) slows them alike,
    # where measuring method after method would hand the drift to whichever ran last.
    for i, ids in enumerate(prompts):
        for run in runs:
            sync()
            start = time.perf_counter()
            tokens, stats = run.decode(ids)
            sync()
            run.seconds += time.perf_counter() - start
            run.outputs.append(tokens)
            if stats is None:
                run.has_stats = False
                stats = Stats(new_tokens=len(tokens))
            run.stats = run.stats.merge(stats)
        if log is not None:
            log(f"prompt {i + 1}/{len(prompts)}: every method decoded it")
    if log is not None:
        for run in runs:
            log(f"{run.name}: {sum(map(len, run.outputs))} tokens")


def summarize(run: Run, ar: Run, target, greedy: bool, same_as: Run | None = None) -> dict:
    """One run's figures beside plain decoding `ar` (measured on the same prompts); greedy
    output is checked against `same_as` when given (the plain decoding of the target the run
    decoded with), else against `ar`."""
    tps = run.stats.new_tokens / run.seconds
    speedup = tps / (ar.stats.new_tokens / ar.seconds)
    tau = run.stats.tau if run.has_stats else (1.0 if run.method == "hf_ar" else None)
    return {
        "name": run.name,
        "method": run.method,
        "tau": tau,
        "acceptance_per_position": run.stats.acceptance_per_position if run.has_stats else [],
        "tokens_per_s": tps,
        "speedup_vs_ar": speedup,
        "overhead": tau / speedup - 1 if tau is not None else None,
        "draft_time_frac": run.stats.draft_time_frac if run.has_stats else None,
        "drafted": run.stats.drafted if run.has_stats else None,
        "accepted": run.stats.accepted if run.has_stats else None,
        "copied_share": (  # None: the drafter never copies; 0.0: it may, and did not
            run.stats.copied_passes / run.stats.target_passes
            if run.has_stats and run.stats.copies and run.stats.target_passes
            else None
        ),
        "extra_params": run.extra_params,
        "decode": run.settings,
        "extra_memory_bytes": run.extra_params * target.dtype.itemsize + run.stats.drafter_kv_bytes,
        "num_prompts": len(run.outputs),
        "new_tokens": run.stats.new_tokens,
        "matches_ar": (run.outputs == (same_as or ar).outputs) if greedy else None,
        # drift beside speedup: lossless sampling keeps the target's mean log p (up to noise)
        "mean_log_p": run.stats.mean_log_p if run.has_stats else None,
        "lossy": run.stats.lossy if run.has_stats else False,
    }


def measure_vs_plain(
    target,
    drafter: Drafter,
    prompts: Sequence[torch.Tensor],
    *,
    max_new_tokens: int,
    log=None,
    **options,
) -> dict:
    """A drafter in our loop against plain decoding on `prompts`: summarize's figures for the
    drafter (tau, speedup_vs_ar, drafted, matches_ar at temperature 0, ...) plus the plain run's
    tokens/s. options go to both generate calls (temperature, seed, ...), except the decoding
    settings (decode=, gamma=, ...), which are the drafter's."""
    drafting = {"decode", *(f.name for f in dataclasses.fields(DecodeConfig))}
    shared = {k: v for k, v in options.items() if k not in drafting}
    ar = Run("ar", "ar", loop_decoder(target, None, max_new_tokens=max_new_tokens, **shared))
    run = Run(
        drafter.kind,
        drafter.kind,
        loop_decoder(target, drafter, max_new_tokens=max_new_tokens, **options),
        drafter.num_extra_parameters(target),
    )
    measure([ar, run], prompts, target, log)
    row = summarize(run, ar, target, greedy=options.get("temperature", 0.0) == 0)
    row["ar_tokens_per_s"] = ar.stats.new_tokens / ar.seconds
    row["ar_mean_log_p"] = ar.stats.mean_log_p
    return {**row, "max_new_tokens": max_new_tokens, **options}


def report_after_training(target, result, prompts, cfg) -> dict | None:
    """The end of a training script (`result` from `train`, `cfg` its config): print the simulated
    tau before and after training, then serve the saved `final/` drafter in our loop against
    plain decoding on `prompts` (from `loop_prompts`), write output_dir/eval_loop.json with the
    simulated tau beside the measured one, and print one line. The drafter decodes with the
    settings saved with it (cfg.decode). Returns the figures, or None where nothing was
    measured."""
    if result.stopped_by_signal or not result.main_process:
        return None
    final = result.output_dir / "final"
    # the simulated tau of the decoding it is measured with (TrainConfig.served_tau_key)
    key = cfg.served_tau_key()
    simulated = result.evals[-1][key] if result.evals else None
    if result.evals:
        first, last = result.evals[0], result.evals[-1]
        kind = "greedy" if key == "tau_greedy" else "sampled"
        print(
            f"[specdraft] simulated {kind} tau (depth {len(last['alpha'])}): before "
            f"{first[key]:.3f}, after {simulated:.3f}; drafter in {final}"
        )
    if not prompts:
        return None
    target.to(target.device)  # whole again where training placed only a part (a cache stand-in)
    dtype = target.saved_dtype if cfg.eval_loop.dtype == "auto" else to_dtype(cfg.eval_loop.dtype)
    if dtype != target.dtype:  # e.g. trained against a bf16 copy, decoded as saved (fp32)
        tuned = target.fingerprint.get("adapter")  # Medusa-2: the base with the run's adapter
        adapter = Path(result.output_dir) / "final" / "adapter" if tuned else None
        target = load_target(cfg.target, dtype=dtype, device=target.device, adapter=adapter)
    threads = torch.get_num_threads()
    if target.device.type == "cpu":
        torch.set_num_threads(cfg.eval_loop.threads or usable_cores())
    try:
        drafter = load_drafter(final, target)
        decode, tuning = drafter.decode, None
        space = {key: default_space(drafter, target)[key] for key in cfg.eval_loop.tune}
        if cfg.eval_loop.tune_budgets:
            space["tree_budget"] = cfg.eval_loop.tune_budgets
        if space:
            # the best settings depend on the hardware as much as on the drafter
            decode, tuning = search_decode(
                target, drafter, prompts[: cfg.eval_loop.tune_prompts], space,
                max_new_tokens=cfg.eval_loop.max_new_tokens, passes=cfg.eval_loop.tune_passes,
                temperature=cfg.eval_loop.temperature, seed=cfg.seed,
            )  # fmt: skip
            best = final.parent / "best"
            tuned = [f for f in (final, best) if f.is_dir()]
            for number, key in dict.fromkeys((r["pass"], r["round"]) for r in tuning):
                rows = [r for r in tuning if (r["pass"], r["round"]) == (number, key)]
                # nothing kept (every candidate changed the output): the incumbent, row 0, stays
                kept = next((r[key] for r in rows if r["kept"]), rows[0][key])
                print(
                    f"[specdraft] {key} by measured tokens/s"
                    + (f" (pass {number})" if number > 1 else "")
                    + ": "
                    + ", ".join(f"{r[key]}: {r['tokens_per_s']:.1f}" for r in rows)
                    + f" -> {kept}"
                )
            print(
                f"[specdraft] (on the first {cfg.eval_loop.tune_prompts} of the prompts measured "
                "below) " + " and ".join(map(str, tuned)) + " now decode with these settings"
            )
            for folder in tuned:  # (their train_config.yaml keeps the settings trained with)
                set_decode(folder, decode)
        m = measure_vs_plain(
            target, drafter, prompts, seed=cfg.seed, decode=decode,
            max_new_tokens=cfg.eval_loop.max_new_tokens, temperature=cfg.eval_loop.temperature,
        )  # fmt: skip
        m["torch_threads"] = torch.get_num_threads()
        m["decode"] = dataclasses.asdict(decode)
        if tuning is not None:
            m["tuning"] = tuning
    finally:
        torch.set_num_threads(threads)
    m["simulated_tau"] = simulated
    path = Path(result.output_dir) / "eval_loop.json"
    path.write_text(json.dumps(m, indent=2) + "\n")
    sim = "none" if simulated is None else f"{simulated:.3f}"
    notes = ""
    if m.get("copied_share") is not None:  # a hybrid: say how much of it was the model
        notes = f", {m['copied_share']:.0%} of passes verified a draft copied from the context"
    if m["lossy"]:  # a speedup bought with output that no longer follows the target
        notes += (
            f"; LOSSY (typical acceptance): mean log p {m['mean_log_p']:.3f} vs plain "
            f"sampling's {m['ar_mean_log_p']:.3f}"
        )
    print(
        f"[specdraft] in the loop on {m['num_prompts']} prompts x "
        f"{m['max_new_tokens']} new tokens: measured tau {m['tau']:.3f} (simulated {sim}), "
        f"speedup {m['speedup_vs_ar']:.2f}x plain decoding ({m['tokens_per_s']:.1f} vs "
        f"{m['ar_tokens_per_s']:.1f} tokens/s, same process, {m['torch_threads']} CPU "
        f"thread(s)){notes}; {path}"
    )
    return m


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS reports one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
