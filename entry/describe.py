"""``rde describe PIPELINE``: a pipeline's stages as they declare themselves (whole or per shard,
device, reads, writes, declared config, the reject reasons they can write), the same table the
pipeline pages of the docs hold (both from ``flows.catalog``)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from entry.cli_base import _fail, app, console

if TYPE_CHECKING:
    from flows.catalog import PipelineTable, StageRow


@app.command("describe")
def describe_cmd(
    pipeline: Annotated[str, typer.Argument(help="A pipeline, named as its command (build-secmm, train-vedje, "
                                            "evaluate, ...); an unknown name lists them all.")],
    as_json: Annotated[bool, typer.Option("--json", help="Print the table as JSON.")] = False,
) -> None:
    """Print a pipeline's stages as they declare themselves: whole input or per shard, device, the
    artifacts each reads and writes, the profile config it declares (all that is in its key besides
    its models and prompts) and the reject reasons it can write. An unknown name lists the pipelines."""
    from flows.catalog import UnknownPipeline, as_dict, describe

    try:
        table = describe(pipeline)
    except UnknownPipeline as exc:
        _fail(str(exc))
        raise  # unreachable: _fail exits
    if as_json:
        console.print_json(json.dumps(as_dict(table)))
        return
    if console.width >= WIDE:
        console.print(_as_table(table))
    else:
        _print_blocks(table)
    if table.note:
        console.print(escape(table.note.replace("`", "")))


# the narrowest terminal the eight-column table reads in (stage and reason names unbroken); narrower,
# each stage is a block of lines
WIDE = 150


def _title(table: PipelineTable) -> str:
    return f"{table.name}: {len(table.rows)} stage{'s' if len(table.rows) != 1 else ''}"


def _cells(row: StageRow) -> list[list[str]]:
    from flows.catalog import reads_text, reasons_text, writes_text

    return [reads_text(row), writes_text(row), list(row.config), reasons_text(row)]


def _as_table(table: PipelineTable) -> Table:
    out = Table(title=_title(table), show_lines=True)
    for column in ("#", "stage", "work", "device", "reads", "writes", "config it declares",
                   "reject reasons it can write"):
        out.add_column(column, overflow="fold")
    for n, row in enumerate(table.rows, 1):
        stage = row.name + (f"\n(only when {row.when})" if row.when else "")
        device = row.device_text + (f"\nbatch: {row.batch_size}" if row.batch_size else "")
        out.add_row(str(n), escape(stage), row.work, escape(device),
                    *(escape("\n".join(c) or "–") for c in _cells(row)))
    return out


def _print_blocks(table: PipelineTable) -> None:
    """One block per stage: its name, work and device on a line, then a line per column."""
    console.print(f"[bold]{escape(_title(table))}[/bold]")
    for n, row in enumerate(table.rows, 1):
        head = f"{n}. {row.name}: {row.work}, {row.device_text}"
        head += f" (batch: {row.batch_size})" if row.batch_size else ""
        head += f", only when {row.when}" if row.when else ""
        console.print()
        console.print(f"[bold]{escape(head)}[/bold]")
        for label, cell in zip(("reads", "writes", "config it declares", "reject reasons it can write"), _cells(row),
                               strict=True):
            console.print(f"  {label}: {escape(', '.join(cell) or '–')}")
