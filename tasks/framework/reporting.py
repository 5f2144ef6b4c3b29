"""Prefect artifacts and logs for stages: a table per stage under a stable key."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import get_run_context

from rde.common.progress import StageProgress


def _in_prefect_run() -> bool:
    try:
        get_run_context()
    except Exception:
        return False
    return True


def log(message: str) -> None:
    """Log through Prefect's run logger inside a run, else print (plain-function use)."""
    if _in_prefect_run():
        get_run_logger().info(message)
    else:
        print(message)


def warn(message: str) -> None:
    """A warning through Prefect's run logger inside a run, else printed (plain-function use)."""
    if _in_prefect_run():
        get_run_logger().warning(message)
    else:
        print(f"warning: {message}")


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact with a stable key (it shows on the Artifacts page, newest first)."""
    if _in_prefect_run():
        create_table_artifact(key=key, table=rows, description=description)


def publish_markdown(key: str, markdown: str, description: str) -> None:
    if _in_prefect_run():
        create_markdown_artifact(key=key, markdown=markdown, description=description)


def rounded_rows(rows: list[dict[str, Any]], digits: int) -> list[dict[str, Any]]:
    """Rows for a table artifact with every float rounded to ``digits`` (metrics read at a glance)."""
    return [{k: (round(v, digits) if isinstance(v, float) else v) for k, v in r.items()} for r in rows]


def stage_table(stage: str, input_rows: int, accepted: int, rejected: dict[str, int],
                skipped: bool) -> list[dict[str, Any]]:
    """Rows of a stage table: totals, then one row per rejection reason with its share."""
    rows: list[dict[str, Any]] = [
        {"stage": stage, "measure": "input", "count": input_rows, "share": 1.0 if input_rows else 0.0},
        {"stage": stage, "measure": "accepted", "count": accepted,
         "share": round(accepted / input_rows, 4) if input_rows else 0.0},
    ]
    for reason, count in sorted(rejected.items(), key=lambda kv: -kv[1]):
        rows.append({"stage": stage, "measure": f"rejected:{reason}", "count": count,
                     "share": round(count / input_rows, 4) if input_rows else 0.0})
    rows.append({"stage": stage, "measure": "skipped (complete for same inputs)", "count": int(skipped),
                 "share": 0.0})
    return rows


SPLIT_NAMES = {"held_out": "held-out"}  # how a split key reads in summaries (others read as they are)


def split_name(key: str) -> str:
    return SPLIT_NAMES.get(key, key)


def accounting_line(summary: dict[str, Any]) -> str:
    """``inputs N = train a + held-out b + rejected c`` (or ``accepted a + rejected c`` without splits):
    where a run's inputs went, from a summary's ``inputs``, ``splits``, ``accepted``, ``total_rejected``."""
    parts = [f"{split_name(k)} {v}" for k, v in (summary.get("splits") or {}).items()]
    kept = " + ".join(parts) if parts else f"accepted {summary['accepted']}"
    return f"inputs {summary['inputs']} = {kept} + rejected {summary['total_rejected']}"


class Progress:
    """A stage's progress, reported once for both places people look: a Prefect progress artifact
    (0-100 %, stable key; a no-op outside a Prefect run; updated per whole percent) for the UI, and
    the process-local display of :mod:`rde.common.progress` (drawn by the CLI on a terminal). ``done`` and
    ``total`` count ``unit`` (shards, frames, steps...; a total first known later comes with ``update``).
    Update it from the thread that runs the stage."""

    def __init__(self, key: str, description: str, *, stage: str, total: float | None, unit: str,
                 item_unit: str = "") -> None:
        self.total = total
        self.percent = 0
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description) \
            if _in_prefect_run() else None
        self.local = StageProgress(stage, total, unit, item_unit)

    def update(self, done: float, total: float | None = None, items: float | None = None) -> None:
        """``done`` of ``total`` finished (``items``: the rows of ``item_unit`` they held, so far)."""
        self.total = total if total is not None else self.total
        self.local.update(done, total, items)
        if not self.total:
            return
        percent = int(min(100.0, 100.0 * done / self.total))
        if self.artifact_id is not None and percent > self.percent:
            self.percent = percent
            update_progress_artifact(self.artifact_id, float(percent))

    def advance(self, n: float = 1.0, items: float = 0.0) -> None:
        self.update(self.local.done + n, items=self.local.items + items)

    def close(self) -> None:
        self.local.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def inline_png(path: Path, alt: str) -> str:
    """A plot as markdown with the PNG inlined as a data URI: the Prefect UI shows the picture itself
    (a ``file://`` link does not open there, and the server may not see the worker's disk)."""
    return f"![{alt}](data:image/png;base64,{base64.b64encode(Path(path).read_bytes()).decode('ascii')})"
