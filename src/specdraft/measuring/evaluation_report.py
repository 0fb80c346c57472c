"""The evaluation's report: report.json's rows and summary (`make_report`), the markdown of
report.md and its sections (runs, batch-size sweep, memory), and its figures; scripts/evaluate.py
and scripts/compare.py write it through report_writer.py. What is measured is evaluation.py's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from specdraft.data.benchmarks import Request
from specdraft.measuring.benchmark_report import breakdown_markdown, category_figure
from specdraft.measuring.evaluation import LABEL_CHARS, UNBATCHED, EvalSpec
from specdraft.measuring.measure import Case, Run, breakdown, case_labels, memory_bound, summarize
from specdraft.measuring.report_writer import (
    Column,
    Report,
    acceptance_figure,
    markdown_table,
    styles,
)
from specdraft.precision import dtype_name

# --- report ------------------------------------------------------------------------------------


def make_report(
    spec: EvalSpec,
    targets,
    runs: Sequence[Run],
    bandwidth: float | None = None,
    cases: Sequence[Case] | None = None,
    requests: Sequence[Request] | None = None,
) -> dict:
    """report.json's content: the target, the settings, one row of figures per run (a method at
    one batch size), each with the short `label` the plots name it by (the same at every batch
    size), and each method's `crossover` batch size. `targets`: the target, or one per precision
    measured (runs carry their dtype; each precision's `ar` comes first among its runs).

    Speedups are honest across precisions: `speedup_vs_ar` is against the *fastest* plain
    decoding measured at the run's batch size, whatever its precision, so a bf16 method is
    never flattered by a slow bf16 baseline; `speedup_vs_ar_same_dtype` is against plain
    decoding in the run's own precision and batch size. Greedy output is checked (`matches_ar`)
    against the plain decoding of the run's own precision and batch size (or its `same_as`): in
    bf16 a multi-token pass can round a near tie differently from a one-token step, and the
    report says so as measured. `bandwidth`: the machine's measured read bandwidth
    (measure.read_bandwidth), against which each precision's plain decoding at batch size 1 is
    set as a fraction of its memory bound (`memory_bound`). `cases` (what measure_requests
    decoded, in order) of `requests`: report.json's `outputs` holds each prompt's text and what
    every run decoded from it at the smallest batch size, so a reader sees what was produced,
    not only how fast; at batch size 1 each row has its figures per category and per turn
    (`breakdown`, against the fastest plain decoding) and report["benchmark"] says what the
    requests were."""
    targets = list(targets) if isinstance(targets, (list, tuple)) else [targets]
    of_dtype = {dtype_name(t.dtype): t for t in targets}
    greedy = spec.greedy
    by_name = {(run.name, run.batch_size): run for run in runs}
    plain = {}  # (dtype, batch size) -> that precision's plain decoding at that batch size
    for run in runs:
        if run.method == "ar" and run.same_as is None:
            plain.setdefault((run.dtype, run.batch_size), run)
    fastest = {}  # batch size -> the fastest plain decoding at it, whatever its precision
    for (_, b), run in plain.items():
        if b not in fastest or run.tokens_per_s > fastest[b].tokens_per_s:
            fastest[b] = run
    rows = []
    for run in runs:
        b = run.batch_size
        own = plain[run.dtype, b]
        target = of_dtype.get(run.dtype, targets[0])
        same_as = by_name.get((run.same_as, b), own)
        row = summarize(run, fastest[b], target, greedy, same_as=same_as)
        row["dtype"] = run.dtype
        row["speedup_vs_ar_same_dtype"] = run.tokens_per_s / own.tokens_per_s
        if cases is not None:
            row.update(breakdown(run, fastest[b], cases))
        rows.append(row)
    # one label per method, the same at every batch size: its lines in the sweep's plot
    first: dict[str, dict] = {}
    for row in rows:
        first.setdefault(row["name"], row)
    label_of = dict(zip(first, short_labels(list(first.values())), strict=True))
    for row in rows:
        # a lossy run's speedup is not comparable to the exact ones': every plot says so too
        label = label_of[row["name"]]
        row["label"] = f"{label} (lossy)" if row["lossy"] else label
    keys = ("max_new_tokens", "temperature", "top_p", "top_k", "gamma", "tree_top_k", "seed")
    settings = {k: getattr(spec, k) for k in (*keys, "prompts")}
    sizes = sorted(fastest)
    settings.update(
        device=str(targets[0].device),
        dtype=", ".join(of_dtype),
        fastest_plain=fastest[sizes[0]].name,
        torch_threads=torch.get_num_threads(),
        batch_sizes=sizes,
        num_prompts=len(runs[0].outputs),
    )
    speedups: dict[str, dict[int, float]] = {}  # method -> batch size -> speedup
    for row in rows:
        if row["method"] != "ar":  # plain decoding, of the base or a fine-tuned target
            speedups.setdefault(row["name"], {})[row["batch_size"]] = row["speedup_vs_ar"]
    if bandwidth is not None:
        settings["memory_bound"] = {
            dtype: memory_bound(of_dtype.get(dtype, targets[0]), run.tokens_per_s, bandwidth)
            for (dtype, b), run in plain.items()
            if b == 1
        }
    report = {
        "target": {"name": targets[0].name, **targets[0].fingerprint},
        "settings": settings,
        "runs": rows,
        "crossover": {name: crossover(by_size) for name, by_size in speedups.items()},
    }
    if cases is not None and requests is not None:
        tokenizer = targets[0].tokenizer
        report["benchmark"] = {
            "prompts": spec.prompts,
            "requests": len(requests),
            "turns": max(c.turn for c in cases),
            "categories": list(dict.fromkeys(c.category for c in cases if c.category)),
            # a base model has no chat template: it was given the turns as plain text
            "chat_template": bool(tokenizer.chat_template),
        }
        report["outputs"] = decoded_texts(tokenizer, cases, requests, runs, label_of)
    return report


def decoded_texts(
    tokenizer, cases: Sequence[Case], requests, runs: Sequence[Run], label_of: Mapping[str, str]
) -> list:
    """Per prompt decoded, what names it (request id, category, turn), its text and each
    method's decoded text (by its short label) at the smallest batch size measured."""
    smallest = min(run.batch_size for run in runs)
    shown = [run for run in runs if run.batch_size == smallest]
    return [
        {
            **case_labels(case, requests),
            "prompt": tokenizer.decode(case.prompt[0].tolist()),
            "outputs": {label_of[run.name]: tokenizer.decode(run.outputs[i]) for run in shown},
        }
        for i, case in enumerate(cases)
    ]


def crossover(speedups: Mapping[int, float]) -> int | None:
    """The smallest batch size at which a method's speedup (batch size -> its speedup over plain
    decoding at that batch size) is below 1: where batching has made plain decoding the faster.
    None where it is at least 1 at every batch size measured."""
    return min((b for b, s in speedups.items() if s < 1), default=None)


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
    Column("batch_size", "batch"),
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
WANDB_KEYS = ("label", "name", "method", "batch_size", "tau", "tokens_per_s", "speedup_vs_ar",
              "overhead", "mean_log_p", "lossy")  # fmt: skip


def evaluation_report(report: dict, runs: Sequence[Run]) -> Report:
    """What scripts/evaluate.py writes (measuring/report_writer.py's write_report): `report` as
    report.json, its markdown, and three plots of the runs at the smallest batch size measured:
    acceptance per position and the tau distribution of the runs that drafted, and every run's
    speedup with its draft/verify split; with several batch sizes a fourth, batch_sizes.png:
    every method's tokens/s and speedup against batch size."""
    smallest = report["settings"]["batch_sizes"][0]
    # the runs that drafted: each in the same place of report.styles in both plots that show them
    drafted = [
        (r, run)
        for r, run in zip(report["runs"], runs, strict=True)
        if r["acceptance_per_position"] and r["batch_size"] == smallest
    ]
    figures = {
        "acceptance_per_position": acceptance_figure([r for r, _ in drafted]),
        "tau_distribution": lambda plt: _tau_distribution(plt, drafted, styles(len(drafted), plt)),
        "speedup": lambda plt: _speedup(
            plt, [r for r in report["runs"] if r["batch_size"] == smallest]
        ),
    }
    if len(report["settings"]["batch_sizes"]) > 1:
        figures["batch_sizes"] = lambda plt: batch_size_figure(plt, report)
    if any("by_category" in r for r in report["runs"]):
        figures["categories"] = lambda plt: category_figure(plt, report)
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
        *breakdown_markdown(report),
        *sweep_markdown(report),
        *memory_markdown(s.get("memory_bound", {})),
    ]
    return "\n".join(lines) + "\n"


def memory_markdown(bounds: Mapping[str, dict]) -> list[str]:
    """Plain decoding against the memory limit, per precision: nothing when not measured."""
    if not bounds:
        return []
    lines = [
        "",
        "## Plain decoding against the memory limit",
        "",
        "Weight bytes a step reads over the time a token takes (new tokens over the whole "
        "decode, the prompt's prefill included), against this machine's read bandwidth "
        "measured in the same process (batch size 1; KV-cache reads left out).",
        "",
        "| precision | weight MB per token | read GB/s | bound tokens/s | plain tokens/s | of bound |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for dtype, m in bounds.items():
        lines.append(
            f"| {dtype} | {m['weight_bytes_per_token'] / 1e6:.0f} | "
            f"{m['read_bandwidth_gb_s']:.1f} | {m['bound_tokens_per_s']:.1f} | "
            f"{m['tokens_per_s']:.1f} | {m['fraction_of_bound']:.0%} |"
        )
    return lines


def sweep_markdown(report: dict) -> list[str]:
    """With several batch sizes: each method's speedup and tau at each (speedup over plain
    decoding at the same batch size), plain decoding's tokens/s, and each method's crossover.
    Nothing otherwise."""
    sizes = report["settings"]["batch_sizes"]
    if len(sizes) < 2:
        return []
    rows = report["runs"]
    at = {(r["name"], r["batch_size"]): r for r in rows}
    names = list(dict.fromkeys(r["name"] for r in rows))
    lines = [
        "",
        "## Speedup against batch size",
        "",
        f"The same {report['settings']['num_prompts']} prompts at every batch size, decoded "
        "b at a time (each call one batch); speedup over plain decoding (`ar`) at the same "
        "batch size, with tau in brackets; tokens/s counts the whole batch's new tokens. Crossover: the smallest "
        "batch size measured at which the method is slower than plain decoding."
        + (
            " Transformers' assisted generation decodes one sequence at a time: measured at "
            "batch size 1 only."
            if any(r["method"] in UNBATCHED for r in rows)
            else ""
        ),
        "",
        "| label | " + " | ".join(f"b={b}" for b in sizes) + " | crossover |",
        "| --- | " + " | ".join("---:" for _ in sizes) + " | ---: |",
    ]
    for name in names:
        plain = name not in report["crossover"]
        cells = []
        for b in sizes:
            r = at.get((name, b))
            if r is None:
                cells.append("-")
            elif plain:
                cells.append(f"{r['tokens_per_s']:.1f} tok/s")
            else:  # tau where the run reports one (transformers' generate does not)
                tau = f" (tau {r['tau']:.2f})" if r["tau"] is not None else ""
                cells.append(f"{r['speedup_vs_ar']:.2f}x{tau}")
        label = next(r["label"] for r in rows if r["name"] == name)
        cross = ""  # plain decoding has none
        if not plain:
            at_b = report["crossover"][name]
            cross = "none" if at_b is None else f"b={at_b}"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {cross} |")
    return lines


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
    sweep = len({r["batch_size"] for r in rows}) > 1
    for r in rows:
        if r["acceptance_per_position"]:
            alphas = ", ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
            at = f" (b={r['batch_size']})" if sweep else ""
            lines.append(f"- {r['label']}{at}: {alphas}")
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


def batch_size_figure(plt, report: dict):
    """Tokens/s (plain decoding included) and speedup against batch size, one line per method
    in its place of report.styles; the speedup panel marks 1 (plain decoding) and each
    crossover."""
    rows = report["runs"]
    names = list(dict.fromkeys(r["name"] for r in rows))
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for name, style in zip(names, styles(len(names), plt), strict=True):
        mine = sorted((r for r in rows if r["name"] == name), key=lambda r: r["batch_size"])
        sizes = [r["batch_size"] for r in mine]
        label = mine[0]["label"]
        plain = name not in report["crossover"]
        left.plot(sizes, [r["tokens_per_s"] for r in mine], label=label, alpha=0.85,
                  ls="--" if plain else "-", **style)  # fmt: skip
        if not plain:
            right.plot(sizes, [r["speedup_vs_ar"] for r in mine], label=label, alpha=0.85,
                       **style)  # fmt: skip
            cross = report["crossover"][name]
            if cross is not None:
                at = next(r["speedup_vs_ar"] for r in mine if r["batch_size"] == cross)
                right.scatter([cross], [at], s=160, facecolors="none", edgecolors=style["color"])
    right.axhline(1.0, color="black", lw=0.8)
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xticks(report["settings"]["batch_sizes"])
        ax.set_xticklabels([str(b) for b in report["settings"]["batch_sizes"]])
        ax.set_xlabel("batch size")
        ax.grid(alpha=0.3)
    left.set(ylabel="tokens/s (whole batch)", title="Throughput (dashed: plain decoding)")
    right.set(ylabel="speedup vs plain decoding (same batch size)",
              title="Speedup (circled: crossover below 1)")  # fmt: skip
    fig.tight_layout()
    # beside both panels: the saved figure widens for it
    fig.legend(*left.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.95),
               frameon=False)  # fmt: skip
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
