"""``evaluate``: any retriever on any built benchmark, side by side (``rde evaluate``).

Per retriever: its gallery embedded per shard (a GPU stage that fans out over the pool) and its
queries ranked and scored; then every retriever compared with paired bootstrap differences. Each
stage is keyed by its model's lineage, the benchmark's content and the labels, so a rerun skips what
it has and an added model embeds only for itself.
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from rde.evaluation.plan import forget_benchmarks
from rde.profile import deep_merge
from tasks.evaluation import FLOW_NAME, evaluation_pipeline
from tasks.framework.context import RunContext, run_locked
from tasks.framework.runner import run_pipeline
from tasks.framework.summary import publish_summary
from tasks.framework.task_runners import default_task_runner
from tasks.pool.summary import run_summary

# what a shard-range run of a fanned-out stage builds its stages from: the profile's evaluation section
PIPELINE = evaluation_pipeline
STAGES: tuple[str, ...] = ()


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def evaluate(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
             benchmark: str | None = None, models: list[str] | None = None, labels: str | None = None,
             reference: str | None = None, report: str | None = None) -> dict[str, Any]:
    """Score ``models`` (model specs; default: the profile's experts) on ``benchmark`` (default: the
    profile's build-secmm benchmark) with ``labels``; write ``report`` (.md, .csv or .html) too when
    given. Returns the run summary with the comparison's folder."""
    given = {k: v for k, v in {"benchmark": benchmark, "models": models, "labels": labels,
                               "reference": reference}.items() if v}
    merged = deep_merge(overrides or {}, {"evaluation": given}) if given else overrides
    return run_locked(FLOW_NAME, STAGES, profile, merged, output_root, None,
                      lambda ctx, _until: _run(ctx, report))


def _run(ctx: RunContext, report: str | None) -> dict[str, Any]:
    forget_benchmarks()  # read as it is now, not as an earlier run in this process saw it
    pipeline = evaluation_pipeline(ctx.profile, ctx.output_root)
    results = run_pipeline(ctx, pipeline, None)
    summary = run_summary(ctx, results)
    compare = pipeline.stages[-1]
    summary["comparison"] = compare.writes[0].name
    summary["benchmark"] = compare.plan.benchmark.describe()
    if report:
        from rde.evaluation.report import write_report
        from tasks.framework.stage import StageRun

        bench = compare.plan.benchmark
        summary["report"] = str(write_report(report, compare.comparison(StageRun(compare, ctx)),
                                             bench.gallery.encoded))
    publish_summary(FLOW_NAME, summary)
    return summary


if __name__ == "__main__":
    evaluate()
