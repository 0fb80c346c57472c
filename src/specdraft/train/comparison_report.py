"""What scripts/compare.py writes about the families it compared (train/comparison.py builds the
rows): the family table's columns, report.md, and its figures (the speed and acceptance
frontier, tau against speedup, the simulated tau over training), handed to
measuring/report_writer.py's write_report.
"""

from __future__ import annotations

from specdraft.measuring.benchmark_report import breakdown_markdown, category_figure
from specdraft.measuring.evaluation_report import batch_size_figure, runs_markdown, sweep_markdown
from specdraft.measuring.report_writer import (
    Column,
    Report,
    acceptance_figure,
    markdown_table,
    styles,
)

# a simulated tau further than this from the measured one is flagged in report.md: on other
# prompts (training's held-out ones), and on the prompts measured, where greedy decoding leaves
# only a train/serve difference to make a gap
GAP_FLAG = 0.10
SAME_PROMPTS_FLAG = 0.02
SAME_PROMPTS_FLAG_T1 = 0.10  # at T = 1 an expectation beside one sample (parity.sampled_tau_on)


def _chain_note(row: dict) -> str:
    """A tree served: training predicted its chain's tau only."""
    return "" if row["simulated_basis"] == "served" else " (chain)"


def _flag(key: str, limit: float):
    """A note for the column `key`: (!) where training's prediction is off by more than
    `limit` (on the prompts measured, a train/serve difference: scripts/parity.py names it)."""
    return lambda row: " (!)" if abs(row[key]) > limit else ""


COLUMNS = (
    Column("family", "family"),
    Column("tau", "τ", "{:.2f}", max),
    Column("speedup", "speedup greedy", "{:.2f}x", max),
    Column("tau_t1", "τ T=1", "{:.2f}", max),
    Column("speedup_t1", "speedup T=1", "{:.2f}x", max),
    Column("overhead", "overhead", "{:.2f}", min),
    Column("draft_share", "draft time", "{:.0%}", min),
    Column("extra_memory_mb", "extra memory", "{:.1f} MiB", min),
    Column("train_seconds", "training time", "{:.0f} s", min),
    Column("train_tokens", "training tokens", "{:,}"),
    Column("train_peak_memory_mb", "training peak memory", "{:,.0f} MiB", min),
    Column("quality_cost_nats", "target's loss cost", "{:+.3f} nats"),
    Column("tau_alone", "τ without copying", "{:.2f}", max),
    Column("speedup_alone", "speedup without copying", "{:.2f}x", max),
    Column("tau_alone_t1", "τ T=1 without copying", "{:.2f}", max),
    Column("speedup_alone_t1", "speedup T=1 without copying", "{:.2f}x", max),
    Column("simulated_tau", "simulated τ", "{:.2f}", note=_chain_note),
    Column("tau_gap", "simulated vs measured", "{:+.0%}", note=_flag("tau_gap", GAP_FLAG)),
    Column("simulated_on", "simulated on"),
    Column("simulated_tau_same_prompts", "simulated τ, prompts measured", "{:.2f}"),
    Column(
        "tau_gap_same_prompts",
        "simulated vs measured, same prompts",
        "{:+.1%}",
        note=_flag("tau_gap_same_prompts", SAME_PROMPTS_FLAG),
    ),
    Column("simulated_t1_same_prompts", "simulated τ T=1, prompts measured", "{:.2f}"),
    Column(
        "tau_gap_t1_same_prompts",
        "simulated vs measured T=1 without copying, same prompts",
        "{:+.1%}",
        note=_flag("tau_gap_t1_same_prompts", SAME_PROMPTS_FLAG_T1),
    ),
)
# with several batch sizes: the smallest where the family is slower than plain decoding, greedy
CROSSOVER = Column("crossover", "crossover", lambda b: "none" if b == "none" else f"b={b}")


def family_table(report: dict) -> list[str]:
    """The family table's lines; with a batch-size sweep, a crossover column ("none" where the
    family stays at least as fast as plain decoding at every batch size measured)."""
    if len(report["greedy"]["settings"]["batch_sizes"]) < 2:
        return markdown_table(COLUMNS, report["families"])
    rows = [
        r if "error" in r or r["crossover"] is not None else {**r, "crossover": "none"}
        for r in report["families"]
    ]
    return markdown_table((*COLUMNS, CROSSOVER), rows)


def markdown(report: dict) -> str:
    """report.md: the family table, the best value of each column in bold, then every run's own
    row as scripts/evaluate.py reports it, greedy and sampled."""
    lines = [
        f"# The drafting families on {report['target']['name']}",
        "",
        report["summary"],
        "",
        *family_table(report),
    ]
    for mode, title in (("greedy", "greedy"), ("sampled", "sampled at temperature 1")):
        if report[mode] is not None:
            lines += ["", f"## Every run, {title}", "", *runs_markdown(report[mode]["runs"])]
            for part in (breakdown_markdown(report[mode]), sweep_markdown(report[mode])):
                lines += [line.replace("## ", "### ", 1) for line in part]
    return "\n".join(lines) + "\n"


def compare_report(report: dict) -> Report:
    """What scripts/compare.py writes (measuring/report_writer.py's write_report): `report` as
    report.json, its markdown, and frontier.png (speedup vs extra memory), tau_vs_speedup.png
    (with overhead lines), acceptance.png (per position, per family), simulated_tau.png
    (over training, and measured) and, where the prompts have categories, categories.png
    (greedy speedup and tau per category)."""
    ok = [r for r in report["families"] if "error" not in r]
    labelled = [{**r, "label": r["family"]} for r in ok]
    figures = {
        "frontier": lambda plt: _frontier(plt, ok, report["greedy"]["runs"]),
        "tau_vs_speedup": lambda plt: _tau_vs_speedup(plt, ok),
        "acceptance": acceptance_figure(labelled, "Acceptance per position (greedy)"),
        "simulated_tau": lambda plt: _simulated(plt, ok),
    }
    if len(report["greedy"]["settings"]["batch_sizes"]) > 1:
        figures["batch_sizes"] = lambda plt: batch_size_figure(plt, report["greedy"])
    if any("by_category" in r for r in report["greedy"]["runs"]):
        figures["categories"] = lambda plt: category_figure(plt, report["greedy"])
    return Report(
        report, markdown(report), figures, job_type="compare",
        config={"summary": report["summary"], "target": report["target"]}, table_name="families",
        table_keys=["family", "error", *(c.key for c in (*COLUMNS[1:], CROSSOVER))],
        rows=report["families"],
    )  # fmt: skip


def _frontier(plt, ok, runs):
    colors = styles(len(ok), plt)
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, style in zip(ok, colors, strict=True):
        ax.scatter(r["extra_memory_mb"], r["speedup"], color=style["color"], s=60)
        ax.annotate(r["family"], (r["extra_memory_mb"], r["speedup"]), xytext=(5, 5),
                    textcoords="offset points")  # fmt: skip
    smallest = min(r["batch_size"] for r in runs)
    baselines = ("prompt_lookup", "hf_assisted", "hf_early_exit")
    for r in runs:
        if r["batch_size"] == smallest and r["method"] in baselines:
            mib = r["extra_memory_bytes"] / 2**20  # transformers' assisted: the draft's weights
            ax.scatter(mib, r["speedup_vs_ar"], marker="x", color="grey")
            ax.annotate(r["label"], (mib, r["speedup_vs_ar"]), xytext=(5, -10),
                        textcoords="offset points", fontsize=8, color="grey")  # fmt: skip
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set(xlabel="extra memory (MiB: weights + draft KV cache)",
           ylabel="speedup vs plain decoding (greedy)",
           title="What each drafter buys for its memory")  # fmt: skip
    ax.grid(alpha=0.3)
    return fig


def _tau_vs_speedup(plt, ok):
    fig, ax = plt.subplots(figsize=(6, 4))
    top = max([r["tau"] for r in ok] + [2.0]) * 1.1
    for overhead in (0.0, 0.5, 1.0, 2.0):
        ax.plot([1, top], [1 / (1 + overhead), top / (1 + overhead)], color="grey", lw=0.7, ls=":")
        ax.annotate(f"overhead {overhead:g}", (top, top / (1 + overhead)), fontsize=7, color="grey")
    for r, style in zip(ok, styles(len(ok), plt), strict=True):
        ax.scatter(r["tau"], r["speedup"], color=style["color"], s=60, label=r["family"])
    ax.set(xlabel="τ (tokens per target pass)", ylabel="speedup (greedy)",
           title="τ against speedup: the gap is drafting and verification cost")  # fmt: skip
    ax.legend(frameon=False)
    ax.grid(alpha=0.3)
    return fig


def _simulated(plt, ok):
    fig, ax = plt.subplots(figsize=(6, 4))
    for r, style in zip(ok, styles(len(ok), plt), strict=True):
        sim = r["simulated_over_training"]
        if sim:
            ax.plot([s["step"] for s in sim], [s["tau"] for s in sim], marker=".",
                    color=style["color"], label=f"{r['family']} simulated")  # fmt: skip
            # what training predicts: the served run where it simulated serving, else alone
            served = r["tau"] if r["simulated_basis"] == "served" else r["tau_alone"]
            ax.scatter(sim[-1]["step"], served, marker="*", s=120, color=style["color"])
    ax.set(xlabel="training step", ylabel="τ",
           title="Simulated τ over training; ★ measured in the loop, no copying")  # fmt: skip
    if ax.get_legend_handles_labels()[0]:  # folders trained elsewhere may bring no evaluations
        ax.legend(frameon=False, fontsize=8)
    ax.grid(alpha=0.3)
    return fig
