"""Prefect artifacts and logs for stages: a table per stage under a stable key."""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger
from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.context import get_run_context


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


def publish_table(key: str, rows: list[dict[str, Any]], description: str) -> None:
    """A table artifact with a stable key (it shows on the Artifacts page, newest first)."""
    if _in_prefect_run():
        create_table_artifact(key=key, table=rows, description=description)


def publish_markdown(key: str, markdown: str, description: str) -> None:
    if _in_prefect_run():
        create_markdown_artifact(key=key, markdown=markdown, description=description)


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


class Progress:
    """A progress artifact (0-100 %) with a stable key, updated as shards finish; a no-op outside
    a Prefect run."""

    def __init__(self, key: str, description: str) -> None:
        self.artifact_id = create_progress_artifact(0.0, key=key, description=description) \
            if _in_prefect_run() else None

    def update(self, percent: float) -> None:
        if self.artifact_id is not None:
            update_progress_artifact(self.artifact_id, min(100.0, percent))


def publish_image(key: str, url: str, description: str) -> None:
    """An image artifact (a plot written next to the Parquet outputs, shown in the UI)."""
    if _in_prefect_run():
        create_image_artifact(image_url=url, key=key, description=description)
