"""The four drafting families side by side on one target (scripts/compare.py).

Each family (two-model distillation, EAGLE-3, Medusa-1, LayerSkip) is trained by its own entry
script with an equal budget of training tokens, in its own process (a family that fails is
reported as failed and the others go on), or taken from a folder already trained. Each one's
decoding settings are then chosen by measured tokens/s on this machine (inference/tune.py), and
all of them are measured in one process on the same prompts beside plain decoding, prompt lookup
and transformers' own assisted and early-exit generation: greedy, then sampled at temperature 1.
The report has one row per family: tau, speedups, overhead, drafting share, extra parameters and
memory, what training cost, what it cost the target (LayerSkip), and the simulated tau training
predicted beside the measured one.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from specdraft.config import load_config
from specdraft.drafters.checkpoint import (
    WEIGHTS_NAME,
    load_decoding,
    load_drafter,
    read_metadata,
    set_decode,
)
from specdraft.drafters.medusa import expected_length, tree_paths
from specdraft.drafters.target import load_target, target_path
from specdraft.inference.evaluate import build_runs, fine_tuned_target, make_report
from specdraft.inference.measure import Run, load_prompts, measure
from specdraft.inference.metrics import simulated_tau
from specdraft.inference.tune import default_space, search_decode

FAMILIES = ("distill", "eagle", "medusa", "layerskip")
# beside a run trained by compare: its wall-clock time and training tokens, so a later
# comparison that takes the folder (--folder) still reports what training it cost
TRAINING_RECORD = "compare_training.json"
TRAIN_DIR = Path(__file__).resolve().parent


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
    quality: dict | None = None  # target_quality.json: the target's held-out loss before/after
    tuned: dict | None = None  # the decoding settings chosen, and what changed


def check_families(names: Sequence[str]) -> list[str]:
    unknown = [n for n in names if n not in FAMILIES]
    if unknown or not names:
        raise ValueError(f"families {unknown or '(none)'}: choose from {', '.join(FAMILIES)}")
    return list(dict.fromkeys(names))


def steps_for(family: str, budget_tokens: int) -> tuple[int, int]:
    """(max_steps, tokens per step) that give `family`'s demo config about `budget_tokens`
    training tokens (padded length: micro_batch_size x grad_accum x data.max_length)."""
    module = importlib.import_module(f"specdraft.train.{family}")
    config_class = next(
        v for k, v in vars(module).items() if k.endswith("TrainConfig") and k != "TrainConfig"
    )
    cfg = load_config(config_class, module.DEFAULT_CONFIG)
    per_step = cfg.micro_batch_size * cfg.grad_accum * cfg.data.max_length
    return max(1, math.ceil(budget_tokens / per_step)), per_step


def train_family(
    family: str, target: str, budget_tokens: int, out: Path, overrides: Sequence[str] = ()
) -> Family:
    # overrides: the family's own key=value settings (scripts/compare.py --set FAMILY:key=value)
    """Train `family` on `target` with its demo config and about `budget_tokens` tokens, in a
    process of its own (its log in out/FAMILY.log); a failure is returned, not raised."""
    steps, per_step = steps_for(family, budget_tokens)
    run_dir = out / family
    cmd = [
        sys.executable, str(TRAIN_DIR / f"{family}.py"), f"target={target}",
        f"output_dir={run_dir}", f"max_steps={steps}", f"eval_every={max(1, steps // 4)}",
        "save_every=0", "eval_loop.enabled=false", "report_to=none", *overrides,
    ]  # fmt: skip
    log = out / f"{family}.log"
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        lines = [line.strip() for line in log.read_text().splitlines() if line.strip()]
        errors = [line for line in lines if "error" in line.lower()] or lines
        message = errors[-1] if errors else f"exit status {proc.returncode}"
        return Family(family, error=f"{message} ({log})")
    record = {"seconds": seconds, "tokens": steps * per_step, "budget_tokens": budget_tokens}
    (run_dir / TRAINING_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return collect(family, run_dir / "final")


def collect(family: str, folder: Path) -> Family:
    """A trained folder's family record: its run's simulated tau over training, throughput and
    quality files, where they exist beside it."""
    meta, _ = read_metadata(folder)  # a clear error for a folder that is no drafter
    kind = (meta or {}).get("kind", "distill")
    if kind != family:
        raise ValueError(f"{folder} holds a {kind} drafter, not {family}")
    found = Family(family, folder=Path(folder))
    run = Path(folder).parent
    states = sorted(run.glob("checkpoint-*/trainer_state.json"), key=_step_of)
    if states:
        evals = json.loads(states[-1].read_text())["evals"]
        found.simulated = [{"step": e["step"], "tau": e["served"]} for e in evals]
        found.alpha_greedy = list(evals[-1].get("alpha_greedy") or []) if evals else []
    if (run / "throughput.json").is_file():
        throughput = json.loads((run / "throughput.json").read_text())
        found.train_tokens_per_s = throughput.get("tokens_per_s")
        found.train_peak_memory_mb = throughput.get("peak_memory_mb")
    if (run / TRAINING_RECORD).is_file():  # trained by scripts/compare.py: what it took
        record = json.loads((run / TRAINING_RECORD).read_text())
        found.train_seconds, found.train_tokens = record["seconds"], record["tokens"]
    if (run / "target_quality.json").is_file():
        found.quality = json.loads((run / "target_quality.json").read_text())
    return found


def _step_of(path: Path) -> int:
    return int(path.parent.name.removeprefix("checkpoint-"))


def tune_family(found: Family, target, prompts, max_new_tokens: int, log=None) -> None:
    """Choose the family's chain settings by measured tokens/s (gamma, stop rule, int8, copying,
    LayerSkip's exit) and save them into its folder. Trees are left out: a CPU verifies them
    at more than they return (BENCHMARKS.md)."""
    tuned_target = fine_tuned_target(str(found.folder), target)
    decoder = tuned_target or target
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
    args: Namespace,
    target,
    prompts,
    temperature: float,
    loaded: dict | None = None,
) -> tuple[dict, list[Run]]:
    """Every trained family plus the baselines on `prompts` at `temperature`, in this process:
    evaluate.py's runs and report (one row per run). Transformers' own methods run greedy only;
    greedy, a drafter that copies from the context also runs alone (lookup_ngram=0): the tau
    that training's simulated tau predicts. `loaded`: the fine-tuned targets already loaded
    (evaluate.fine_tuned_target), shared across the passes."""
    hf = ["hf_assisted", "hf_early_exit"] if temperature == 0 else []
    folders = [f.folder for f in families if f.folder is not None]
    run_args = Namespace(
        **{**vars(args), "temperature": temperature, "drafter": [str(f) for f in folders],
           "baselines": ",".join(["ar", "prompt_lookup", *hf])},
    )  # fmt: skip
    runs = build_runs(run_args, target, loaded=loaded)
    copying = [f for f in folders if load_decoding(f).lookup_ngram > 0]
    if temperature == 0 and copying:
        alone = [f"{f}{ALONE}" for f in copying]
        names = {r.name for r in runs}  # the plain decodings already there
        extra = build_runs(
            Namespace(**{**vars(run_args), "drafter": alone, "baselines": ""}), target,
            loaded=loaded,
        )  # fmt: skip
        runs += [r for r in extra if r.name not in names]
    measure(runs, prompts, target, log=lambda m: print(f"[compare] {m}", file=sys.stderr))
    return make_report(run_args, [target], runs), runs


def served_simulated_tau(found: Family, decode: dict) -> float | None:
    """Training's simulated greedy tau for the settings the drafter is served with (a chain of
    decode's gamma, at decode's exit layer for LayerSkip): from the last evaluation's greedy
    agreement per depth, or for another LayerSkip exit from the per-exit agreement measured at
    the end of training; past the deepest depth training measured, that depth's agreement
    carries on. A Medusa tree's is its own: 1 + the expected accepted length of the very tree it
    is served with, under the per-rank accuracies its training measured (what the tree is built
    from). Another kind's tree gets the chain's figure (training predicts no tree tau for it; a
    tree accepts more than its chain): family_rows marks it. None where training measured
    nothing."""
    if found.name == "medusa" and decode.get("tree_top_k", 1) > 1 and found.folder:
        return medusa_tree_tau(found.folder, decode)
    alphas = found.alpha_greedy
    exit_layer = decode.get("exit_layer", 0)
    if found.name == "layerskip" and exit_layer and found.quality:
        per_exit = found.quality.get("exit_agreement", {}).get("after", {})
        if str(exit_layer) in per_exit:
            alphas = [per_exit[str(exit_layer)]["agreement"]] * decode["gamma"]
    if not alphas:
        return None
    # deeper than training measured: its deepest agreement carried on
    alphas = [*alphas, *[alphas[-1]] * (decode["gamma"] - len(alphas))]
    return simulated_tau(alphas[: decode["gamma"]])


def medusa_tree_tau(folder: Path, decode: dict) -> float | None:
    """1 + the expected accepted length of the tree a Medusa folder is served with, under the
    greedy per-rank accuracies saved in it; None for heads that carry none."""
    with safe_open(str(Path(folder) / WEIGHTS_NAME), framework="pt") as f:
        if "accuracy_greedy" not in f.keys():  # noqa: SIM118 (safe_open has no __contains__)
            return None
        accuracy = f.get_tensor("accuracy_greedy").float()
    if torch.isnan(accuracy).any():
        return None
    paths = tree_paths(accuracy, decode["tree_budget"], decode["gamma"], decode["tree_top_k"])
    return 1 + expected_length(accuracy, paths)


def family_rows(families: Sequence[Family], greedy: dict, sampled: dict | None) -> list[dict]:
    """One row per family: the drafter's figures (greedy, and the T = 1 speedup), training cost,
    the target's quality cost, and simulated tau beside measured tau."""

    def row_of(report, found, settings=""):  # a drafter's run is named by its folder
        rows = [r for r in report["runs"] if r["name"] == f"{found.folder}{settings}"]
        return rows[0] if rows else None

    out = []
    for found in families:
        row = {"family": found.name, "folder": str(found.folder) if found.folder else None}
        if found.error is not None:
            out.append({**row, "error": found.error})
            continue
        g = row_of(greedy, found)
        s = row_of(sampled, found) if sampled else None
        alone = row_of(greedy, found, ALONE) or g  # the drafter without copying
        simulated = served_simulated_tau(found, g["decode"])
        quality = (
            found.quality["fine_tuned_loss"] - found.quality["base_loss"] if found.quality else None
        )
        row.update(
            tau=g["tau"], speedup=g["speedup_vs_ar"], speedup_t1=s["speedup_vs_ar"] if s else None,
            overhead=g["overhead"], draft_share=g["draft_time_frac"], matches_plain=g["matches_ar"],
            extra_params=g["extra_params"], extra_memory_mb=g["extra_memory_bytes"] / 2**20,
            acceptance_per_position=g["acceptance_per_position"], decode=g["decode"],
            train_seconds=found.train_seconds, train_tokens=found.train_tokens,
            train_tokens_per_s=found.train_tokens_per_s,
            train_peak_memory_mb=found.train_peak_memory_mb, quality_cost_nats=quality,
            tau_alone=alone["tau"], simulated_tau=simulated,
            simulated_basis="chain, served as a tree"
            if g["decode"]["tree_top_k"] > 1 and found.name != "medusa" else "served",
            tau_gap=(simulated / alone["tau"] - 1) if simulated and alone["tau"] else None,
            simulated_over_training=found.simulated, tuned=found.tuned,
        )  # fmt: skip
        out.append(row)
    return out


# a simulated tau further than this from the measured one is flagged in report.md
GAP_FLAG = 0.10
# (column, header, format, best: max | min | None)
COLUMNS = (
    ("tau", "τ", "{:.2f}", max),
    ("speedup", "speedup greedy", "{:.2f}x", max),
    ("speedup_t1", "speedup T=1", "{:.2f}x", max),
    ("overhead", "overhead", "{:.2f}", min),
    ("draft_share", "draft time", "{:.0%}", min),
    ("extra_memory_mb", "extra memory", "{:.1f} MiB", min),
    ("train_seconds", "training time", "{:.0f} s", min),
    ("train_tokens", "training tokens", "{:,}", None),
    ("train_peak_memory_mb", "training peak memory", "{:,.0f} MiB", min),
    ("quality_cost_nats", "target's loss cost", "{:+.3f} nats", None),
    ("tau_alone", "τ without copying", "{:.2f}", max),
    ("simulated_tau", "simulated τ", "{:.2f}", None),
    ("tau_gap", "simulated vs measured", "{:+.0%}", None),
)


def markdown(report: dict) -> str:
    """report.md: one table, one row per family, the best value of each column in bold, then the
    baselines and the settings."""
    rows = report["families"]
    ok = [r for r in rows if "error" not in r]
    best = {}
    for key, _, _, pick in COLUMNS:
        values = [r[key] for r in ok if r.get(key) is not None]
        if pick is not None and values:
            best[key] = pick(values)
    lines = [
        f"# The four families on {report['target']['name']}",
        "",
        report["summary"],
        "",
        "| family | " + " | ".join(h for _, h, _, _ in COLUMNS) + " |",
        "| --- | " + " | ".join("---:" for _ in COLUMNS) + " |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['family']} | failed: {r['error']} |" + " |" * (len(COLUMNS) - 1))
            continue
        cells = []
        for key, _, fmt, _ in COLUMNS:
            value = r.get(key)
            text = "-" if value is None else fmt.format(value)
            if key == "simulated_tau" and value is not None and r["simulated_basis"] != "served":
                text += " (chain)"  # a tree served: training predicted its chain's tau only
            if key == "tau_gap" and value is not None and abs(value) > GAP_FLAG:
                text += " (!)"  # training's prediction is off by more than the goal allows
            cells.append(f"**{text}**" if key in best and value == best[key] else text)
        lines.append(f"| {r['family']} | " + " | ".join(cells) + " |")
    lines += ["", "Baselines and every run (greedy):", ""]
    for r in report["greedy"]["runs"]:
        tau = "-" if r["tau"] is None else f"{r['tau']:.2f}"
        lines.append(f"- {r['label']}: {r['speedup_vs_ar']:.2f}x, τ {tau}, {r['name']}")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> None:
    """frontier.png (speedup vs extra memory), tau_vs_speedup.png (with overhead lines),
    acceptance.png (per position, per family), simulated_tau.png (over training, and measured)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["families"] if "error" not in r]
    colors = dict(zip(FAMILIES, plt.get_cmap("tab10").colors, strict=False))
    figures = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ok:
        ax.scatter(r["extra_memory_mb"], r["speedup"], color=colors[r["family"]], s=60)
        ax.annotate(r["family"], (r["extra_memory_mb"], r["speedup"]), xytext=(5, 5),
                    textcoords="offset points")  # fmt: skip
    for r in report["greedy"]["runs"]:
        if r["method"] in ("prompt_lookup", "hf_assisted", "hf_early_exit"):
            mib = r["extra_memory_bytes"] / 2**20  # transformers' assisted: the draft's weights
            ax.scatter(mib, r["speedup_vs_ar"], marker="x", color="grey")
            ax.annotate(r["label"], (mib, r["speedup_vs_ar"]), xytext=(5, -10),
                        textcoords="offset points", fontsize=8, color="grey")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set(xlabel="extra memory (MiB: weights + draft KV cache)",
           ylabel="speedup vs plain decoding (greedy)", title="What each drafter buys for its memory")  # fmt: skip
    ax.grid(alpha=0.3)
    figures["frontier"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    top = max([r["tau"] for r in ok] + [2.0]) * 1.1
    for overhead in (0.0, 0.5, 1.0, 2.0):
        ax.plot([1, top], [1 / (1 + overhead), top / (1 + overhead)], color="grey", lw=0.7, ls=":")
        ax.annotate(f"overhead {overhead:g}", (top, top / (1 + overhead)), fontsize=7, color="grey")
    for r in ok:
        ax.scatter(r["tau"], r["speedup"], color=colors[r["family"]], s=60, label=r["family"])
    ax.set(xlabel="τ (tokens per target pass)", ylabel="speedup (greedy)",
           title="τ against speedup: the gap is drafting and verification cost")  # fmt: skip
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    figures["tau_vs_speedup"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ok:
        alphas = r["acceptance_per_position"]
        ax.plot(range(1, len(alphas) + 1), alphas, marker="o", color=colors[r["family"]],
                label=r["family"])  # fmt: skip
    ax.set(xlabel="draft position", ylabel="acceptance", ylim=(0, 1.05),
           title="Acceptance per position (greedy)")  # fmt: skip
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    figures["acceptance"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    for r in ok:
        sim = r["simulated_over_training"]
        if sim:
            ax.plot([s["step"] for s in sim], [s["tau"] for s in sim], marker=".",
                    color=colors[r["family"]], label=f"{r['family']} simulated")  # fmt: skip
            # what training predicts is the drafter alone: its tau without copying
            ax.scatter(sim[-1]["step"], r["tau_alone"], marker="*", s=120,
                       color=colors[r["family"]])  # fmt: skip
    ax.set(xlabel="training step", ylabel="τ",
           title="Simulated τ over training; ★ measured in the loop, no copying")  # fmt: skip
    ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    figures["simulated_tau"] = fig

    for name, figure in figures.items():
        figure.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")
        plt.close(figure)


def log_wandb(report: dict, out: Path, project: str) -> None:
    """The family table and the plots as one W&B run (its files under out/wandb)."""
    import wandb

    run = wandb.init(project=project, dir=str(out), job_type="compare",
                     config={"summary": report["summary"], "target": report["target"]})  # fmt: skip
    columns = ["family", "error", *(key for key, _, _, _ in COLUMNS)]
    rows = [[r.get(c) for c in columns] for r in report["families"]]
    images = {p.stem: wandb.Image(str(p)) for p in out.glob("*.png")}
    run.log({"families": wandb.Table(columns=columns, data=rows), **images})
    run.finish()


def check_prompts(args: Namespace) -> None:
    """Before any training: the prompts exist and fit the target's context with the new tokens
    (read with the target's tokenizer and config only). ValueError names the problem."""
    from transformers import AutoConfig, AutoTokenizer

    path = target_path(args.target)
    reader = Namespace(tokenizer=AutoTokenizer.from_pretrained(path), device="cpu")
    prompts = load_prompts(args.prompts, args.num_prompts, reader)
    if not prompts:
        raise ValueError(f"--prompts {args.prompts}: no prompts in it")
    limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)
    longest = max(p.shape[1] for p in prompts)
    if limit is not None and longest + args.max_new_tokens > limit:
        raise ValueError(
            f"--prompts {args.prompts}: a prompt of {longest} tokens plus --max-new-tokens "
            f"{args.max_new_tokens} is longer than the target's context ({limit} positions): "
            "shorten the prompts or ask for fewer new tokens"
        )


def compare(args: Namespace) -> dict:
    """scripts/compare.py's work: train (or take) each family, tune, measure, report into
    args.output. Returns the report."""
    check_prompts(args)
    given = dict(args.folders)
    for name, folder in given.items():  # a folder that is no drafter, or another family's
        if name in args.families:
            collect(name, Path(folder))
    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    families: list[Family] = []
    for name in args.families:
        if name in given:
            families.append(collect(name, Path(given[name])))
            continue
        print(f"[compare] training {name} on {args.target} ({args.budget_tokens:,} tokens)",
              file=sys.stderr)  # fmt: skip
        overrides = [item for family, item in args.set if family == name]
        families.append(train_family(name, args.target, args.budget_tokens, out, overrides))
        if families[-1].error:
            print(f"[compare] {name} failed: {families[-1].error}", file=sys.stderr)
    target = load_target(args.target, dtype=args.dtype, device=args.device)
    prompts = load_prompts(args.prompts, args.num_prompts, target)
    if args.tune_prompts:
        for found in families:
            if found.folder is not None:
                tune_family(found, target, prompts[: args.tune_prompts], args.max_new_tokens,
                            log=lambda m, n=found.name: print(f"[compare] {n} {m}", file=sys.stderr))  # fmt: skip
    loaded: dict = {}  # fine-tuned targets, loaded once for both passes
    greedy, _ = measure_all(families, args, target, prompts, 0.0, loaded)
    sampled = None
    if args.sampled:
        sampled, _ = measure_all(families, args, target, prompts, 1.0, loaded)
    rows = family_rows(families, greedy, sampled)
    trained = [r for r in rows if r.get("train_tokens")]
    summary = (
        f"{len(prompts)} prompts x {args.max_new_tokens} new tokens, {greedy['settings']['dtype']}"
        f" on {greedy['settings']['device']} ({greedy['settings']['torch_threads']} threads); "
        "speedups against plain decoding in the same process (LayerSkip decodes with its own "
        "fine-tuned model, checked against that model's plain output). "
        + (
            f"Each family trained on about {args.budget_tokens:,} tokens. "
            if trained
            else "Folders trained elsewhere. "
        )
        + "τ counts copied drafts too; τ without copying is the drafter alone with the same "
        "settings. Simulated τ: training's prediction (greedy agreement per depth at the last "
        "evaluation, teacher-forced) for the served chain, and for a Medusa tree 1 + its "
        "expected accepted length under the heads' measured accuracies; the gap is to τ without "
        f"copying, (!) where it exceeds {GAP_FLAG:.0%}; (chain): another drafter served as a "
        "tree, for which training predicts its chain's τ only. Best per column in bold."
    )
    report = {
        "target": greedy["target"],
        "summary": summary,
        "families": rows,
        "greedy": greedy,
        "sampled": sampled,
    }
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(report))
    plot(report, out)
    if args.wandb:
        log_wandb(report, out, args.wandb)
    return report
