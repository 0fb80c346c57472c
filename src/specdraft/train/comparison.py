"""The drafting families side by side on one target (scripts/compare.py).

A family is a drafter kind with a demo config (configs/KIND/demo.yaml; the kind registry,
drafters/base.py, says which kinds exist). Each is trained in this process by its trainer's own
function (kinds/KIND/KIND_trainer.py's `run`, which `specdraft train KIND` calls) on that config
with an equal budget of training tokens, its printing going to OUTPUT/KIND.log; a family whose
training raises is reported as failed and the others go on. Or it is taken from a folder already
trained. Each one's decoding settings are then chosen by measured tokens/s on this machine
(measuring/tuning.py), and all of them are measured in one process on the same prompts beside plain
decoding, prompt lookup and transformers' own assisted and early-exit generation
(measuring/evaluation.py's runs): greedy, then sampled at temperature 1, and reported
(train/comparison_report.py) one row per family, then every run's own row. With several batch sizes
(`--batch-sizes`) every run is measured at each, as scripts/evaluate.py measures them: the family
table holds the smallest batch size's figures and each family's greedy crossover (the smallest batch
size where it is slower than plain decoding), and batch_sizes.png the greedy sweep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch

from specdraft.config import default_config
from specdraft.drafters.base import Drafter, drafter_kinds, hf_model_kind
from specdraft.formats.checkpoint import read_metadata, set_decode
from specdraft.formats.reading import fine_tuned_target, load_decoding, load_drafter
from specdraft.inference.metrics import simulated_tau
from specdraft.measuring.evaluation import EvalSpec, build_runs, check_batch_sizes
from specdraft.measuring.evaluation_report import make_report
from specdraft.measuring.measure import measure_requests, read_requests, request_ids
from specdraft.measuring.report_writer import Report, write_report
from specdraft.measuring.tuning import default_space, search_decode
from specdraft.simulation.continuations import CORPUS
from specdraft.simulation.serving_parity import folder_simulated_tau
from specdraft.targets.target import DEFAULT_TARGET, load_target
from specdraft.train.comparison_report import (
    GAP_FLAG,
    SAME_PROMPTS_FLAG,
    SAME_PROMPTS_FLAG_T1,
    compare_report,
)
from specdraft.train.entry import Recipe
from specdraft.train.resume import STATE_NAME, checkpoints

# beside a run trained by compare: its wall-clock time and training tokens, so a later
# comparison that takes the folder (--folder) still reports what training it cost
TRAINING_RECORD = "compare_training.json"


def families() -> list[str]:
    """Every registered drafter kind with a demo config to train from, by name."""
    return sorted(k for k in drafter_kinds() if default_config(k).is_file())


@dataclass
class CompareSpec:
    """What scripts/compare.py compares, and how. ValueError names a bad value."""

    target: str = DEFAULT_TARGET  # a packaged target, .gguf, model folder, hub id or demo
    families: tuple[str, ...] = ()  # empty: every family (`families()`)
    budget_tokens: int = 100_000  # training tokens per family (padded length)
    folders: Mapping[str, str] = field(default_factory=dict)  # family -> a folder trained already
    settings: Mapping[str, Sequence[str]] = field(default_factory=dict)  # family -> key=value, ...
    prompts: str = "mt-bench"  # a named set, stdlib-requests, a file, ... (measure.read_requests)
    num_prompts: int = 8  # requests, every turn measured (MT-Bench: one of each category)
    max_new_tokens: int = 128
    tune_prompts: int = 4  # 0: keep the saved decoding settings
    sampled: bool = True  # also measure at temperature 1
    dtype: str | None = None  # the target's, and the drafters' (None: as saved)
    device: str | None = None
    seed: int = 0
    output: str = "runs/compare"
    wandb: str | None = None  # a W&B project to log the report to
    # every run is measured at each batch size (measuring/evaluation.py's EvalSpec.batch_sizes)
    batch_sizes: tuple[int, ...] = (1,)

    def __post_init__(self) -> None:
        self.batch_sizes = check_batch_sizes(self.batch_sizes)
        known = families()
        self.families = tuple(dict.fromkeys(self.families or known))
        for what, names in (
            ("families", self.families),
            ("--folder", self.folders),
            ("--set", self.settings),
        ):
            unknown = [n for n in names if n not in known]
            if unknown:
                raise ValueError(f"{what} {unknown}: choose from {', '.join(known)}")
        if self.budget_tokens < 1 or self.num_prompts < 1 or self.max_new_tokens < 1:
            raise ValueError("--budget-tokens, --num-prompts and --max-new-tokens must be >= 1")
        if self.tune_prompts < 0:
            raise ValueError("--tune-prompts must be >= 0")
        self.eval_spec(0.0)  # too few prompts for the batch sizes: named before any training

    def eval_spec(self, temperature: float, baselines: Sequence[str] = ("ar",)) -> EvalSpec:
        """What one pass of measuring asks of measuring/evaluation.py (drafters added by the
        pass)."""
        return EvalSpec(
            baselines=tuple(baselines), prompts=self.prompts, num_prompts=self.num_prompts,
            max_new_tokens=self.max_new_tokens, temperature=temperature, seed=self.seed,
            batch_sizes=self.batch_sizes,
        )  # fmt: skip


@dataclass
class Family:
    """One family's drafter: where it is, what training it cost, and what training predicted."""

    name: str
    folder: Path | None = None
    error: str | None = None
    train_seconds: float | None = None  # None: not trained by scripts/compare.py
    train_tokens: int | None = None
    train_tokens_per_s: float | None = None
    train_peak_memory_mb: float | None = None
    simulated: list[dict] = field(default_factory=list)  # step, served simulated tau
    alpha_greedy: list[float] = field(default_factory=list)  # the last evaluation's, per depth
    # the text the last evaluation ran on (simulation/continuations.py's names: served-greedy,
    # served-sampled, corpus), which the simulated tau is for
    simulated_on: str | None = None
    quality: dict | None = None  # target_quality.json: the target's held-out loss before/after
    tuned: dict | None = None  # the decoding settings chosen, and what changed
    # training's prediction for the tree the drafter is served with (Drafter.predicted_tree_tau)
    tree_tau: float | None = None
    # training's simulation of serving on the very prompts measured, greedy: at T = 0 it predicts
    # the measured tau exactly where training and serving compute the same (simulation/serving_parity.py)
    simulated_measured: float | None = None
    # and at T = 1 on continuations sampled there: the loop's walk in expectation
    simulated_measured_t1: float | None = None


# --- training ----------------------------------------------------------------------------------


class TrainingFailed(RuntimeError):
    """A family's training raised: the family, what it raised and where its log is."""

    def __init__(self, family: str, cause: BaseException, log: Path) -> None:
        super().__init__(f"{family}: {type(cause).__name__}: {cause} (log: {log})")
        self.family = family


def train_family(
    family: str, target: str, budget_tokens: int, out: Path, overrides: Sequence[str] = ()
) -> Family:
    """Train `family` on `target` with its demo config, `overrides` (key=value over it) and
    about `budget_tokens` tokens, in this process through its trainer's `run`, everything
    it prints going to out/FAMILY.log. Raises TrainingFailed (the family named, the traceback in
    the log) where it raises, and KeyboardInterrupt where a signal stopped it."""
    run_dir = out / family
    log = out / f"{family}.log"
    start = time.perf_counter()
    with log.open("w") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        try:
            recipe = Recipe.of(family)
            cfg = recipe.config(overrides)  # a step's training tokens, padded
            per_step = cfg.micro_batch_size * cfg.grad_accum * cfg.data.max_length
            steps = max(1, math.ceil(budget_tokens / per_step))
            cfg = recipe.config([
                f"target={target}", f"output_dir={run_dir}", f"max_steps={steps}",
                f"eval_every={max(1, steps // 4)}", "save_every=0", "eval_loop.enabled=false",
                # the loop is measured here, not by the run: its simulation still runs on what
                # the drafter serves (the target's own continuations, cached once per target)
                "eval_on=served", "report_to=none", *overrides,
            ])  # fmt: skip
            result = recipe.run(cfg)
        except Exception as e:
            traceback.print_exc()
            raise TrainingFailed(family, e, log) from e
        finally:
            gc.collect()  # the run's models and optimizer, before the next family's
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    if result.stopped_by_signal:
        raise KeyboardInterrupt(f"{family}: stopped by {result.stopped_by_signal}")
    record = {
        "seconds": time.perf_counter() - start,
        "tokens": result.step * per_step,
        "budget_tokens": budget_tokens,
        "steps": result.step,
    }
    (run_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return collect(family, result.output_dir / "final")  # the run's records, as written


def collect(family: str, folder: Path) -> Family:
    """A trained folder's family record: its run's simulated tau over training, throughput and
    quality files, where they exist beside it."""
    meta, _ = read_metadata(folder)  # a clear error for a folder that is no drafter
    kind = meta["kind"] if meta else hf_model_kind().kind  # a plain HF folder: a two-model draft
    if kind != family:
        raise ValueError(f"{folder} holds a {kind} drafter, not {family}")
    found = Family(family, folder=Path(folder))
    run = Path(folder).parent

    def read(path: Path) -> dict | None:
        return json.loads(path.read_text()) if path.is_file() else None

    states = [c / STATE_NAME for c in checkpoints(run) if (c / STATE_NAME).is_file()]
    evals = read(states[-1])["evals"] if states else []
    if evals:  # the simulated tau over training, the last evaluation's greedy agreement per depth
        found.simulated = [{"step": e["step"], "tau": e["served"]} for e in evals]
        found.alpha_greedy = list(evals[-1].get("alpha_greedy") or [])
        # runs from before evaluation could run on the target's continuations ran on the corpus
        found.simulated_on = evals[-1].get("eval_on", CORPUS)
    throughput = read(run / "throughput.json") or {}
    found.train_tokens_per_s = throughput.get("tokens_per_s")
    found.train_peak_memory_mb = throughput.get("peak_memory_mb")
    record = read(run / TRAINING_RECORD)  # trained by scripts/compare.py: what it took
    if record:
        found.train_seconds, found.train_tokens = record["seconds"], record["tokens"]
    found.quality = read(run / "target_quality.json")  # what fine-tuning cost a target it tunes
    return found


# --- tuning and measuring ----------------------------------------------------------------------


def tune_family(found: Family, target, prompts, max_new_tokens: int, log=None) -> None:
    """Choose the family's chain settings by measured tokens/s (gamma, stop rule, int8, copying,
    the kind's own settings such as an exit layer) and save them into its folder. Trees are left
    out: a CPU verifies them at more than they return (BENCHMARKS.md)."""
    decoder = fine_tuned_target(str(found.folder), target) or target
    drafter = load_drafter(found.folder, decoder)
    space = default_space(drafter, decoder)
    space.pop("tree_top_k"), space.pop("tree_budget")
    before = load_decoding(found.folder)
    best, _ = search_decode(
        decoder, drafter, prompts, space, max_new_tokens=max_new_tokens, start=before, log=log
    )
    set_decode(found.folder, best, {"by": "scripts/compare.py", "prompts": len(prompts)})
    old, new = dataclasses.asdict(before), dataclasses.asdict(best)
    found.tuned = {
        "decode": new,
        "changed": {k: [old[k], new[k]] for k in old if old[k] != new[k]},
    }


# The settings a copying drafter's run without copying adds to its folder (its name's suffix).
ALONE = ":lookup_ngram=0,lookup_gamma=0"


def measure_all(
    families: Sequence[Family],
    spec: CompareSpec,
    target,
    requests,
    temperature: float,
    loaded: dict | None = None,
) -> dict:
    """Every trained family plus the baselines on every turn of `requests` at `temperature`, in
    this process: evaluate.py's report, one row per run. Transformers' own methods run greedy only;
    a drafter that copies from the context also runs alone (lookup_ngram=0): what the drafter
    buys by itself, and greedy the tau that training's simulated tau predicts. `loaded`: the
    fine-tuned targets already loaded (evaluate.fine_tuned_target), shared across the passes."""
    hf = ("hf_assisted", "hf_early_exit") if temperature == 0 else ()
    folders = [str(f.folder) for f in families if f.folder is not None]
    eval_spec = dataclasses.replace(
        spec.eval_spec(temperature, ("ar", "prompt_lookup", *hf)), drafters=folders
    )
    runs = build_runs(eval_spec, target, loaded=loaded)
    copying = [f for f in folders if load_decoding(f).lookup_ngram > 0]
    if copying:
        alone = [f"{f}{ALONE}" for f in copying]
        names = {r.name for r in runs}  # the plain decodings already there
        extra = build_runs(
            dataclasses.replace(eval_spec, drafters=alone, baselines=()), target, loaded=loaded
        )
        runs += [r for r in extra if r.name not in names]
    cases = measure_requests(
        runs, requests, target, log=lambda m: print(f"[compare] {m}", file=sys.stderr)
    )
    return make_report(eval_spec, [target], runs, cases=cases, requests=requests)


def served_simulated_tau(found: Family, decode: dict) -> tuple[float | None, str]:
    """(training's simulated greedy tau for the settings the drafter is served with, its basis).

    A tree the kind predicts a tau for (`found.tree_tau`, Medusa's: the expected accepted length
    of that very tree under its heads' measured accuracies) is "served". Otherwise a chain of
    decode's gamma from the greedy agreement per depth the kind predicts for decode
    (`Drafter.served_agreement`: the last evaluation's, or LayerSkip's at decode's exit layer);
    past the deepest depth training measured, that depth's agreement carries on. A tree served
    gets its chain's figure ("chain, served as a tree": a tree accepts more than its chain).
    None where training measured nothing."""
    tree = decode.get("tree_top_k", 1) > 1
    if tree and found.tree_tau is not None:
        return found.tree_tau, "served"
    basis = "chain, served as a tree" if tree else "served"
    kind = drafter_kinds().get(found.name, Drafter)
    alphas = kind.served_agreement(decode, found.alpha_greedy, found.quality)
    if not alphas:
        return None, basis
    # deeper than training measured: its deepest agreement carried on
    alphas = [*alphas, *[alphas[-1]] * (decode["gamma"] - len(alphas))]
    return simulated_tau(alphas[: decode["gamma"]]), basis


def family_rows(families: Sequence[Family], greedy: dict, sampled: dict | None) -> list[dict]:
    """One row per family: the drafter's figures (greedy, and the T = 1 speedup), training cost,
    the target's quality cost, and simulated tau beside measured tau."""

    def row_of(report, found, settings=""):  # a drafter's run is named by its folder
        name = f"{found.folder}{settings}"
        smallest = report["settings"]["batch_sizes"][0]
        rows = [r for r in report["runs"] if r["name"] == name and r["batch_size"] == smallest]
        return rows[0] if rows else None

    multi = len(greedy["settings"]["batch_sizes"]) > 1  # a crossover where a sweep was measured
    out = []
    for found in families:
        row = {"family": found.name, "folder": str(found.folder) if found.folder else None}
        if found.error is not None:
            out.append({**row, "error": found.error})
            continue
        g = row_of(greedy, found)
        s = row_of(sampled, found) if sampled else None
        alone = row_of(greedy, found, ALONE) or g  # the drafter without copying
        alone_t1 = (row_of(sampled, found, ALONE) or s) if s else None
        simulated, basis = served_simulated_tau(found, g["decode"])
        quality = (
            found.quality["fine_tuned_loss"] - found.quality["base_loss"] if found.quality else None
        )
        row.update(
            tau=g["tau"], speedup=g["speedup_vs_ar"], speedup_t1=s["speedup_vs_ar"] if s else None,
            tau_t1=s["tau"] if s else None, speedup_alone=alone["speedup_vs_ar"],
            tau_alone_t1=alone_t1["tau"] if s else None,
            speedup_alone_t1=alone_t1["speedup_vs_ar"] if s else None,
            overhead=g["overhead"], draft_share=g["draft_time_frac"], matches_plain=g["matches_ar"],
            drafted=g["drafted"], accepted=g["accepted"],
            drafted_t1=s["drafted"] if s else None, accepted_t1=s["accepted"] if s else None,
            extra_params=g["extra_params"], extra_memory_mb=g["extra_memory_bytes"] / 2**20,
            acceptance_per_position=g["acceptance_per_position"], decode=g["decode"],
            train_seconds=found.train_seconds, train_tokens=found.train_tokens,
            train_tokens_per_s=found.train_tokens_per_s,
            train_peak_memory_mb=found.train_peak_memory_mb, quality_cost_nats=quality,
            tau_alone=alone["tau"], simulated_tau=simulated, simulated_basis=basis,
            simulated_on=found.simulated_on,
            # a "served" simulation walks the served settings, copying included: it predicts the
            # run with copying; an estimate from agreement per depth predicts the drafter alone
            tau_gap=(simulated / (g if basis == "served" else alone)["tau"] - 1)
            if simulated
            else None,
            simulated_over_training=found.simulated, tuned=found.tuned,
            # on the prompts measured: the gap a train/serve difference alone makes
            simulated_tau_same_prompts=found.simulated_measured,
            tau_gap_same_prompts=found.simulated_measured / first_turn(g)["tau"] - 1
            if found.simulated_measured
            else None,
            simulated_t1_same_prompts=found.simulated_measured_t1,
            # an expectation for the drafter alone (no copying) beside one sampled run
            tau_gap_t1_same_prompts=found.simulated_measured_t1 / first_turn(alone_t1)["tau"] - 1
            if found.simulated_measured_t1 and s
            else None,
            crossover=greedy["crossover"][g["name"]] if multi else None,
        )  # fmt: skip
        out.append(row)
    return out


def first_turn(row: dict) -> dict:
    """A report row's figures on the requests' first turns: the prompts training's simulation
    ran on (the later turns follow answers it never saw). The row itself where single-turn."""
    return row.get("by_turn", {}).get("1", row)


# --- the whole comparison ---------------------------------------------------------------------


def compare(spec: CompareSpec) -> Report:
    """scripts/compare.py's work: train (or take) each family, tune, measure, and write the
    report into spec.output. Returns the report written."""
    # before any training: the prompts exist, fill every batch size and fit the target's context
    spec.eval_spec(0.0).check_prompts(spec.target)
    # a folder that is no drafter, or another family's, named before any training
    taken = {n: collect(n, Path(f)) for n, f in spec.folders.items() if n in spec.families}
    out = Path(spec.output)
    out.mkdir(parents=True, exist_ok=True)
    found: list[Family] = []
    for name in spec.families:
        if name in taken:
            found.append(taken[name])
            continue
        print(f"[compare] training {name} on {spec.target} ({spec.budget_tokens:,} tokens; "
              f"log in {out / f'{name}.log'})", file=sys.stderr)  # fmt: skip
        overrides = spec.settings.get(name, ())
        try:
            found.append(train_family(name, spec.target, spec.budget_tokens, out, overrides))
        except TrainingFailed as e:
            print(f"[compare] failed: {e}", file=sys.stderr)
            found.append(Family(name, error=str(e)))
    target = load_target(spec.target, dtype=spec.dtype, device=spec.device)
    requests = read_requests(spec.prompts, spec.num_prompts)
    # every batch size decodes the same requests in whole batches
    requests = requests[: spec.eval_spec(0.0).prompts_measured(len(requests))]
    # tuning and training's simulation take the first turns (the later ones follow answers)
    prompts = [request_ids(target.tokenizer, r, []).to(target.device) for r in requests]
    trained = [f for f in found if f.folder is not None]
    if spec.tune_prompts:
        for f in trained:
            log = lambda m, n=f.name: print(f"[compare] {n} {m}", file=sys.stderr)  # noqa: E731
            tune_family(f, target, prompts[: spec.tune_prompts], spec.max_new_tokens, log=log)
    loaded: dict = {}  # fine-tuned targets, loaded once for both passes
    for f in trained:
        decode = load_decoding(f.folder)
        if decode.tree_top_k > 1:  # served as a tree: training's prediction for it, as it loads
            decoder = fine_tuned_target(str(f.folder), target, loaded) or target
            f.tree_tau = load_drafter(f.folder, decoder).predicted_tree_tau(decode)
        try:  # a failure here costs the column, not the families trained
            at = partial(folder_simulated_tau, f.folder, target, prompts, spec.max_new_tokens,
                         spec.batch_sizes[0], loaded)  # fmt: skip
            f.simulated_measured = at()
            f.simulated_measured_t1 = at(temperature=1.0) if spec.sampled else None
        except (ValueError, RuntimeError) as e:
            print(f"[compare] {f.name}: no simulation on these prompts: {e}", file=sys.stderr)
    greedy = measure_all(found, spec, target, requests, 0.0, loaded)
    sampled = measure_all(found, spec, target, requests, 1.0, loaded) if spec.sampled else None
    rows = family_rows(found, greedy, sampled)
    turns = greedy["benchmark"]["turns"]
    summary = (
        f"{len(requests)} requests of {spec.prompts}"
        + (f", all {turns} turns of each," if turns > 1 else "")
        + f" x {spec.max_new_tokens} new tokens, {greedy['settings']['dtype']}"
        f" on {greedy['settings']['device']} ({greedy['settings']['torch_threads']} threads); "
        "speedups against plain decoding in the same process (a drafter that fine-tunes the "
        "target decodes with its own fine-tuned model, checked against that model's plain "
        "output). "
        + (
            f"Every run measured at batch sizes {', '.join(map(str, spec.batch_sizes))}, against "
            "plain decoding at the same batch size; the family table at batch size "
            f"{spec.batch_sizes[0]}, with the crossover over all of them. "
            if len(spec.batch_sizes) > 1
            else ""
        )
        + (
            f"Each family trained on about {spec.budget_tokens:,} tokens. "
            if any(r.get("train_tokens") for r in rows)
            else "Folders trained elsewhere. "
        )
        + "τ counts copied drafts too; τ without copying is the drafter alone with the same "
        "settings, greedy and at T = 1. Simulated τ: training's prediction for the served "
        "settings (on served continuations its walk of the loop's steps, copying included; "
        "else greedy agreement per depth, teacher-forced, or for a tree whose kind predicts "
        "one 1 + its expected accepted length under the measured accuracies); the gap is to "
        "the measured τ with copying where training walked the served settings, else to τ "
        f"without copying, (!) where it exceeds {GAP_FLAG:.0%}; (chain): a drafter served "
        "as a tree, for which training predicts its chain's τ only. On the prompts measured, "
        "greedy, the simulation predicts τ exactly where training and serving compute alike: "
        f"a gap there is a train/serve difference, (!) above {SAME_PROMPTS_FLAG:.0%} "
        "(scripts/parity.py names where); at T = 1, on continuations sampled there, the tau "
        "expected of the drafter alone, the loop's walk in expectation over each draft's "
        "chance of acceptance given the tokens emitted (its chain or tree and stop rule as "
        f"served), beside one sampled run: (!) above {SAME_PROMPTS_FLAG_T1:.0%}. Best per "
        "column in bold."
    )
    report = compare_report({
        "target": greedy["target"],
        "summary": summary,
        "families": rows,
        "greedy": greedy,
        "sampled": sampled,
    })  # fmt: skip
    write_report(report, out, spec.wandb)
    return report
