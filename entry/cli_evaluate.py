"""``rde evaluate``: any retriever on any built benchmark, side by side with 95 % intervals."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from entry.cli_base import ProfileOpt, VerboseOpt, _fail, _parse_sets, _user_errors, app, console
from entry.cli_flows import FlowRef, _run_flow

MODEL_HELP = ("A retriever (repeatable): transformers-clip:<id or folder>, sentence-transformers:<id or folder>, "
              "open-clip:<arch>:<tag or checkpoint>, expert:<name>, student:<path>, python:<module>:<factory>, "
              "scores:<run file or Parquet>. Default: the profile's experts.")


def models_from_file(path: str) -> list[str]:
    """One model spec a line; blank lines and ``#`` comments skipped."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"--models {path}: {exc.strerror or exc}") from None
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def evaluation_overrides(benchmark: str | None, models: list[str], labels: str | None, reference: str | None,
                         k: list[int] | None) -> dict[str, Any]:
    """The options as the profile's ``evaluation`` section (what a deployment run passes too)."""
    section: dict[str, Any] = {}
    if benchmark:
        section["benchmark"] = benchmark if "://" in benchmark else str(Path(benchmark).resolve())
    if models:
        section["models"] = models
    for key, value in (("labels", labels), ("reference", reference), ("map_cutoffs", k)):
        if value:
            section[key] = value
    return {"evaluation": section} if section else {}


def check_before_run(profile: str, overrides: dict[str, Any], output: str | None) -> None:
    """Parse every model spec, open the benchmark, read every scores file, fingerprint every model's
    files and, unless the run fans out to a pool, load and probe every ``python:`` factory (the user
    code most likely to be wrong) before Prefect starts: a typo, a benchmark without qrels, a
    factory that returns NaN, is one line at once. Other models load in their stages (a rerun that
    skips them loads none)."""
    from rde.evaluation.plan import loaded_retriever, plan_evaluation
    from rde.evaluation.scores_file import read_scores
    from rde.profile import load_profile

    prof = load_profile(profile, overrides)
    plan = plan_evaluation(prof, output)
    for spec in plan.models:
        if spec.kind == "scores":
            read_scores(spec.target, [q["query_id"] for q in plan.benchmark.queries], plan.benchmark.gallery.ids())
            continue
        lineage = plan.lineage(spec)  # a missing folder, file or profile expert is named here
        if spec.kind == "python" and not prof.prefect.fanout.enabled:
            with contextlib.redirect_stdout(sys.stderr):  # a user's prints stay off --json's stdout
                loaded_retriever(spec, prof, lineage)


@app.command("evaluate")
def evaluate_cmd(
    benchmark: Annotated[str | None, typer.Option(help="A build-secmm benchmark folder or s3:// prefix, its "
                                                  "dataset folder, a check-set YAML or a clip set (default: the "
                                                  "profile's build-secmm benchmark).")] = None,
    model: Annotated[list[str] | None, typer.Option("--model", "-m", help=MODEL_HELP)] = None,
    models_file: Annotated[str | None, typer.Option("--models", help="A file of model specs, one a line.")] = None,
    labels: Annotated[str | None, typer.Option(help="verified | pending | all (default: verified when any "
                                               "exist, else pending: the unreviewed MECF union).")] = None,
    reference: Annotated[str | None, typer.Option(help="The model the others' paired differences are taken "
                                                  "against (default: the first).")] = None,
    k: Annotated[list[int] | None, typer.Option("--k", min=1, help="A cut-off K of mAP@K (repeatable; default "
                                                "10, 20, 30).")] = None,
    report: Annotated[str | None, typer.Option(help="Also write the comparison to this file: .md, .csv or "
                                               ".html (self-contained).")] = None,
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root (path or fsspec URL).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set evaluation.bootstrap_resamples=2000")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary and the comparison as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Score retrievers on a benchmark: mAP@10/20/30, R@1/5/10, mINP, nDCG@10 and MRR per domain with
    95 % bootstrap intervals, paired differences against a reference, a TREC run file per model and
    a report. A rerun skips what it has; an added model is the only one embedded."""
    if report and ("://" in report or Path(report).suffix.lower() not in (".md", ".csv", ".html")):
        _fail(f"--report {report}: a local .md, .csv or .html file")
    try:
        from rde.profile import deep_merge

        specs = [*(model or []), *(models_from_file(models_file) if models_file else [])]
        given = evaluation_overrides(benchmark, specs, labels, reference, k)
        check_before_run(profile, deep_merge(given, _parse_sets(sets or [])), output)
    except _user_errors() as exc:  # a spec, a benchmark, a profile key: one line
        _fail(str(exc))
        return
    flow_ref = FlowRef("evaluate")
    shown: list[Any] = []

    def add(summary: dict[str, Any], prof: Any) -> None:
        comparison, rows = _comparison(prof, output)
        shown.append(comparison)
        summary["comparison_rows"] = rows  # --json: every model's metric rows, with intervals and differences

    summary = _run_flow(flow_ref, profile, None, None, output, sets, as_json, None, {"report": report}, add,
                        verbose=verbose, overrides_given=given)
    if not as_json:
        _print_comparison(shown[0], summary.get("report"), summary.get("benchmark", {}))


def _comparison(prof: Any, output: str | None) -> tuple[Any, list[dict[str, Any]]]:
    """The run's comparison (as the terminal shows it) and the compare stage's rows."""
    from tasks.evaluation import evaluation_pipeline
    from tasks.framework.context import RunContext
    from tasks.framework.stage import StageRun

    compare = evaluation_pipeline(prof, output).stages[-1]
    run = StageRun(compare, RunContext(prof, "evaluate", output))
    return compare.comparison(run), run.output_artifact(compare.writes[0].name).rows()


def _print_comparison(comparison: Any, report: str | None, bench: dict[str, Any]) -> None:
    from rich.markup import escape

    from entry.evaluation_table import comparison_table, differences_table

    if bench:
        console.print(escape(f"benchmark {bench['benchmark']} ({bench['kind']}, {bench['location']}): "
                             f"{bench['queries']} queries scored, {bench['unlabelled_queries']} without a "
                             f"{bench['labels']} relevant item in the gallery; {bench['gallery']} gallery items; "
                             f"{bench['pending_pairs']} unreviewed candidate pairs"))
    console.print(comparison_table(comparison))
    diffs = differences_table(comparison)
    if diffs is not None:
        console.print(diffs)
    if report:
        console.print(f"report: {report}")
