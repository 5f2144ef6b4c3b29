"""A comparison between the artifacts and the ``Comparison`` every view renders: the paired
differences against the reference from the models' per-query outcomes, and the comparison read
back from the rows the compare stage wrote."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rde.evaluation.metrics import paired_difference
from rde.evaluation.results import Comparison, Interval, ModelResult, QueryOutcome


def per_query_metrics(outcomes: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, float]]:
    """query id → metric → value, from per-query outcome rows."""
    return {r["query_id"]: {m["name"]: m["value"] for m in r["metrics"]} for r in outcomes}


def difference_rows(models: Sequence[str], metric_rows: Mapping[str, list[dict[str, Any]]],
                    outcomes: Mapping[str, list[dict[str, Any]]], reference: str, names: Sequence[str],
                    resamples: int) -> list[dict[str, Any]]:
    """Every model's metric rows, with (over all queries) its paired bootstrap difference against
    the reference on the queries both scored; the reference's own rows carry none."""
    ref = per_query_metrics(outcomes[reference])
    out = []
    for model in models:
        diff: dict[str, Interval] = {}
        if model != reference and len(models) > 1:
            diff = paired_difference(per_query_metrics(outcomes[model]), ref, tuple(names), resamples=resamples)
        for row in metric_rows[model]:
            d = diff.get(row["metric"]) if row["domain"] == "all" else None
            out.append({**row, "reference": reference, "diff_mean": d.mean if d else None,
                        "diff_low": d.low if d else None, "diff_high": d.high if d else None})
    return out


def comparison_from_rows(rows: Sequence[Mapping[str, Any]], outcomes: Mapping[str, list[dict[str, Any]]],
                         names: Sequence[str], review_links: Mapping[str, str] | None = None,
                         headline_k: int = 20, run_files: Mapping[str, str] | None = None) -> Comparison:
    """The ``Comparison`` of the compare stage's rows and each model's per-query outcome rows."""
    if not rows:
        raise ValueError("no comparison rows")
    models = list(dict.fromkeys(r["model"] for r in rows))
    results = []
    for model in models:
        mine = [r for r in rows if r["model"] == model]
        metrics: dict[str, dict[str, Interval]] = {}
        queries: dict[str, int] = {}
        for r in mine:
            metrics.setdefault(r["domain"], {})[r["metric"]] = Interval(r["mean"], r["low"], r["high"])
            queries[r["domain"]] = int(r["queries"])
        diffs = {r["metric"]: Interval(r["diff_mean"], r["diff_low"], r["diff_high"]) for r in mine
                 if r["domain"] == "all" and r.get("diff_mean") is not None}
        results.append(ModelResult(model, metrics, queries, _outcomes(outcomes.get(model, []), headline_k),
                                   diffs or None, (run_files or {}).get(model, "")))
    first = rows[0]
    return Comparison(first["benchmark"], first["labels"], results, first.get("reference"), tuple(names), headline_k,
                      dict(review_links or {}))


def _outcomes(rows: Sequence[Mapping[str, Any]], headline_k: int) -> list[QueryOutcome]:
    out = []
    for r in rows:
        values = {m["name"]: m["value"] for m in r["metrics"]}
        ap = values.get(f"mAP@{headline_k}", next((v for k, v in values.items() if k.startswith("mAP@")), 0.0))
        out.append(QueryOutcome(r["query_id"], r["domain"], r["text"], float(ap), r["first_hit"], tuple(r["top"]),
                                tuple(r["relevant"])))
    return out
