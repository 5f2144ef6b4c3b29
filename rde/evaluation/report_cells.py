"""The cells and choices every rendering of a comparison shares (Markdown, HTML, the terminal): an
interval as text, which models and metrics are shown, the best per metric."""

from __future__ import annotations

from collections.abc import Callable

from rde.evaluation.results import Comparison, Interval, ModelResult

OVERALL = "all"  # the domain over every query
ImageSource = Callable[[list[str]], dict[str, bytes]]


def interval_text(iv: Interval, signed: bool = False) -> str:
    """``0.412 [0.371, 0.455]``, or with ``signed`` ``+0.031 [+0.004, +0.058]`` (a difference)."""
    fmt = "{:+.3f}" if signed else "{:.3f}"
    return f"{fmt.format(iv.mean)} [{fmt.format(iv.low)}, {fmt.format(iv.high)}]"


def excludes_zero(iv: Interval) -> bool:
    """Whether a difference's interval lies wholly on one side of 0 (the difference is significant)."""
    return iv.low > 0 or iv.high < 0


def domains(comparison: Comparison) -> list[str]:
    """The domains any model was scored on: ``all`` first, then the others in order of appearance."""
    seen = dict.fromkeys(d for m in comparison.models for d in m.metrics)
    return [OVERALL, *(d for d in seen if d != OVERALL)] if OVERALL in seen else list(seen)


def shown_metrics(comparison: Comparison, domain: str = OVERALL) -> list[str]:
    """The comparison's metrics, in its order, that at least one model has in ``domain``."""
    return [k for k in comparison.metrics if any(k in m.metrics.get(domain, {}) for m in comparison.models)]


def best_per_metric(comparison: Comparison, domain: str = OVERALL) -> dict[str, str]:
    """Metric → the model with the highest mean in ``domain`` (every metric is higher-better); on a
    tie the first model listed wins, so the mark does not depend on float noise in sort order."""
    best: dict[str, str] = {}
    for metric in shown_metrics(comparison, domain):
        top: tuple[float, str] | None = None
        for m in comparison.models:
            iv = m.metrics.get(domain, {}).get(metric)
            if iv is not None and (top is None or iv.mean > top[0]):
                top = (iv.mean, m.model)
        if top is not None:
            best[metric] = top[1]
    return best


def with_difference(comparison: Comparison) -> list[ModelResult]:
    """The models that carry a paired difference against the reference (none without one)."""
    if comparison.reference is None:
        return []
    return [m for m in comparison.models if m.difference and m.model != comparison.reference]


def query_summary(comparison: Comparison) -> str:
    """``36 queries (pedestrian 20, vehicle 16)`` from the first model's counts, or each model's
    count when they differ (a model that failed on some queries)."""
    counts = {m.model: m.queries.get(OVERALL, 0) for m in comparison.models}
    if len(set(counts.values())) > 1:
        return "queries: " + ", ".join(f"{name} {n}" for name, n in counts.items())
    if not comparison.models:
        return "0 queries"
    first = comparison.models[0].queries
    parts = [f"{d} {first[d]}" for d in domains(comparison) if d != OVERALL and d in first]
    return f"{first.get(OVERALL, 0)} queries" + (f" ({', '.join(parts)})" if parts else "")


# --- CSV -------------------------------------------------------------------------------------------
