"""The HTML report of a comparison: one self-contained page that opens offline (no external CSS,
JavaScript or fonts; charts are inline SVG drawn here, thumbnails are inline JPEG data URIs), so it
can be mailed, attached to a run or opened from an air-gapped machine.

It shows the comparison table and the differences against the reference (as the Markdown report),
one bar chart per metric with the interval as whiskers, each model's distribution of per-query AP,
and each model's ten worst queries with their top-ranked and relevant images: where a reader
looks first when a model disappoints. Every text from the data is escaped."""

from __future__ import annotations

import base64
import io
from html import escape

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
from rde.evaluation.results import Comparison, ModelResult, QueryOutcome

THUMB_PX = 96  # the long side of a thumbnail
WORST = 10  # worst queries shown per model
SHOWN_ITEMS = 5  # top-ranked and relevant images shown per query
BINS = 10  # histogram bins over [0, 1]

STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; max-width: 1150px; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.8em; border-bottom: 1px solid #ddd; }
.pending { background: #fff3cd; border: 1px solid #e0b000; padding: 6px 10px; color: #8a1c00; }
table { border-collapse: collapse; margin: 8px 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: right; vertical-align: top; }
th:first-child, td:first-child { text-align: left; }
td.best { font-weight: bold; background: #e6f4ea; }
td.sig { font-weight: bold; } td.up { color: #137333; } td.down { color: #b3261e; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; }
.chart { border: 1px solid #eee; padding: 4px; } .chart h3 { font-size: 0.9em; margin: 2px 4px; }
table.worst td { text-align: left; } .items { display: flex; gap: 4px; flex-wrap: wrap; }
.items img, .missing { border: 2px solid transparent; max-width: 96px; max-height: 96px; }
.items .hit { border-color: #137333; }
.missing { display: inline-block; width: 64px; height: 64px; background: #ccc; color: #333;
  font-size: 0.65em; overflow: hidden; word-break: break-all; padding: 2px; }
.id { font-family: monospace; font-size: 0.8em; color: #555; }
.note { color: #555; font-size: 0.85em; }
"""


def html_report(comparison: Comparison, images: ImageSource | None = None) -> str:
    """The whole page as text. ``images(ids)`` gives the encoded bytes of item ids (thumbnails);
    without it the worst queries show item ids only."""
    thumbs = thumbnails(_shown_ids(comparison), images) if images is not None else None
    body = [f"<h1>{escape(comparison.title())}</h1>"]
    if comparison.pending:
        body.append('<p class="pending"><b>Pending labels</b>: these scores use unreviewed MECF candidates '
                    "as relevant.</p>")
    body.append(f'<p class="note">{escape(query_summary(comparison))}; each cell is the mean with its '
                "bootstrap interval, the best mean per metric marked.</p>")
    body += ["<h2>Overall</h2>", metrics_table(comparison, OVERALL)]
    if with_difference(comparison):
        body += [f"<h2>Paired difference against {escape(comparison.reference or '')}</h2>",
                 difference_table(comparison), '<p class="note">* the interval excludes 0.</p>']
    for domain in domains(comparison):
        if domain != OVERALL:
            body += [f"<h2>Domain: {escape(domain)}</h2>", metrics_table(comparison, domain)]
    body += ["<h2>Metrics with their intervals</h2>", '<div class="charts">',
             *(bar_chart(comparison, metric) for metric in shown_metrics(comparison)), "</div>"]
    body += [f"<h2>Per-query AP (AP@{comparison.headline_k})</h2>", '<div class="charts">',
             *ap_histograms(comparison), "</div>"]
    for model in comparison.models:
        body.append(worst_section(comparison, model, thumbs))
    return ('<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{escape(comparison.title())}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


# --- tables ----------------------------------------------------------------------------------------


def metrics_table(comparison: Comparison, domain: str) -> str:
    """Models as rows, the metrics of ``domain`` as columns; the best mean per column marked."""
    metrics = shown_metrics(comparison, domain)
    best = best_per_metric(comparison, domain)
    head = "".join(f"<th>{escape(k)}</th>" for k in ["model", *metrics, "queries"])
    rows = []
    for m in comparison.models:
        values = m.metrics.get(domain, {})
        cells = [f"<td>{escape(m.model)}</td>"]
        for metric in metrics:
            if metric not in values:
                cells.append("<td>–</td>")
            elif best.get(metric) == m.model:
                cells.append(f'<td class="best" title="best">{escape(interval_text(values[metric]))}</td>')
            else:
                cells.append(f"<td>{escape(interval_text(values[metric]))}</td>")
        cells.append(f"<td>{m.queries.get(domain, 0)}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>\n" + "\n".join(rows) + "</table>"


def difference_table(comparison: Comparison) -> str:
    """Each model's paired difference against the reference; an interval excluding 0 is marked
    ``*`` and coloured by its sign."""
    metrics = shown_metrics(comparison)
    head = "".join(f"<th>{escape(k)}</th>" for k in ["model", *metrics])
    rows = []
    for m in with_difference(comparison):
        cells = [f"<td>{escape(m.model)}</td>"]
        for metric in metrics:
            iv = (m.difference or {}).get(metric)
            if iv is None:
                cells.append("<td>–</td>")
            elif excludes_zero(iv):
                side = "up" if iv.low > 0 else "down"
                cells.append(f'<td class="sig {side}">{escape(interval_text(iv, signed=True))} *</td>')
            else:
                cells.append(f"<td>{escape(interval_text(iv, signed=True))}</td>")
        rows.append("<tr>" + "".join(cells) + "</tr>")
    return f"<table><tr>{head}</tr>\n" + "\n".join(rows) + "</table>"


# --- charts (inline SVG) ---------------------------------------------------------------------------


def _short(text: str, n: int = 30) -> str:
    """A label that fits the chart's margin: the end of a long model spec (its distinctive part)."""
    return text if len(text) <= n else "…" + text[-(n - 1):]


def bar_chart(comparison: Comparison, metric: str) -> str:
    """One horizontal bar per model for ``metric`` (overall), its interval as a whisker with caps,
    on a scale from 0 to 1 (or the highest interval end above 1); the best bar darker."""
    models = [(m, m.metrics.get(OVERALL, {}).get(metric)) for m in comparison.models]
    top = max([1.0] + [iv.high for _, iv in models if iv is not None])
    label_w, plot_w, row_h, pad = 190, 230, 24, 24
    height = pad + row_h * len(models) + 22
    best = best_per_metric(comparison).get(metric)
    parts = [f'<svg width="{label_w + plot_w + 60}" height="{height}" role="img" '
             f'aria-label="{escape(metric)}">']

    def x(v: float) -> float:
        return label_w + plot_w * max(0.0, v) / top

    for i, (m, iv) in enumerate(models):
        y = pad + i * row_h
        parts.append(f'<text x="{label_w - 6}" y="{y + 15}" font-size="11" text-anchor="end">'
                     f"<title>{escape(m.model)}</title>{escape(_short(m.model))}</text>")
        if iv is None:
            continue
        fill = "#1a73e8" if m.model == best else "#8ab4f8"
        mid = y + row_h / 2 - 1
        parts += [f'<rect x="{label_w}" y="{y + 4}" width="{x(iv.mean) - label_w:.1f}" height="{row_h - 10}" '
                  f'fill="{fill}"><title>{escape(interval_text(iv))}</title></rect>',
                  f'<line x1="{x(iv.low):.1f}" y1="{mid}" x2="{x(iv.high):.1f}" y2="{mid}" stroke="#222"/>',
                  *(f'<line x1="{x(v):.1f}" y1="{mid - 5}" x2="{x(v):.1f}" y2="{mid + 5}" stroke="#222"/>'
                    for v in (iv.low, iv.high)),
                  f'<text x="{x(iv.high) + 4:.1f}" y="{y + 15}" font-size="10">{iv.mean:.3f}</text>']
    axis_y = pad + row_h * len(models) + 2
    parts.append(f'<line x1="{label_w}" y1="{pad - 2}" x2="{label_w}" y2="{axis_y}" stroke="#999"/>')
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(f'<text x="{x(tick):.1f}" y="{axis_y + 14}" font-size="9" text-anchor="middle">{tick:g}</text>')
    parts.append("</svg>")
    return f'<div class="chart"><h3>{escape(metric)}</h3>' + "".join(parts) + "</div>"


def ap_bins(outcomes: list[QueryOutcome]) -> list[int]:
    """Counts of per-query AP in ``BINS`` equal bins over [0, 1]; AP 1 falls in the last bin."""
    counts = [0] * BINS
    for q in outcomes:
        counts[min(BINS - 1, max(0, int(q.ap * BINS)))] += 1
    return counts


def ap_histograms(comparison: Comparison) -> list[str]:
    """One histogram of per-query AP per model, all on the same count scale so they compare."""
    counts = {m.model: ap_bins(m.per_query) for m in comparison.models}
    ymax = max([1] + [c for bins in counts.values() for c in bins])
    return [_histogram(m, counts[m.model], ymax) for m in comparison.models]


def _histogram(model: ModelResult, counts: list[int], ymax: int) -> str:
    """An SVG histogram of ``counts`` (bins over [0, 1]) titled with the model and its mean AP."""
    width, plot_h, left, top = 300, 110, 28, 14
    bar_w = (width - left - 8) / BINS
    parts = [f'<svg width="{width}" height="{plot_h + top + 20}" role="img" aria-label="AP histogram">']
    for i, n in enumerate(counts):
        h = plot_h * n / ymax
        bx, by = left + i * bar_w, top + plot_h - h
        parts.append(f'<rect x="{bx + 1:.1f}" y="{by:.1f}" width="{bar_w - 2:.1f}" height="{h:.1f}" fill="#8ab4f8">'
                     f"<title>AP {i / BINS:.1f}–{(i + 1) / BINS:.1f}: {n}</title></rect>")
        if n:
            parts.append(f'<text x="{bx + bar_w / 2:.1f}" y="{by - 2:.1f}" font-size="9" '
                         f'text-anchor="middle">{n}</text>')
    base = top + plot_h
    parts.append(f'<line x1="{left}" y1="{base}" x2="{width - 8}" y2="{base}" stroke="#999"/>')
    for tick in (0.0, 0.5, 1.0):
        tx = left + tick * (width - left - 8)
        parts.append(f'<text x="{tx:.1f}" y="{base + 14}" font-size="9" text-anchor="middle">{tick:g}</text>')
    parts.append("</svg>")
    mean = sum(q.ap for q in model.per_query) / len(model.per_query) if model.per_query else 0.0
    return (f'<div class="chart"><h3>{escape(_short(model.model, 40))} · {len(model.per_query)} queries · '
            f"mean AP {mean:.3f}</h3>" + "".join(parts) + "</div>")


# --- the worst queries, with thumbnails ------------------------------------------------------------


def worst_queries(model: ModelResult, n: int = WORST) -> list[QueryOutcome]:
    """The ``n`` queries with the lowest AP, ties broken by query id (a stable, reproducible page)."""
    return sorted(model.per_query, key=lambda q: (q.ap, q.query_id))[:n]


def _shown_ids(comparison: Comparison) -> list[str]:
    """Every item id the worst-query sections show, once each, sorted: asked for in one call."""
    ids = {i for m in comparison.models for q in worst_queries(m)
           for i in (*q.top[:SHOWN_ITEMS], *q.relevant[:SHOWN_ITEMS])}
    return sorted(ids)


def thumbnail_data_uri(data: bytes) -> str | None:
    """A ``data:image/jpeg;base64,…`` URI of ``data`` downscaled to ``THUMB_PX`` on its long side;
    None when the bytes are not an image Pillow reads (shown as a grey box instead)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as img:
            img.thumbnail((THUMB_PX, THUMB_PX))
            rgb = img.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError, ImportError):
        # ImportError: once ultralytics is imported, its patched Image.open answers an unknown format
        # by importing pi_heif, which is not installed
        return None
    out = io.BytesIO()
    rgb.save(out, format="JPEG", quality=80)
    return "data:image/jpeg;base64," + base64.b64encode(out.getvalue()).decode("ascii")


def thumbnails(ids: list[str], images: ImageSource) -> dict[str, str]:
    """Item id → thumbnail data URI for the ids ``images`` returns and Pillow can read."""
    if not ids:
        return {}
    found = images(ids)
    uris = {i: thumbnail_data_uri(found[i]) for i in ids if i in found}
    return {i: uri for i, uri in uris.items() if uri is not None}


def _item(item_id: str, thumbs: dict[str, str] | None, hit: bool) -> str:
    """One item: its thumbnail, a grey box naming it when it has none, or its id alone when the
    report has no images at all. A relevant item among the top ones is framed green."""
    cls = ' class="hit"' if hit else ""
    if thumbs is None:
        return f'<span class="id{" hit" if hit else ""}">{escape(item_id)}</span>'
    if item_id in thumbs:
        return f'<img src="{thumbs[item_id]}" alt="{escape(item_id)}" title="{escape(item_id)}"{cls}>'
    return f'<span class="missing{" hit" if hit else ""}" title="{escape(item_id)}">{escape(item_id)}</span>'


def _query_cell(comparison: Comparison, q: QueryOutcome) -> str:
    """The query's text (a link to its review page where there is one), its id and domain."""
    text = escape(q.text)
    link = comparison.review_links.get(q.query_id)
    if link:
        text = f'<a href="{escape(link)}">{text}</a>'
    return f'{text}<br><span class="id">{escape(q.query_id)} · {escape(q.domain)}</span>'


def worst_section(comparison: Comparison, model: ModelResult, thumbs: dict[str, str] | None) -> str:
    """A model's ten worst queries: text, AP, rank of the first hit, top-5 and relevant images."""
    worst = worst_queries(model)
    head = f"<h2>Worst queries: {escape(model.model)}</h2>"
    if not worst:
        return head + '<p class="note">no per-query outcomes recorded.</p>'
    rows = []
    for q in worst:
        relevant = set(q.relevant)
        top = "".join(_item(i, thumbs, i in relevant) for i in q.top[:SHOWN_ITEMS])
        rel = "".join(_item(i, thumbs, False) for i in q.relevant[:SHOWN_ITEMS])
        extra = len(q.relevant) - SHOWN_ITEMS
        more = f' <span class="note">+{extra} more</span>' if extra > 0 else ""
        first = "none" if q.first_hit is None else str(q.first_hit)
        rows.append(f"<tr><td>{_query_cell(comparison, q)}</td><td>{q.ap:.3f}</td><td>{first}</td>"
                    f'<td><div class="items">{top}</div></td><td><div class="items">{rel}{more}</div></td></tr>')
    return (head + '<table class="worst"><tr><th>query</th><th>AP</th><th>first hit</th><th>top 5</th>'
            "<th>relevant</th></tr>\n" + "\n".join(rows) + "</table>")
