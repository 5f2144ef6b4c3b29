"""The stack's own PostgreSQL cluster: created, started on loopback with a generated password,
stopped, restarted on the same data, removed; a folder its OS user cannot reach is refused."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from entry.local_postgres import LocalPostgres, PostgresError, server_binaries
from entry.stack import free_port


def _postgres_or_skip() -> None:
    """PostgreSQL's server programs, or a skip with the reason; under CI (``CI`` set) their absence
    fails instead, as in test_deployment_stack_postgres.py: CI installs them (make postgres)."""
    try:
        server_binaries()
    except PostgresError as err:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install Debian's postgresql (make postgres): {err}")
        pytest.skip(str(err))


def test_missing_postgres_skips_locally_and_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing() -> None:
        raise PostgresError("no initdb on this machine")

    monkeypatch.setattr(f"{__name__}.server_binaries", missing)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(BaseException) as raised:  # a skip or a failure: caught, so this test can fail on it
        _postgres_or_skip()
    assert raised.type is pytest.skip.Exception and "no initdb" in str(raised.value)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(BaseException) as raised:
        _postgres_or_skip()
    assert raised.type is pytest.fail.Exception and "CI must install Debian's postgresql" in str(raised.value)


@pytest.fixture()
def reachable_dir() -> Iterator[Path]:
    _postgres_or_skip()
    folder = Path(tempfile.mkdtemp(prefix="rde-pg-test-"))
    folder.chmod(0o755)  # as root, the cluster runs as `postgres`, which must reach its folder
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _query(pg: LocalPostgres, sql: str, host: str = "127.0.0.1") -> object:
    import asyncpg

    async def run() -> object:
        conn = await asyncpg.connect(host=host, port=pg.port, user=pg.role, password=pg.password,
                                     database=pg.database, timeout=10)
        try:
            return await conn.fetchval(sql)
        finally:
            await conn.close()

    return asyncio.run(run())


def test_cluster_starts_on_loopback_restarts_on_its_data_and_is_removed(reachable_dir: Path) -> None:
    pg = LocalPostgres(reachable_dir / "postgres", free_port())
    try:
        pg.start()
        assert pg.running()
        assert _query(pg, "SELECT current_database()") == "prefect"
        assert _query(pg, "SHOW listen_addresses") == "127.0.0.1"
        _query(pg, "CREATE TABLE kept AS SELECT 7 AS x")
        assert oct(pg.password_file.stat().st_mode & 0o777) == "0o600" and len(pg.password) >= 24
        assert pg.password not in pg.redacted_url and pg.password.replace("-", "%2D") not in pg.redacted_url
        assert not (pg.folder / ".initdb-password").exists()
        pg.stop()
        assert not pg.running()
        pg.start()  # the same cluster, the same password, the data kept
        assert _query(pg, "SELECT x FROM kept") == 7
        import asyncpg

        with pytest.raises(asyncpg.exceptions.InvalidPasswordError):  # SCRAM, no trust
            asyncio.run(asyncpg.connect(host="127.0.0.1", port=pg.port, user=pg.role, password="wrong",
                                        database=pg.database, timeout=10))
    finally:
        pg.remove()
    assert not pg.folder.exists() and not pg.running()


@pytest.mark.skipif(os.geteuid() != 0, reason="only root runs the cluster as another user")
def test_a_folder_the_postgres_user_cannot_reach_is_refused_with_a_message(reachable_dir: Path) -> None:
    closed = reachable_dir / "closed"
    closed.mkdir(mode=0o700)
    pg = LocalPostgres(closed / "postgres", free_port())
    with pytest.raises(PostgresError, match="cannot reach"):
        pg.start()
