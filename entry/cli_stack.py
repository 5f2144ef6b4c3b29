"""``rde stack``: a local Prefect server, work pools, workers and deployments."""

from __future__ import annotations

import json
import os
from typing import Annotated

import typer

from entry.cli_base import (
    _fail,
    _profile_or_fail,
    console,
    stack_app,
)


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
    from entry.stack import StackConfig, StackError, up

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
    from entry.stack import StackConfig, StackError, ensure_automations, recorded_port

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
    from entry.stack import StackConfig, down

    down(StackConfig(port=port), remove_postgres=remove_postgres)
    console.print("stack down" + (" (PostgreSQL cluster removed)" if remove_postgres else ""))


@stack_app.command("status")
def stack_status(port: Annotated[int | None, typer.Option(min=1, max=65535, help="Server port (default: the "
                                                          "port the last `stack up` used, else 4200).")] = None
                 ) -> None:
    """Server health and whether each stack process is alive."""
    from entry.stack import StackConfig, recorded_port, status

    console.print_json(json.dumps(status(StackConfig(port=port or recorded_port() or 4200))))


