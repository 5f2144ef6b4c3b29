"""The compare stage of ``rde evaluate``: every retriever side by side on one benchmark, with paired
bootstrap differences against the reference; its table and chart in the Prefect UI and its
reports (``report.html``, ``report.md``) beside the artifacts."""

from __future__ import annotations

import pyarrow as pa

from rde.evaluation.comparison_io import comparison_from_rows, difference_rows
from rde.evaluation.plan import EvaluationPlan
from rde.evaluation.scoring import metric_names
from storage.evaluation_schemas import COMPARISON
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write


class Compare(Stage):
    """The models' metrics with intervals, and each model's paired difference from the reference
    over the queries both scored (the same resampled queries for both: a paired bootstrap)."""

    version = "1"
    config = ("evaluation.map_cutoffs", "evaluation.bootstrap_resamples")
    title = "Every retriever side by side"
    row_unit = "models"

    def __init__(self, plan: EvaluationPlan) -> None:
        self.plan = plan
        self.name = "compare"
        self.reads = tuple(f"{plan.model_folder(s)}/{part}" for s in plan.models
                           for part in ("evaluation", "per_query"))
        self.writes = (Write(f"{plan.folder}/comparison", "comparison", COMPARISON),)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(extra={"models": [s.text for s in self.plan.models], "reference": self.plan.reference.text})

    def _read(self, run: StageRun, part: str) -> dict[str, list[dict]]:
        return {s.text: run.input(f"{self.plan.model_folder(s)}/{part}").rows() for s in self.plan.models}

    def run(self, run: StageRun) -> Work:
        section = run.section("evaluation")
        rows = difference_rows([s.text for s in self.plan.models], self._read(run, "evaluation"),
                               self._read(run, "per_query"), self.plan.reference.text,
                               metric_names(section.map_cutoffs), section.bootstrap_resamples)
        return Work.one({self.writes[0].name: pa.Table.from_pylist(rows, schema=COMPARISON)},
                        {"input_rows": len(self.plan.models), "accepted": len(self.plan.models)})

    def comparison(self, run: StageRun):
        """The comparison as every view renders it, read back from the artifacts."""
        from storage.filesystem import join

        bench = self.plan.benchmark
        cutoffs = run.section("evaluation").map_cutoffs
        names = metric_names(cutoffs)
        runs = {s.text: join(run.output_url(self.plan.model_folder(s)), "run.trec") for s in self.plan.models}
        return comparison_from_rows(run.output_artifact(self.writes[0].name).rows(), self._read(run, "per_query"),
                                    names, bench.review_links, headline_k=20 if 20 in cutoffs else cutoffs[0],
                                    run_files=runs)

    def report(self, run: StageRun, result: StageResult) -> Report:
        from rde.evaluation.report import comparison_rows, write_report
        from rde.evaluation.report_chart import chart_markdown

        comparison = self.comparison(run)
        folder = run.output_url(self.plan.folder)
        if "://" not in folder:
            bench = self.plan.benchmark
            for suffix in ("html", "md"):
                write_report(f"{folder}/report.{suffix}", comparison, bench.gallery.encoded)
        key = self.plan.folder
        return Report(tables=[(f"{key}-comparison", comparison_rows(comparison), comparison.title())],
                      markdown=[(f"{key}-chart", chart_markdown(comparison), f"Metrics with 95 % intervals: "
                                 f"{comparison.title()}")],
                      log=f"compare: {len(comparison.models)} models on {comparison.title()}; report: "
                          f"{folder}/report.html")
