"""The one report writer: report.json, report.md, PNG figures and a W&B run, for
scripts/evaluate.py and scripts/compare.py alike.

A report is data (`Report`): what report.json holds, the markdown of report.md, its figures (a
name and a function that draws it) and the table a W&B run logs. `write_report` writes all of
it into one folder. The pieces both reports print are here too: `Column` and `markdown_table`
(a table whose best value per column is in bold) and `acceptance_figure` (acceptance per
draft position, one line per drafter). What each report shows is its caller's: evaluation's
columns and figures are measuring/evaluation_report.py's, compare's are train/comparison.py's.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# A figure: called with matplotlib.pyplot (its Agg backend), returns the figure to save.
Figure = Callable[[Any], Any]


@dataclass(frozen=True)
class Column:
    """One column of a markdown table: a row's `key`, under `header`, shown with `fmt` (a format
    string or a function of the value; None shows as "-")."""

    key: str
    header: str
    fmt: str | Callable[[Any], str] = "{}"
    # max or min: the column's best value among the rows is shown in bold; None: no best
    best: Callable[[Sequence], Any] | None = None
    # a note after the value, from the whole row ("(!)" where a figure is off), or ""
    note: Callable[[dict], str] | None = None

    def text(self, row: dict) -> str:
        value = row.get(self.key)
        if value is None:
            return "-"
        shown = self.fmt(value) if callable(self.fmt) else self.fmt.format(value)
        return shown + (self.note(row) if self.note is not None else "")


def markdown_table(columns: Sequence[Column], rows: Sequence[dict]) -> list[str]:
    """The lines of a markdown table of `rows`, one per row, the best value of each column that
    names one in bold. A row with an "error" shows "failed: ERROR" after its first cell and
    takes no part in the best values."""
    ok = [r for r in rows if "error" not in r]
    best = {}
    for c in columns:
        values = [r[c.key] for r in ok if r.get(c.key) is not None]
        if c.best is not None and values:
            best[c.key] = c.best(values)
    first, rest = columns[0], columns[1:]
    lines = [
        "| " + " | ".join(c.header for c in columns) + " |",
        "| --- | " + " | ".join("---:" for _ in rest) + " |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {first.text(r)} | failed: {r['error']} |" + " |" * (len(rest) - 1))
            continue
        cells = [
            f"**{c.text(r)}**" if c.key in best and r.get(c.key) == best[c.key] else c.text(r)
            for c in columns
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


@dataclass
class Report:
    """Everything a report folder holds, as data."""

    data: dict  # report.json
    markdown: str  # report.md
    figures: dict[str, Figure] = field(default_factory=dict)  # NAME.png, each drawn by its function
    # the W&B run: its job type, its config, and a table (`table_name`) of these keys of `rows`
    job_type: str = "report"
    config: dict = field(default_factory=dict)
    table_name: str = "runs"
    table_keys: Sequence[str] = ()
    rows: Sequence[dict] = ()


def write_report(report: Report, out: Path, wandb_project: str | None = None) -> None:
    """report.json, report.md and every figure as a PNG in folder `out`; with `wandb_project`,
    also one W&B run (its files under out/wandb) with the table and the figures."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report.data, indent=2, default=str) + "\n")
    (out / "report.md").write_text(report.markdown)
    if report.figures:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        for name, draw in report.figures.items():
            fig = draw(plt)
            fig.savefig(out / f"{name}.png", dpi=120, bbox_inches="tight")  # the legend, uncut
            plt.close(fig)
    if wandb_project:
        import wandb

        run = wandb.init(
            project=wandb_project, dir=str(out), job_type=report.job_type, config=report.config
        )
        keys = list(report.table_keys)
        table = wandb.Table(columns=keys, data=[[r.get(k) for k in keys] for r in report.rows])
        images = {name: wandb.Image(str(out / f"{name}.png")) for name in report.figures}
        run.log({report.table_name: table, **images})
        run.finish()


# --- figures both reports draw -----------------------------------------------------------------

MARKERS = "osD^v<>ph*"


def styles(n: int, plt) -> list[dict]:
    """A colour and marker for each of n drafters, all different up to 100."""
    colors = plt.get_cmap("tab10").colors
    return [dict(color=colors[i % 10], marker=MARKERS[(i + i // 10) % 10]) for i in range(n)]


def acceptance_figure(rows: Sequence[dict], title: str = "Acceptance per position") -> Figure:
    """Acceptance per draft position, one line per row (its `label` and its
    `acceptance_per_position`), each in its place in `styles`."""

    def draw(plt):
        from matplotlib.ticker import MaxNLocator

        fig, ax = plt.subplots(figsize=(6, 4))
        for i, (r, style) in enumerate(zip(rows, styles(len(rows), plt), strict=True)):
            alphas = r["acceptance_per_position"]
            # runs side by side around each position, so equal values do not hide one another
            dodge = (i - (len(rows) - 1) / 2) * min(0.04, 0.3 / len(rows))
            x = [pos + dodge for pos in range(1, len(alphas) + 1)]
            ax.plot(x, alphas, label=r["label"], alpha=0.85, **style)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set(xlabel="draft position i", ylabel="acceptance alpha_i", ylim=(-0.03, 1.05))
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if not rows:
            ax.text(0.5, 0.5, "no run drafted", ha="center", transform=ax.transAxes)
        else:  # beside the axes: the saved figure widens for it
            ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1), frameon=False,
                      ncols=math.ceil(len(rows) / 14))  # fmt: skip
        return fig

    return draw
