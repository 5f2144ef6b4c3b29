"""What a run's evaluation found, as compact terminal tables: the rows a flow's evaluation stage
wrote (``<stage>.evaluation`` artifacts in its summary), read back once the run ends and shown
next to the stage table, so a user sees whether training beat zero-shot (or reranking beat
stage 1) without opening Parquet.

Three shapes, by what the rows hold:

- training (``train-saft``, ``train-gtr``): rows of the ``zero-shot`` model and of the trained
  method → a before/after table per benchmark, domain and metric, with the difference;
- reranking (``train-vedje``, ``rerank``): ``stage-1`` and ``rerank`` rankings → the same
  before/after table per candidates N_c and metric, a rerank column per cache precision;
- ``build-secmm``'s evaluation: each expert's metrics per benchmark and domain, one line each.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

EVALUATION = "evaluation"  # an artifact of evaluation rows is named this, or <stage>_evaluation
BASELINES = {"expert": "zero-shot", "ranking": "stage-1"}  # the "before" of a before/after table


def evaluation_of(summary: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """The evaluation rows of a run summary, per artifact name (``train_saft_evaluation`` ...): read
    from each complete evaluation artifact the summary lists; an artifact not written (a run
    stopped by ``--until``) is left out."""
    from storage import Artifact, ArtifactError

    found: dict[str, list[dict[str, Any]]] = {}
    for key, entry in summary.get("artifacts", {}).items():
        if key != EVALUATION and not key.endswith(f"_{EVALUATION}"):
            continue
        try:
            art = Artifact(entry["url"])
            if not art.is_complete():
                continue
            rows = art.rows()
        except (ArtifactError, FileNotFoundError):
            continue
        if rows:
            found[key] = rows
    return found


def _number(value: Any, percent: bool = False) -> str:
    """A metric value: three decimals for a fraction, one for a percentage (vedje reports R@K in %)."""
    if value is None:
        return ""
    return f"{value:.1f}" if percent else f"{value:.3f}"


def _percent(rows: list[dict[str, Any]]) -> bool:
    return any(r["value"] > 1.0 for r in rows)


def _before_after(title: str, rows: list[dict[str, Any]], side: str, keys: tuple[str, ...],
                  shared: tuple[str, ...] = ()) -> Table:
    """One line per ``keys`` value (and metric): the baseline's value, each other model's, and
    the change from the baseline (green when higher, red when lower: every metric here is
    higher-better). ``shared``: keys the baseline is not split by (stage 1 ranks the whole
    gallery, its rows say N_c 0): its value then shows on each line that matches it on the rest."""
    before = BASELINES[side]
    others = list(dict.fromkeys(r[side] for r in rows if r[side] != before))
    lines: dict[tuple[Any, ...], dict[str, float]] = {}
    for r in rows:
        lines.setdefault((*(r.get(k) for k in keys), r["metric"]), {})[r[side]] = r["value"]
    if shared:
        kept = [i for i, k in enumerate(keys) if k not in shared] + [len(keys)]

        def loose(line: tuple[Any, ...]) -> tuple[Any, ...]:
            return tuple(line[i] for i in kept)

        alone = {loose(line): values[before] for line, values in lines.items() if set(values) == {before}}
        used = set()
        for line, values in lines.items():
            if before not in values and loose(line) in alone:
                values[before] = alone[loose(line)]
                used.add(loose(line))
        lines = {line: values for line, values in lines.items()
                 if not (set(values) == {before} and loose(line) in used)}
    percent = _percent(rows)
    table = Table(title=title, title_justify="left")
    for k in (*keys, "metric"):
        table.add_column(k.replace("n_candidates", "N_c"), no_wrap=True)
    table.add_column(before, justify="right")
    for other in others:
        table.add_column(other, justify="right")
        table.add_column("Δ", justify="right")
    for line, values in lines.items():
        cells = [("" if v is None else str(v)) for v in line] + [_number(values.get(before), percent)]
        for other in others:
            cells.append(_number(values.get(other), percent))
            if before in values and other in values:
                delta = values[other] - values[before]
                colour = "green" if delta > 0 else "red" if delta < 0 else "dim"
                cells.append(f"[{colour}]{delta:+.1f}[/]" if percent else f"[{colour}]{delta:+.3f}[/]")
            else:
                cells.append("")
        table.add_row(*cells)
    return table


# the build's per-expert table shows the paper's metrics; the artifact (and `rde evaluate`) has them all
PER_EXPERT_SHOWN = ("mAP@10", "mAP@20", "mAP@30", "R@1", "R@5", "R@10")


def _per_expert(title: str, rows: list[dict[str, Any]]) -> Table:
    """One line per benchmark, expert and domain; one column per metric the paper reports
    (``PER_EXPERT_SHOWN``, where the rows have them; else every metric) and the query count."""
    found = list(dict.fromkeys(r["metric"] for r in rows))
    metrics = [m for m in PER_EXPERT_SHOWN if m in found] or found
    percent = _percent(rows)
    lines: dict[tuple[str, str, str], dict[str, Any]] = {}
    for r in rows:
        line = lines.setdefault((r["benchmark"], r["expert"], r["domain"]), {})
        line[r["metric"]] = r["value"]
        line["queries"] = r.get("queries")
    table = Table(title=title, title_justify="left")
    for col in ("benchmark", "expert", "domain", "queries"):
        table.add_column(col, no_wrap=True, justify="right" if col == "queries" else "left")
    for metric in metrics:
        table.add_column(metric, justify="right")
    for (bench, expert, domain), values in lines.items():
        table.add_row(bench, expert, domain, str(values.get("queries", "")),
                      *[_number(values.get(m), percent) for m in metrics])
    return table


def evaluation_table(key: str, rows: list[dict[str, Any]]) -> Table | None:
    """The table of one evaluation artifact's rows (``key``, its name, names its stage: ``evaluation``
    is the evaluate stage's), or None for no rows."""
    if not rows:
        return None
    stage = key.removesuffix(f"_{EVALUATION}") if key != EVALUATION else "evaluate"
    if "ranking" in rows[0]:  # one column per cache precision a rerank was scored at (stage 1 has none)
        rows = [{**r, "ranking": r["ranking"] if r["ranking"] == BASELINES["ranking"] or not r.get("precision")
                 else f"{r['ranking']} {r['precision']}"} for r in rows]
        return _before_after(f"{stage}: stage-1 vs rerank", rows, "ranking", ("n_candidates",),
                             shared=("n_candidates",))
    if any(r.get("expert") == BASELINES["expert"] for r in rows):
        trained = [r["expert"] for r in rows if r["expert"] != BASELINES["expert"]]
        name = trained[0] if trained else "trained"
        return _before_after(f"{stage}: zero-shot vs {name}", rows, "expert", ("benchmark", "domain"))
    return _per_expert(f"{stage}: per expert and domain", rows)
