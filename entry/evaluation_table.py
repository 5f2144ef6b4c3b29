"""``rde evaluate``'s terminal tables: a comparison of retrievers as a rich table (models as rows,
the overall metrics with their bootstrap intervals as columns, the best per column in bold green)
and, with a reference model, the paired differences against it. Pending (unreviewed) labels are
flagged in the title so a score on them is never mistaken for a verified one."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console, ConsoleOptions
from rich.measure import Measurement
from rich.table import Table
from rich.text import Text

from rde.evaluation.report_cells import (
    OVERALL,
    best_per_metric,
    excludes_zero,
    interval_text,
    query_summary,
    shown_metrics,
    with_difference,
)
from rde.evaluation.results import Comparison, Interval

BEST_STYLE = "bold green"


@dataclass(frozen=True)
class IntervalCell:
    """A cell ``mean [low, high]`` on one line where the column is wide enough, else the mean above
    its interval: nine metric columns of 20 characters do not fit most terminals, and rich's own
    wrapping would split the interval itself (``0.412 [0.371,`` / ``0.455]``)."""

    interval: Interval
    signed: bool = False
    style: str = ""
    mark: str = ""  # after the interval (or the mean, on two lines): `` *`` for a significant difference

    def _parts(self) -> tuple[str, str]:
        mean, bounds = interval_text(self.interval, self.signed).split(" ", 1)
        return mean, bounds

    def __rich_measure__(self, console: Console, options: ConsoleOptions) -> Measurement:
        mean, bounds = self._parts()
        return Measurement(max(len(mean + self.mark), len(bounds)), len(f"{mean} {bounds}{self.mark}"))

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> Iterator[Text]:
        mean, bounds = self._parts()
        one_line = f"{mean} {bounds}{self.mark}"
        two_lines = f"{mean}{self.mark}\n{bounds}"  # the mark on the mean's line, keeping the column narrow
        yield Text(one_line if len(one_line) <= options.max_width else two_lines, style=self.style)


def comparison_title(comparison: Comparison) -> Text:
    """``Comparison.title()`` with the labels' kind in yellow and the pending flag in bold red when
    the labels are not verified (as a ``Text``, so no part of a benchmark name reads as markup)."""
    title = Text(comparison.title())
    if comparison.pending:
        title.highlight_words([f"labels: {comparison.labels}"], style="yellow")
        title.highlight_regex(r"PENDING LABELS.*$", style="bold red")
    return title


def short_name(model: str) -> str:
    """A model spec as a table shows it: a local path in it by its file or folder name
    (``python:/home/me/my_retriever.py:make`` → ``python:my_retriever.py:make``); hub ids as written."""
    parts = model.split(":")
    return ":".join([parts[0], *(Path(p).name if p.startswith(("/", "./", "../", "~")) else p for p in parts[1:])])


def _table(title: Text, caption: str, metrics: list[str]) -> Table:
    """An empty table: a folding model column (the models' short names), then one right-aligned
    column per metric."""
    table = Table(title=title, caption=Text(caption))
    table.add_column("model", overflow="fold")
    for metric in metrics:
        table.add_column(metric, justify="right")
    return table


def comparison_table(comparison: Comparison) -> Table:
    """Models as rows, the overall metrics as columns, each cell ``mean [low, high]`` to three
    decimals, the best mean per column in bold green; the caption gives the number of queries."""
    metrics = shown_metrics(comparison)
    best = best_per_metric(comparison)
    table = _table(comparison_title(comparison), f"{query_summary(comparison)} · mean [bootstrap interval]", metrics)
    for m in comparison.models:
        overall = m.metrics.get(OVERALL, {})
        cells: list[Text | IntervalCell] = [Text(short_name(m.model))]
        for metric in metrics:
            if metric not in overall:
                cells.append(Text("–"))
            else:
                style = BEST_STYLE if best.get(metric) == m.model else ""
                cells.append(IntervalCell(overall[metric], style=style))
        table.add_row(*cells)
    return table


def differences_table(comparison: Comparison) -> Table | None:
    """Each model's paired difference against the reference per overall metric, signed; an interval
    that excludes 0 is marked ``*`` and coloured by its sign. None without a reference (or when no
    model carries a difference)."""
    models = with_difference(comparison)
    if not models:
        return None
    metrics = shown_metrics(comparison)
    flag = "" if not comparison.pending else f" · {comparison.labels.upper()} LABELS"
    table = _table(Text(f"paired difference against {short_name(comparison.reference or '')}{flag}"),
                   "* the interval excludes 0", metrics)
    for m in models:
        cells: list[Text | IntervalCell] = [Text(short_name(m.model))]
        for metric in metrics:
            iv = (m.difference or {}).get(metric)
            if iv is None:
                cells.append(Text("–"))
            elif excludes_zero(iv):
                cells.append(IntervalCell(iv, signed=True, style="green" if iv.low > 0 else "red", mark=" *"))
            else:
                cells.append(IntervalCell(iv, signed=True, mark="  "))
        table.add_row(*cells)
    return table
