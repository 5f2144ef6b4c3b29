"""``rde`` commands that run a flow (build-secmm, build-largefine, the training flows, index-cache,
rerank): options to overrides, the flow run guarded against Ctrl-C and SIGTERM, its summary."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from entry.cli_base import (
    InputKindOpt,
    InputOpt,
    ProfileOpt,
    VerboseOpt,
    _fail,
    _parse_sets,
    _user_errors,
    app,
    console,
    err_console,
    print_summary,
)
from entry.console_progress import QuietTaskRuns, live_progress


@app.command("build-secmm")
def build_secmm_cmd(
    profile: ProfileOpt = "demo",
    input_path: InputOpt = None,
    input_kind: InputKindOpt = None,
    output: Annotated[str | None, typer.Option(help="Artifacts root (path or fsspec URL).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set denoise.min_laplacian_variance=100")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    until: Annotated[str | None, typer.Option(help="Stop after this stage: denoise, queries, gallery, "
                                              "candidates, benchmark, evaluate.")] = None,
    retry_rejects: Annotated[bool, typer.Option("--retry-rejects", help="Redo, in finished stages, only the inputs "
                                                "rejected for a transient reason (read_error, access_denied, "
                                                "generation_failed, timeout); every other row is kept.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run the build-secmm flow: ingest → denoise → near-duplicates → caption pool → DAP queries → CGDS gallery →
    MECF candidates → benchmark export → evaluation.

    Finished stages are skipped on a rerun with the same inputs and config; an interrupted
    stage resumes at its first missing shard.
    """
    _run_flow(FlowRef("build_secmm"), profile, input_path, input_kind, output, sets, as_json, until,
              extra={"retry_rejects": True} if retry_rejects else None, verbose=verbose)


@app.command("build-largefine")
def build_largefine_cmd(
    profile: ProfileOpt = "demo",
    input_path: InputOpt = None,
    input_kind: InputKindOpt = None,
    output: Annotated[str | None, typer.Option(help="Artifacts root (path or fsspec URL).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set largefine.max_images=40")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    until: Annotated[str | None, typer.Option(help="Stop after this stage: denoise, neighbours, tiers, "
                                              "gallery, advanced, export.")] = None,
    retry_rejects: Annotated[bool, typer.Option("--retry-rejects", help="Redo, in finished stages, only the inputs "
                                                "rejected for a transient reason (read_error, access_denied, "
                                                "generation_failed, timeout); every other row is kept.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Run the build-largefine flow (GTR+ generation): ingest → denoise → hard-negative neighbours →
    base + intermediate tiers → template gallery → advanced tier → LargeFine-style shards + card."""
    _run_flow(FlowRef("build_largefine"), profile, input_path, input_kind, output, sets, as_json, until,
              extra={"retry_rejects": True} if retry_rejects else None, verbose=verbose)


@app.command("train-saft")
def train_saft_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root (the build-largefine run's).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set training.saft_objective=itc")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """SAFT fine-tuning (ITC + SASS + ISD) on the build-largefine captions; evaluation on the check set."""
    _run_flow(FlowRef("train_saft"), profile, None, None, output, sets, as_json, None, verbose=verbose)


@app.command("train-gtr")
def train_gtr_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root (the build-largefine run's).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set training.gtr_weighting=fix")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """GTR+ confidence-weighted training (ITC + ITM, GMM weights) on the build-largefine captions."""
    _run_flow(FlowRef("train_gtr"), profile, None, None, output, sets, as_json, None, verbose=verbose)


@app.command("train-vedje")
def train_vedje_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root.")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set vedje.tokens_per_frame=1")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Train the cached joint reranker (compressor + MiniLM joint encoder; VTM+VTC+MLM+delta)."""
    _run_flow(FlowRef("train_vedje"), profile, None, None, output, sets, as_json, None, verbose=verbose)


@app.command("index-cache")
def index_cache_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root (the train-vedje run's).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set vedje.precision=fp8")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Write per-item reranker caches (backbone → trained compressor → BF16/FP8/FP4 rows) + stage-1 index."""
    _run_flow(FlowRef("index_cache"), profile, None, None, output, sets, as_json, None, verbose=verbose)


@app.command("rerank")
def rerank_cmd(
    profile: ProfileOpt = "demo",
    query: Annotated[list[str] | None, typer.Option("--query", help="A text query (repeatable); default: the "
                                                   "labelled test captions, with R@K.")] = None,
    output: Annotated[str | None, typer.Option(help="Artifacts root (the index-cache run's).")] = None,
    sets: Annotated[list[str] | None, typer.Option("--set", help="Override a profile key, e.g. "
                                                  "--set 'vedje.candidates=[20]'")] = None,
    top: Annotated[int, typer.Option("--top", min=1, help="With --query: ranked items shown per query.")] = 10,
    as_json: Annotated[bool, typer.Option("--json", help="Print the summary (with --query: and the ranked "
                                          "items, ranks from 1) as JSON.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Rerank stage-1 candidates from the stored caches (text → search → cache fetch → joint score);
    with --query, print each query's top items: rank, item, score, stage-1 rank, a clip's time span."""
    flow_ref = FlowRef("rerank")

    def add_results(summary: dict[str, Any], prof: Any) -> None:
        from tasks.framework.context import RunContext
        from tasks.vedje import top_results

        url = summary["artifacts"]["reranked"]["url"]
        summary["results"] = top_results(RunContext(prof, flow_ref.name, output), url, top)

    _run_flow(flow_ref, profile, None, None, output, sets, as_json, None, {"queries": query or None},
              add_results if query else None, verbose=verbose)


class FlowRef:
    """A flow the CLI runs, imported only once its profile and input are valid: importing a flow
    pulls in Prefect and torch (about 5 s here), and a typo in ``--profile`` or ``--set`` should be
    answered at once. ``module``: the module under ``flows/`` and its flow function's name."""

    def __init__(self, module: str) -> None:
        self.module = module
        self.name = module.replace("_", "-")  # the flow's name (FLOW_NAME), its artifacts' folder

    def load(self) -> Any:
        import importlib

        return getattr(importlib.import_module(f"flows.{self.module}"), self.module)

    def stop_names(self) -> tuple[str, ...]:
        """What the flow's ``--until`` accepts (its module's ``STAGES``): importing the module
        defines the flow and starts nothing (no Prefect server, no run)."""
        import importlib

        return tuple(importlib.import_module(f"flows.{self.module}").STAGES)


INPUT_KINDS = ("folder", "paths", "pool", "video", "webdataset", "image_parquet")  # InputSpec.kind


def _check_input_kind(input_path: str | None, input_kind: str | None) -> None:
    """``--input-kind`` names a kind and comes with ``--input`` (alone it would be ignored)."""
    if input_kind is None:
        return
    if input_kind not in INPUT_KINDS:
        _fail(f"--input-kind {input_kind!r} is not an input kind; valid kinds: {', '.join(INPUT_KINDS)}")
    if not input_path:
        _fail(f"--input-kind {input_kind} needs --input (the folder, Parquet path list or pool it describes)")


def _check_until(flow_ref: FlowRef, until: str | None) -> None:
    """``--until`` names a stop of the flow; checked before the run lock and Prefect, so a typo is one
    line listing the valid names, not a failed flow run's traceback."""
    if until is None:
        return
    valid = flow_ref.stop_names()
    if until not in valid:
        _fail(f"--until {until!r} is not a stage of {flow_ref.name}; valid names: {', '.join(valid)}")


def _run_flow(flow_ref: FlowRef, profile: str, input_path: str | None, input_kind: str | None, output: str | None,
              sets: list[str] | None, as_json: bool, until: str | None, extra: dict[str, Any] | None = None,
              add: Callable[[dict[str, Any], Any], None] | None = None, verbose: bool = False,
              overrides_given: dict[str, Any] | None = None) -> dict[str, Any]:
    """Validate profile and input before Prefect starts, run the flow (a live progress line per
    running stage on a terminal), let ``add`` extend its summary (with the validated profile), print
    it and return it (``overrides_given``: overrides the command built, under its ``--set``); user errors exit 2
    with a message, an unbalanced accounting exits 2 after the summary."""
    overrides = _parse_sets(sets or [])
    if overrides_given:
        from rde.profile import deep_merge

        overrides = deep_merge(overrides_given, overrides)
    _check_input_kind(input_path, input_kind)
    if input_path:
        kind = input_kind or _guess_kind(input_path)
        location = input_path if "://" in input_path else str(Path(input_path).resolve())
        overrides.setdefault("input", {}).update({"kind": kind, "path": location})
    try:
        from rde.common.input_listing import check_input
        from rde.common.run_lock import output_lock
        from rde.profile import load_profile
        from storage.locations import project_root
        from tasks.framework.context import RunContext

        prof = load_profile(profile, overrides)  # validate before starting Prefect
        check_input(prof.input, project_root())
        _check_until(flow_ref, until)
        root = RunContext(prof, flow_ref.name, output).root
        with output_lock(root, flow_ref.name):  # checked before Prefect starts
            flow_fn = flow_ref.load()
            guard = _guarded(root)
            # per-task lines and a user error's traceback stay off the terminal unless --verbose (the
            # error prints as one line below); the guard's hook lines always
            with live_progress(err_console, QuietTaskRuns(verbose, guard.hooks, _user_errors())):
                flow_fn = guard.watching(flow_fn)
                stop = {"until": until} if until is not None else {}  # a flow without stops takes no until
                summary = guard.run(lambda: flow_fn(profile=profile, overrides=overrides or None,
                                                    output_root=output, **stop, **(extra or {})))
        if add is not None:
            add(summary, prof)
    except _user_errors() as exc:
        _fail(str(exc))
        raise  # _fail exits
    except Exception as exc:
        from entry.temporary_server import exit_note

        if (note := exit_note()) is None:
            raise
        _fail(f"{type(exc).__name__}: {exc}\n{note}")  # the cause is the server's, in its log
        raise
    if as_json:
        from entry.evaluation_view import evaluation_of

        summary.setdefault("evaluation", evaluation_of(summary))
        console.print_json(json.dumps(summary))
    else:
        print_summary(summary)
    if not summary["balanced"]:
        from tasks.framework.summary import unbalanced_message

        _fail(unbalanced_message(summary))
    return summary


def _started_as_cli() -> bool:
    """Whether this process is the ``rde`` command (its ``__main__`` runs this app), not a test
    invoking the app in-process: only then do signals stop the process and a watcher guard it."""
    return getattr(sys.modules.get("__main__"), "app", None) is app


class _Unguarded:
    """Runs a flow call as it is (a test invoking the app in-process keeps its own signals)."""

    hooks: tuple[str, ...] = ()

    @staticmethod
    def watching(flow: Any) -> Any:
        return flow

    @staticmethod
    def run(call: Callable[[], Any]) -> Any:
        return call()


def _guarded(root: str) -> Any:
    """The guard a flow call runs under (``entry.interrupt``): a signal prints what is complete
    and how to resume, stops every process of the run and exits 130/143; a watcher stops them after
    a SIGKILL. In-process (tests), the call runs as it is."""
    if not _started_as_cli():
        return _Unguarded()
    import shlex

    from entry import temporary_server
    from entry.interrupt import RunGuard
    from rde.common.run_state import stop_summary

    def end_live_display() -> None:
        for live in list(getattr(err_console, "_live_stack", [])):
            live.stop()
        err_console.show_cursor(True)

    local = "://" not in root
    return RunGuard(lambda: stop_summary(root) if local else f"artifacts under {root}",
                    shlex.join(["rde", *sys.argv[1:]]), before_exit=end_live_display,
                    prepare=temporary_server.ensure_api)


def _guess_kind(path: str) -> str:
    """A ``.tar`` (``.tar.gz``, ``.tgz``) is WebDataset; a ``.parquet`` a path list, or an image Parquet when it has an
    image-bytes column and no ``path``; a folder with a manifest a pool; anything else a folder."""
    name = path.rstrip("/").lower()
    if name.endswith((".tar", ".tar.gz", ".tgz")):
        return "webdataset"
    if name.endswith(".parquet"):
        from rde.common.input_listing import parquet_input_kind

        return parquet_input_kind(path)
    if "://" not in path and (Path(path) / "_manifest.json").exists():
        return "pool"
    return "folder"


