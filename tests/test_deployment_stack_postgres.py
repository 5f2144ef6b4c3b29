"""The deployment path on PostgreSQL: `rde stack up --postgres` (the stack's own cluster on loopback),
the build-secmm deployment through the worker, the bounded probe load without a lock or a retry,
and `rde stack down` removing the cluster. A module of its own so pytest-xdist can run it beside
the SQLite stack's module."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest
from stack_checks import probe_load, run_build_secmm

from rde.entry.stack import StackConfig, down, free_port, healthy, status, up

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pg_stack():
    """A stack on a PostgreSQL cluster of its own. Its folder is outside pytest's 0700 temporary
    root (the ``postgres`` OS user must reach the data folder when the tests run as root)."""
    from rde.entry.local_postgres import PostgresError, server_binaries

    try:
        server_binaries()
    except PostgresError as err:
        pytest.skip(str(err))
    folder = Path(tempfile.mkdtemp(prefix="rde-pg-stack-"))
    folder.chmod(0o755)
    cfg = StackConfig(port=free_port(), folder=folder, postgres=True, gpu_workers=0,
                      gpu_slots=1)  # runs only on the cpu pool (no idle gpu worker)
    try:
        up(cfg)
        yield cfg
    finally:
        down(cfg, remove_postgres=True)
        shutil.rmtree(folder, ignore_errors=True)


def _postgres_rows(cfg: StackConfig, sql: str, *args: object) -> list:
    import asyncio

    import asyncpg

    pg = cfg.local_postgres()

    async def query() -> list:
        conn = await asyncpg.connect(host=pg.host, port=pg.port, user=pg.role, password=pg.password,
                                     database=pg.database, timeout=30)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(query())


def test_postgres_stack_runs_the_build_secmm_deployment(pg_stack: StackConfig, tmp_path: Path,
                                                        tiny_pool_url: str, test_artifacts_dir: Path) -> None:
    """``rde stack up --postgres``: the server's rows are in the stack's own PostgreSQL (loopback
    only), the deployment runs through the worker, and the password is in no log or state file."""
    pg = pg_stack.local_postgres()
    assert pg.running() and pg_stack.database_url == pg.url
    assert status(pg_stack)["processes"]["postgres"] and status(pg_stack)["database"] == "postgres (stack)"
    flow_run, artifacts, elapsed = run_build_secmm(pg_stack, tmp_path / "out", tiny_pool_url)
    [row] = _postgres_rows(pg_stack, "SELECT state_type FROM flow_run WHERE id = $1::uuid", flow_run["id"])
    assert row["state_type"] == "COMPLETED"
    assert _postgres_rows(pg_stack, "SELECT count(*) AS n FROM artifact WHERE flow_run_id = $1::uuid",
                          flow_run["id"])[0]["n"] == len(artifacts)
    listen = _postgres_rows(pg_stack, "SELECT setting FROM pg_settings WHERE name = 'listen_addresses'")
    assert listen[0]["setting"] == "127.0.0.1"
    secret = pg.password
    for path in [*pg_stack.folder.glob("*.log"), pg_stack.folder / "stack.json", pg.folder / "server.log"]:
        assert secret not in path.read_text(errors="replace"), f"the database password is in {path}"
    assert oct(pg.password_file.stat().st_mode & 0o777) == "0o600"
    (test_artifacts_dir / "deployment-run-postgres.json").write_text(json.dumps(
        {"flow_run": flow_run["id"], "seconds_through_worker": round(elapsed, 1),
         "artifacts": sorted(a["key"] for a in artifacts if a.get("key"))}, indent=1))


def test_concurrent_probe_runs_complete_on_postgres(pg_stack: StackConfig, test_artifacts_dir: Path) -> None:
    """PostgreSQL must have no lock and no retry at the same load."""
    row = probe_load(pg_stack, test_artifacts_dir)
    assert row["database"] == "postgres"
    assert row["db_errors"] == {"database is locked": 0, "timeout": 0} and row["submit_retries"] == 0


def test_postgres_stack_down_stops_and_removes_its_cluster(pg_stack: StackConfig) -> None:
    pg = pg_stack.local_postgres()
    down(pg_stack)
    assert not healthy(pg_stack) and not pg.running() and (pg.data_dir / "PG_VERSION").exists()
    down(pg_stack, remove_postgres=True)
    assert not pg.folder.exists()
