"""What every ``rde`` command shares: the Typer apps, the consoles, the common options, the
user-error handling and the summary printers."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Annotated, Any

import typer
import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from rde.common.runtime import configure_prefect_env

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


def _profile_or_fail(name: str, overrides: dict[str, Any] | None = None):
    """The validated profile (with ``overrides``, e.g. from ``--set``), or exit 2 with the
    validation message."""
    from rde.profile import ProfileError, load_profile

    try:
        return load_profile(name, overrides)
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
    from entry.temporary_server import ServerStartError
    from rde.common.input_listing import InputError
    from rde.common.run_lock import RunLockedError
    from rde.profile import ProfileError
    from storage import ArtifactError
    from storage.filesystem import StorageWriteError
    from tasks.framework.accounting import AccountingError

    # AccountingError: a stage's rows did not add up; its message names the stage and the counts,
    # and nothing of that stage was marked complete (a traceback would add nothing for a user)
    return (ProfileError, InputError, ArtifactError, StorageWriteError, RunLockedError, FileNotFoundError,
            PermissionError, ValueError, AccountingError, ServerStartError)


InputOpt = Annotated[str | None, typer.Option("--input", help="Images: a folder, a Parquet file with a 'path' "
                                             "column, a pool artifact folder, WebDataset .tar shard(s), an image "
                                             "Parquet, or videos; a path or a URL such as s3://bucket/prefix/.")]
InputKindOpt = Annotated[str | None, typer.Option(help="folder | paths | pool | video | webdataset | image_parquet "
                                                  "(guessed from --input).")]


def print_summary(summary: dict[str, Any]) -> None:
    """The run summary: stages, rejected rows by reason, where the inputs went (splits when the
    flow has them), captioning throughput, what its evaluation found (zero-shot vs trained, stage 1
    vs rerank, or per expert and domain), a rerank's ranked items, the artifacts root."""
    from entry.evaluation_view import evaluation_of, evaluation_table
    from tasks.framework.reporting import accounting_line
    from tasks.framework.summary import balance_mark

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
    for stage, counts in summary.get("retried", {}).items():
        console.print(f"{stage}: {counts['retried']} inputs with a transient reject retried, "
                      f"{counts['recovered']} recovered, {counts['retried'] - counts['recovered']} failing again")
    if summary.get("domains"):
        console.print("accepted images by domain: " + ", ".join(f"{k} {v}" for k, v in summary["domains"].items()))
    for name in summary.get("empty_domains", []):
        console.print(f"[yellow]domain {name}: no images accepted[/] (the input shows none that pass denoise); "
                      "its queries, gallery and candidates are empty")
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


