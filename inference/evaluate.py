"""What scripts/evaluate.py measures and how it reports it.

An `EvalSpec` says what to measure; `build_runs` lists the methods it asks for (our plain
decoding `ar` first, the reference for speedups; transformers' generate; prompt lookup; each
drafter, with transformers' assisted decoding beside it); `measure` (inference/measure.py)
decodes the same prompts with each; `make_report` turns them into report.json's rows and
`evaluation_report` into the report inference/report.py writes: report.json, report.md and
three plots. Plots name each run by a
short label (`short_labels`) that report.md and report.json key to its full name; a lossy run
(Medusa's typical acceptance at temperature > 0) has "(lossy)" after its label, a `lossy` flag
and a line of its own in report.md, beside every run's mean log p (the target's log-likelihood
of its output: the drift).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from specdraft.config import override
from specdraft.core import DecodeConfig, eos_ids, owner_of
from specdraft.formats.reading import fine_tuned_target, load_decoding, load_drafter
from specdraft.inference.measure import Run, loop_decoder, summarize
from specdraft.inference.report import Column, Report, acceptance_figure, markdown_table, styles
from specdraft.precision import dtype_name, resolve_precision, to_dtype

BASELINES = ("ar", "hf_ar", "prompt_lookup", "hf_assisted", "hf_prompt_lookup", "hf_early_exit")
# gamma for transformers' prompt lookup when --gamma is not given: our prompt lookup's default
HF_GAMMA = DecodeConfig().gamma
# A run name up to this long is its own label; a longer one is labelled by its method, numbered.
LABEL_CHARS = 16

# --- runs --------------------------------------------------------------------------------------


SHORT_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


@dataclass(frozen=True)
class EvalSpec:
    """What an evaluation measures: the methods, the prompts and how each decodes them
    (scripts/evaluate.py's options, less the target and the output; scripts/compare.py asks for
    one per pass). ValueError names a bad value."""

    # FOLDER[:KEY=VALUE,...] each: a trained drafter, with decoding settings over its saved ones
    drafters: tuple[str, ...] = ()
    # methods beside the drafters (BASELINES); `ar` runs whatever is asked: the reference
    baselines: tuple[str, ...] = ("ar",)
    prompts: str = "demo"  # demo, or a .txt/.json/.jsonl file (measure.read_prompts)
    num_prompts: int = 20
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    # every drafter's draft depth and tree width; None: each drafter's saved setting
    gamma: int | None = None
    tree_top_k: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "drafters", tuple(self.drafters))
        object.__setattr__(self, "baselines", tuple(b for b in self.baselines if b))
        unknown = set(self.baselines) - set(BASELINES)
        if unknown:
            raise ValueError(
                f"unknown baselines {sorted(unknown)}; choose from {','.join(BASELINES)}"
            )
        for flag, value in (("--gamma", self.gamma), ("--tree-top-k", self.tree_top_k)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.max_new_tokens < 1 or self.num_prompts < 1:
            raise ValueError("--max-new-tokens and --num-prompts must be >= 1")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def parse_dtypes(text: str | None, device: str | None = None) -> list[torch.dtype | None]:
    """evaluate.py's --dtype: None (the target's saved precision) or comma-separated names
    ("float32,bfloat16"), each at most once. Asking for bf16 on a CPU without native bf16 prints
    one line saying it is emulated."""
    if text is None:
        return [None]
    names = [d.strip() for d in text.split(",") if d.strip()]
    dtypes = [to_dtype(d) for d in names]  # ValueError names an unknown one
    if not names or len(set(dtypes)) < len(dtypes):
        raise ValueError(f"{text!r}: give each precision once, e.g. float32,bfloat16")
    if torch.bfloat16 in dtypes and device in (None, "cpu"):
        resolve_precision("bf16", "cpu", "decoding")
    return dtypes


def runs_per_precision(spec: EvalSpec, targets: Sequence, loaded: dict | None = None) -> list[Run]:
    """`build_runs` for each loaded target (one per precision); with more than one, every run's
    name ends with its precision ("ar@fp32", "eagle@bf16"). `loaded`: as fine_tuned_target
    takes it."""
    runs = []
    for target in targets:
        name = dtype_name(target.dtype)
        suffix = f"@{SHORT_DTYPE.get(name, name)}" if len(targets) > 1 else ""
        runs += build_runs(spec, target, suffix, loaded)
    return runs


def build_runs(spec: EvalSpec, target, suffix: str = "", loaded: dict | None = None) -> list[Run]:
    """The methods `spec` asks for: `ar` first, then the baselines, then each drafter's runs;
    each run's name ends with `suffix` (the precision, "@bf16", when several are measured) and
    carries the target's dtype."""
    runs = _runs(spec, target, loaded)
    for run in runs:
        run.name += suffix
        run.same_as = None if run.same_as is None else run.same_as + suffix
        run.dtype = dtype_name(target.dtype)
    return runs


def _runs(spec: EvalSpec, target, loaded: dict | None) -> list[Run]:
    baselines = spec.baselines
    gamma = spec.gamma if spec.gamma is not None else HF_GAMMA
    runs = [Run("ar", "ar", _ours(target, spec, None))]  # the reference for speedups, always run
    if "hf_ar" in baselines:
        runs.append(Run("hf_ar", "hf_ar", _hf(target, spec)))
    if "prompt_lookup" in baselines:
        runs.append(Run("prompt_lookup", "prompt_lookup", _ours(target, spec, "prompt_lookup")))
    if "hf_prompt_lookup" in baselines:
        lookup = _hf(target, spec, prompt_lookup_num_tokens=gamma)
        runs.append(Run("hf_prompt_lookup", "hf_prompt_lookup", lookup))
    for drafter in spec.drafters:
        # a fine-tuned target's plain decoding (ar[...]) is run once for all its drafters
        names = {run.name for run in runs}
        runs += [
            r
            for r in drafter_runs(drafter, target, spec, loaded)
            if r.method != "ar" or r.name not in names
        ]
    return runs


def _ours(target, spec: EvalSpec, drafter, decode: DecodeConfig | None = None):
    """A decode through our loop. A trained drafter drafts with `decode`; prompt lookup with the
    global --gamma (None: its default); plain decoding (drafter None) takes no settings."""
    settings = {}
    if drafter is not None and decode is None:
        settings = {"gamma": spec.gamma}
    return loop_decoder(
        target, drafter, max_new_tokens=spec.max_new_tokens, seed=spec.seed,
        temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k, decode=decode,
        **settings,
    )  # fmt: skip


def _hf(target, spec: EvalSpec, model_settings: dict | None = None, **options):
    """A decode through transformers' generate, new tokens cut after the first EOS as ours are.
    `model_settings`: generation-config values transformers reads from the model itself rather
    than from the call (an assistant's num_assistant_tokens), set for each call and put back,
    so runs sharing one model each decode with their own."""
    sample = dict(do_sample=spec.temperature > 0)
    if spec.temperature > 0:
        sample.update(temperature=spec.temperature, top_p=spec.top_p, top_k=spec.top_k)
    eos = eos_ids(target.model)
    config = target.model.generation_config

    def decode(ids):
        torch.manual_seed(spec.seed)  # transformers samples from the global generator
        saved = {k: getattr(config, k, None) for k in model_settings or {}}
        for k, v in (model_settings or {}).items():
            setattr(config, k, v)
        try:
            out = target.model.generate(
                ids, max_new_tokens=spec.max_new_tokens, **sample, **options
            )
        finally:
            for k, v in saved.items():
                setattr(config, k, v)
        return _until_eos(out[0, ids.shape[1] :].tolist(), eos), None

    return decode


def _until_eos(tokens: list[int], eos: set[int]) -> list[int]:
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


# --- one --drafter FOLDER[:KEY=VALUE,...] ------------------------------------------------------


def drafter_runs(
    drafter_spec: str, target, spec: EvalSpec, loaded: dict | None = None
) -> list[Run]:
    """The runs of one drafter FOLDER[:KEY=VALUE,...]: the drafter in our loop with its saved
    decoding defaults, then `spec`'s gamma / tree_top_k, then the KEY=VALUE decoding settings
    (specdraft.core.DecodeConfig keys, read by the config engine as training reads them); then
    transformers' assisted decoding doing what it does, where it has one and `spec` asks for
    it. Raises ValueError (a ConfigError) naming `drafter_spec` and the key for a bad setting."""
    path, items = split_drafter_spec(drafter_spec)
    runs: list[Run] = []
    tuned = fine_tuned_target(path, target, loaded)
    if tuned is not None:
        # Heads trained with the target fine-tuned (Medusa-2), and LayerSkip (the fine-tuned
        # target itself), decode with that target: its own plain decoding is the output they
        # must equal; speedups stay against `ar`, since it costs what the base does per step.
        target = tuned
        # named by the adapter: best/, final/ and each checkpoint of one run hold different ones
        plain = Run(f"ar[adapter {tuned.fingerprint['adapter']}]", "ar", _ours(target, spec, None))
        runs.append(plain)
    drafter = load_drafter(path, target)
    decode = load_decoding(path).replace(gamma=spec.gamma, tree_top_k=spec.tree_top_k)
    for item in items:  # another kind's setting: named with its owner, as everywhere
        key, _, value = item.partition("=")
        if key.strip() not in decode.setting_names() and owner_of(key.strip()) is not None:
            raise ValueError(
                f"--drafter {drafter_spec}: "
                + drafter.decode_class.foreign_setting(
                    key.strip(), value, f"this {drafter.kind} drafter"
                )
            )
    decode = override(decode, items, source=f"--drafter {drafter_spec}")
    name = Path(path).name if Path(path).name not in ("final", "best") else str(path)
    if items:
        name += ":" + ",".join(items)
    params = drafter.num_extra_parameters(target)
    decoding = _ours(target, spec, drafter, decode)
    runs.append(Run(name, drafter.kind, decoding, params, settings=dataclasses.asdict(decode)))
    # transformers' assisted generation doing what this drafter does, where it can
    baseline = drafter.transformers_baseline(decode)
    if baseline is not None and baseline[0] in spec.baselines:
        method, settings, options = baseline
        assisted = _hf(target, spec, settings, **options)
        runs.append(Run(f"{method}[{name}]", method, assisted, params))
    if tuned is not None:  # every method on the fine-tuned target must give its plain output
        for run in runs[1:]:
            run.same_as = runs[0].name
    return runs


def split_drafter_spec(spec: str) -> tuple[str, list[str]]:
    """ "FOLDER[:k=v,k=v]" -> (folder, ["k=v", "k=v"]); a folder name may itself hold a colon."""
    path, sep, tail = spec.rpartition(":")
    if not sep or "=" not in tail:
        return spec, []
    return path, [item.strip() for item in tail.split(",")]


# --- report ------------------------------------------------------------------------------------


def make_report(spec: EvalSpec, targets, runs: Sequence[Run]) -> dict:
    """report.json's content: the target, the settings, and one row of figures per run, each with
    the short `label` the plots name it by. `targets`: the target, or one per precision measured
    (runs carry their dtype; each precision's `ar` comes first among its runs).

    Speedups are honest across precisions: `speedup_vs_ar` is against the *fastest* plain
    decoding measured, whatever its precision, so a bf16 method is never flattered by a slow
    bf16 baseline; `speedup_vs_ar_same_dtype` is against plain decoding in the run's own
    precision. Greedy output is checked (`matches_ar`) against the plain decoding of the run's
    own precision (or its `same_as`): in bf16 a multi-token pass can round a near tie
    differently from a one-token step, and the report says so as measured."""
    targets = list(targets) if isinstance(targets, (list, tuple)) else [targets]
    of_dtype = {dtype_name(t.dtype): t for t in targets}
    greedy = spec.greedy
    by_name = {run.name: run for run in runs}
    plain = {}  # dtype -> that precision's plain decoding
    for run in runs:
        if run.method == "ar" and run.same_as is None:
            plain.setdefault(run.dtype, run)
    fastest = max(plain.values(), key=lambda r: r.stats.new_tokens / r.seconds)
    rows = []
    for run in runs:
        own = plain[run.dtype]
        target = of_dtype.get(run.dtype, targets[0])
        row = summarize(run, fastest, target, greedy, same_as=by_name.get(run.same_as, own))
        row["dtype"] = run.dtype
        row["speedup_vs_ar_same_dtype"] = (run.stats.new_tokens / run.seconds) / (
            own.stats.new_tokens / own.seconds
        )
        rows.append(row)
    for row, label in zip(rows, short_labels(rows), strict=True):
        # a lossy run's speedup is not comparable to the exact ones': every plot says so too
        row["label"] = f"{label} (lossy)" if row["lossy"] else label
    keys = (
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "gamma",
        "tree_top_k",
        "seed",
        "prompts",
    )
    settings = {k: getattr(spec, k) for k in keys}
    settings.update(
        device=str(targets[0].device),
        dtype=", ".join(of_dtype),
        fastest_plain=fastest.name,
        torch_threads=torch.get_num_threads(),
    )
    return {
        "target": {"name": targets[0].name, **targets[0].fingerprint},
        "settings": settings,
        "runs": rows,
    }


def short_labels(rows: Sequence[dict]) -> list[str]:
    """A label per run (rows with `name` and `method`) short enough for a legend or under a bar,
    all different: the name itself when it has at most LABEL_CHARS characters, else the method
    numbered in order (eagle#1, eagle#2, ...); transformers' assisted decoding with a drafter is
    hf[that drafter's label]."""
    labels: list[str] = []
    of_name: dict[str, str] = {}
    for r in rows:
        name, method = r["name"], r["method"]
        drafter = name.removeprefix("hf_assisted[").removesuffix("]")
        if method == "hf_assisted" and drafter in of_name:
            label = f"hf[{of_name[drafter]}]"
        else:
            label = name if len(name) <= LABEL_CHARS else None
        if label is None or label in labels:  # a long name, or the same drafter again
            stem, k = (method, 1) if label is None else (label, 2)
            while f"{stem}#{k}" in labels:
                k += 1
            label = f"{stem}#{k}"
        labels.append(label)
        of_name.setdefault(name, label)
    return labels


# report.md's table: one row per run, named by its label
RUN_COLUMNS = (
    Column("label", "label"),
    Column("name", "run"),
    Column("dtype", "dtype"),
    Column("tau", "tau", "{:.2f}"),
    Column("tokens_per_s", "tokens/s", "{:.1f}"),
    Column("speedup_vs_ar", "speedup", "{:.2f}x"),
    Column("speedup_vs_ar_same_dtype", "same dtype", "{:.2f}x"),
    Column("overhead", "overhead", "{:.2f}"),
    Column("draft_time_frac", "draft time", "{:.0%}"),
    Column("copied_share", "copied", "{:.0%}"),
    Column("extra_params", "extra params", "{:,}"),
    Column("matches_ar", "matches ar"),
    Column("mean_log_p", "mean log p", "{:.3f}"),
    Column("lossy", "lossy", lambda lossy: "yes" if lossy else "no"),
)
# the W&B run's table: these keys of every run
WANDB_KEYS = ("label", "name", "method", "tau", "tokens_per_s", "speedup_vs_ar", "overhead",
              "mean_log_p", "lossy")  # fmt: skip


def evaluation_report(report: dict, runs: Sequence[Run]) -> Report:
    """What scripts/evaluate.py writes (inference/report.py's write_report): `report` as
    report.json, its markdown, and three plots: acceptance per position and the tau
    distribution of the runs that drafted, and every run's speedup with its draft/verify split."""
    # the runs that drafted: each in the same place of report.styles in both plots that show them
    drafted = [
        (r, run)
        for r, run in zip(report["runs"], runs, strict=True)
        if r["acceptance_per_position"]
    ]
    figures = {
        "acceptance_per_position": acceptance_figure([r for r, _ in drafted]),
        "tau_distribution": lambda plt: _tau_distribution(plt, drafted, styles(len(drafted), plt)),
        "speedup": lambda plt: _speedup(plt, report["runs"]),
    }
    return Report(
        report, markdown(report), figures, job_type="evaluate", config=report["settings"],
        table_name="runs", table_keys=WANDB_KEYS, rows=report["runs"],
    )  # fmt: skip


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        f"# Evaluation: {report['target']['name']}",
        "",
        f"{s['max_new_tokens']} new tokens, temperature {s['temperature']}, gamma "
        f"{s['gamma'] if s['gamma'] is not None else 'per drafter'}, "
        f"{s['device']} {s['dtype']}. Speedup: tokens/s over our fastest plain decoding "
        f"(`{s.get('fastest_plain', 'ar')}`), same process, whatever its precision; 'same dtype': "
        "over plain decoding in the run's own precision, which 'matches ar' compares with too; "
        "overhead = tau / speedup - 1; copied = share of target passes whose draft "
        "was copied from the context (lookup_ngram) rather than drafted by the model; mean log "
        "p = the target's mean log-likelihood of the emitted tokens (temperature > 0), which "
        "lossless runs share with `ar` up to noise. The plots name each run by its label.",
        "",
        *runs_markdown(report["runs"]),
    ]
    return "\n".join(lines) + "\n"


def runs_markdown(rows: Sequence[dict]) -> list[str]:
    """The lines of report.md that show `rows` (make_report's runs): their table, which of them
    are lossy, and each drafter's acceptance per position."""
    lines = markdown_table(RUN_COLUMNS, rows)
    lossy = [r["label"] for r in rows if r["lossy"]]
    if lossy:
        lines += [
            "",
            f"**Lossy** (typical acceptance): {', '.join(lossy)}. Their output does not follow "
            "the target's distribution: they trade fidelity (mean log p drifts from the lossless "
            "runs') for speed, so their speedup is not comparable to the exact runs'.",
        ]
    lines += ["", "Acceptance per position (alpha_i):", ""]
    for r in rows:
        if r["acceptance_per_position"]:
            alphas = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            lines.append(f"- {r['label']}: {alphas}")
    return lines


# --- plots -------------------------------------------------------------------------------------


def _tau_distribution(plt, drafted, styles):
    """One small panel per run that drafted: a dozen overlaid histograms cannot be told
    apart."""
    from matplotlib.ticker import MaxNLocator

    n = max(len(drafted), 1)
    ncols = min(n, 3)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(
        nrows, ncols, figsize=(max(3.2 * ncols, 5), 2.2 * nrows + 0.8), sharex=True, sharey=True,
        squeeze=False,
    )  # fmt: skip
    if not drafted:
        axes[0, 0].text(0.5, 0.5, "no run drafted", ha="center", transform=axes[0, 0].transAxes)
    for i in range(n, nrows * ncols):  # no run: no panel, its x axis on the one above
        axes.flat[i].set_visible(False)
        axes.flat[i - ncols].tick_params(labelbottom=True)
    for ax, (r, run), style in zip(axes.flat, drafted, styles, strict=False):
        counts = torch.bincount(torch.tensor(run.stats.emitted_per_pass, dtype=torch.long))[1:]
        share = (counts / counts.sum()).tolist()  # a pass emits at least one token
        ax.bar(range(1, len(share) + 1), share, color=style["color"], width=0.8)
        ax.axvline(r["tau"], color="black", lw=1, ls="--")
        ax.set_title(f"{r['label']}: tau {r['tau']:.2f}", fontsize=10)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("tau distribution (dashed: mean)")
    fig.supxlabel("tokens emitted per target pass")
    fig.supylabel("share of passes")
    fig.tight_layout()
    return fig


def _speedup(plt, rows):
    labels = [r["label"] for r in rows]
    speed = [r["speedup_vs_ar"] for r in rows]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.7 * len(rows) + 2), 4))
    # split by draft time share; transformers' generate reports no split: one grey bar
    draft = [s * (r["draft_time_frac"] or 0.0) for s, r in zip(speed, rows, strict=True)]
    split = [r["draft_time_frac"] is not None for r in rows]
    verify = [s - d if ok else 0 for s, d, ok in zip(speed, draft, split, strict=True)]
    ax.bar(labels, verify, label="verify share", color="tab:blue")
    ax.bar(labels, draft, bottom=verify, label="draft share", color="tab:orange")
    if not all(split):
        whole = [0 if ok else s for s, ok in zip(speed, split, strict=True)]
        ax.bar(labels, whole, label="no split (transformers)", color="tab:gray")
    for i, s in enumerate(speed):
        ax.annotate(f"{s:.2f}x", (i, s), ha="center", va="bottom", fontsize=8,
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_ylim(0, max(*speed, 1.0) * 1.12)  # room for the figures above the bars
    ax.set(ylabel="speedup vs our plain decoding", title="Speedup (bar split: draft / verify)")
    if max(map(len, labels)) > 6:
        plt.setp(ax.get_xticklabels(), rotation=30, ha="right", rotation_mode="anchor")
    ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False)
    return fig
