"""A comparison of retrievers written as a report a person reads or a program loads: Markdown (for a
pull request or a notebook), CSV (one row per model, domain and metric, for pandas) or a
self-contained HTML page (``report_html.py``: charts, the worst queries with their images).

Every format shows the same numbers: each metric's mean with its bootstrap interval, the best
model per metric, and the paired difference of each model against the reference. A report is
written atomically, so a reader never sees half of one."""

from __future__ import annotations

import csv
import io
import os
import secrets
from pathlib import Path

from rde.evaluation.report_cells import (
    OVERALL,
    ImageSource,
    best_per_metric,
    domains,
    excludes_zero,
    interval_text,
    query_summary,
    shown_metrics,
    with_difference,
)
from rde.evaluation.results import Comparison, Interval

FORMATS = (".md", ".csv", ".html")
CSV_COLUMNS = ("model", "domain", "metric", "mean", "low", "high", "queries", "labels", "benchmark",
               "diff_mean", "diff_low", "diff_high")


def write_report(path: str | Path, comparison: Comparison, images: ImageSource | None = None) -> Path:
    """Write ``comparison`` to ``path`` in the format its extension names (``.md``, ``.csv``,
    ``.html``) and return the path. ``images(ids)`` gives the encoded bytes of item ids, for the
    HTML report's thumbnails (ids only without it). Raises ValueError for another extension,
    before anything is written."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"report {path}: unknown format '{path.suffix}'; use .md, .csv or .html")
    if suffix == ".md":
        text = markdown_report(comparison)
    elif suffix == ".csv":
        text = csv_report(comparison)
    else:
        from rde.evaluation.report_html import html_report

        text = html_report(comparison, images)
    _write_atomically(path, text)
    return path


def _write_atomically(path: Path, text: str) -> None:
    """Write ``text`` to a temporary file beside ``path``, then rename it over ``path``: a reader
    (or a crash) never meets a half-written report, and an old one stays until the new is whole.
    The temporary file is opened with mode 0o666 less the umask, as a plain ``open`` would
    (``mkstemp``'s 0o600 would leave a report others cannot read)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as out:
            out.write(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


# --- shared helpers (also used by the HTML report and the terminal table) -------------------------


def comparison_rows(comparison: Comparison) -> list[dict[str, str | int]]:
    """The overall table as plain rows (``model``, each metric → ``mean [low, high]``, ``queries``):
    what the Prefect table artifact shows. A metric a model lacks is an empty string."""
    rows: list[dict[str, str | int]] = []
    for m in comparison.models:
        overall = m.metrics.get(OVERALL, {})
        row: dict[str, str | int] = {"model": m.model}
        for metric in shown_metrics(comparison):
            row[metric] = interval_text(overall[metric]) if metric in overall else ""
        row["queries"] = m.queries.get(OVERALL, 0)
        rows.append(row)
    return rows


def _in_order(values: dict[str, Interval], order: tuple[str, ...]) -> list[str]:
    """The metrics of ``values``: those of ``order`` first, in its order, then any others."""
    return [k for k in order if k in values] + [k for k in values if k not in order]


def csv_rows(comparison: Comparison) -> list[dict[str, object]]:
    """One row per (model, domain, metric); the difference against the reference is filled in on
    the overall rows of the models that have one (it is computed over all queries only)."""
    rows: list[dict[str, object]] = []
    for m in comparison.models:
        for domain, values in m.metrics.items():
            for metric in _in_order(values, comparison.metrics):
                iv = values[metric]
                diff = (m.difference or {}).get(metric) if domain == OVERALL else None
                rows.append({"model": m.model, "domain": domain, "metric": metric, "mean": iv.mean,
                             "low": iv.low, "high": iv.high, "queries": m.queries.get(domain, 0),
                             "labels": comparison.labels, "benchmark": comparison.benchmark,
                             "diff_mean": diff.mean if diff else "", "diff_low": diff.low if diff else "",
                             "diff_high": diff.high if diff else ""})
    return rows


def csv_report(comparison: Comparison) -> str:
    """The CSV text: a header of ``CSV_COLUMNS`` and ``csv_rows``; numbers at full precision."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=CSV_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(csv_rows(comparison))
    return buffer.getvalue()


# --- Markdown --------------------------------------------------------------------------------------


def _md(text: str) -> str:
    """Text safe in a Markdown table cell: pipes escaped, newlines flattened."""
    return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def _md_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A GitHub-flavoured Markdown table, numbers right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _md_metrics_table(comparison: Comparison, domain: str) -> list[str]:
    """Models as rows, the metrics of ``domain`` as columns, the best mean per column in bold."""
    metrics = shown_metrics(comparison, domain)
    best = best_per_metric(comparison, domain)
    rows = []
    for m in comparison.models:
        values = m.metrics.get(domain, {})
        cells = [_md(m.model)]
        for metric in metrics:
            text = interval_text(values[metric]) if metric in values else "–"
            cells.append(f"**{text}**" if best.get(metric) == m.model and metric in values else text)
        rows.append([*cells, str(m.queries.get(domain, 0))])
    return _md_table(["model", *metrics, "queries"], rows)


def _md_difference_table(comparison: Comparison) -> list[str]:
    """Each model's paired difference against the reference; ``*`` where the interval excludes 0."""
    metrics = shown_metrics(comparison)
    rows = []
    for m in with_difference(comparison):
        cells = [_md(m.model)]
        for metric in metrics:
            iv = (m.difference or {}).get(metric)
            cells.append("–" if iv is None else interval_text(iv, signed=True) + (" \\*" if excludes_zero(iv) else ""))
        rows.append(cells)
    return _md_table(["model", *metrics], rows)


def markdown_report(comparison: Comparison) -> str:
    """The Markdown text: title, the overall table, the differences against the reference (when
    there is one), then one table per domain."""
    lines = [f"# {_md(comparison.title())}", ""]
    if comparison.pending:
        lines += ["> **Pending labels**: these scores use unreviewed MECF candidates as relevant.", ""]
    lines += [f"{query_summary(comparison)}; each cell is the mean with its bootstrap interval, the best "
              "mean per metric in bold.", "", "## Overall", ""]
    lines += _md_metrics_table(comparison, OVERALL) if OVERALL in domains(comparison) else ["(no overall metrics)"]
    if with_difference(comparison):
        lines += ["", f"## Paired difference against {_md(comparison.reference or '')}", "",
                  *_md_difference_table(comparison), "", "\\* the interval excludes 0."]
    for domain in domains(comparison):
        if domain != OVERALL:
            lines += ["", f"## Domain: {_md(domain)}", "", *_md_metrics_table(comparison, domain)]
    return "\n".join(lines) + "\n"
