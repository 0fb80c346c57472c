"""The per-category and per-turn part of an evaluation report, in the shape Spec-Bench and the
drafter papers publish: categories as columns, one row per method, each cell the speedup over
plain decoding with the pooled tau beside it (measure.group_figures: tokens emitted over target
verification passes, the way vLLM and SGLang count acceptance length; docs/benchmarks.md).
"""

from __future__ import annotations

from specdraft.data.benchmarks import BENCHMARKS


def breakdown_markdown(report: dict) -> list[str]:
    """report.md's tables per category and per turn (make_report's rows' `by_category` and
    `by_turn`); nothing where the rows have neither."""
    rows = [r for r in report["runs"] if "by_category" in r or "by_turn" in r]
    if not rows:
        return []
    bench = report.get("benchmark", {})
    turns = bench.get("turns", 1)
    lines = [
        "",
        f"## Per category and turn: {_title(report)}",
        "",
        f"{bench.get('requests', '?')} requests"
        + (
            f", every one of their {turns} turns measured (a later turn follows the target's "
            "own answer to the one before, the same for every method)"
            if turns > 1
            else ""
        )
        + ". Each cell: speedup over plain decoding on the same prompts, with tau pooled over "
        "the group (tokens emitted / target passes). Plain decoding: its tokens/s.",
    ]
    if bench and not bench.get("chat_template", True):
        lines += [
            "",
            "The target has no chat template (a base model): each turn was given as plain text "
            "after the ones before, blank-line separated.",
        ]
    for key, what in (("by_category", "Per category:"), ("by_turn", "Per turn:")):
        groups = list(dict.fromkeys(g for r in rows for g in r.get(key, {})))
        if not groups:
            continue
        names = [f"turn {g}" for g in groups] if key == "by_turn" else groups
        lines += [
            "",
            what,
            "",
            f"| label | {' | '.join(names)} | overall |",
            "| --- | " + " | ".join("---:" for _ in [*groups, 0]) + " |",
        ]
        for r in rows:
            cells = [_cell(r.get(key, {}).get(g), r["method"]) for g in groups]
            lines.append(f"| {r['label']} | {' | '.join(cells)} | {_cell(r, r['method'])} |")
    return lines


def _title(report: dict) -> str:
    """The prompts' name: a benchmark set's title (MT-Bench), else what --prompts said."""
    name = report.get("benchmark", {}).get("prompts", "")
    return BENCHMARKS[name].title if name in BENCHMARKS else name


def _cell(figures: dict | None, method: str) -> str:
    if figures is None:
        return "-"
    if method == "ar":
        return f"{figures['tokens_per_s']:.1f} tok/s"
    tau = f" (τ {figures['tau']:.2f})" if figures.get("tau") is not None else ""
    return f"{figures['speedup_vs_ar']:.2f}x{tau}"


def category_figure(plt, report: dict):
    """Speedup (left) and pooled tau (right) per category, one bar per method that drafted,
    grouped by category; 1 marked (plain decoding)."""
    rows = [r for r in report["runs"] if "by_category" in r and r["method"] != "ar"]
    categories = list(dict.fromkeys(c for r in rows for c in r["by_category"]))
    fig, (left, right) = plt.subplots(1, 2, figsize=(max(10, 1.3 * len(categories) * 2), 4))
    width = 0.8 / max(len(rows), 1)
    for i, r in enumerate(rows):
        x = [k + (i - (len(rows) - 1) / 2) * width for k in range(len(categories))]
        for ax, key in ((left, "speedup_vs_ar"), (right, "tau")):
            values = [(r["by_category"].get(c) or {}).get(key) or 0.0 for c in categories]
            ax.bar(x, values, width, label=r["label"])
    for ax in (left, right):
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xticks(range(len(categories)))
        ax.set_xticklabels(categories, rotation=30, ha="right", rotation_mode="anchor")
        ax.grid(axis="y", alpha=0.3)
    left.set(ylabel="speedup vs plain decoding", title=f"{_title(report)}: speedup per category")
    right.set(ylabel="tau (tokens per target pass)", title="tau per category (pooled)")
    fig.tight_layout()
    fig.legend(*left.get_legend_handles_labels(), loc="upper left", bbox_to_anchor=(1.0, 0.95),
               frameon=False)  # fmt: skip
    return fig
