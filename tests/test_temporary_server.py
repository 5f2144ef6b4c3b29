"""The run's temporary Prefect server: started only without ``PREFECT_API_URL``, a clear error
quoting its log when it cannot start. (A real one is started, stopped by signals and checked out of
the run's process group in ``test_signals``.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rde.entry import temporary_server


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(temporary_server, "_server", None)
    return tmp_path


def test_a_configured_api_url_starts_no_server(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:4200/api")
    monkeypatch.setattr(temporary_server, "start", lambda *a, **k: pytest.fail("a server was started"))
    assert temporary_server.ensure_api() is None


def test_a_server_that_exits_is_a_clear_error_quoting_its_log(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(temporary_server, "_command", lambda port: [
        sys.executable, "-c", f"import sys; print('cannot open the database on port {port}'); sys.exit(1)"])
    with pytest.raises(temporary_server.ServerStartError) as caught:
        temporary_server.start(timeout_s=30)
    message = str(caught.value)
    assert "did not start" in message and "temporary-server.log" in message
    assert "cannot open the database on port" in message  # the server's own words, from its log
    assert temporary_server._server is None


def test_a_taken_port_is_tried_again_on_another(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ports: list[int] = []

    def command(port: int) -> list[str]:
        ports.append(port)
        return [sys.executable, "-c", f"import sys; sys.exit({temporary_server.PORT_TAKEN_EXIT})"]

    monkeypatch.setattr(temporary_server, "_command", command)
    with pytest.raises(temporary_server.ServerStartError):
        temporary_server.start(timeout_s=30)
    assert len(ports) == temporary_server.STARTS
    log = (state / "prefect" / temporary_server.LOG_NAME).read_text()
    assert all(f"port {port}" in log for port in ports)


def test_a_large_log_is_moved_aside_when_the_next_server_starts(state: Path) -> None:
    folder = state / "prefect"
    folder.mkdir()
    (folder / temporary_server.LOG_NAME).write_bytes(b"x" * (temporary_server.LOG_KEEP_BYTES + 1))
    path = temporary_server._log_path()
    assert not path.exists()
    assert (folder / (temporary_server.LOG_NAME + ".old")).stat().st_size == temporary_server.LOG_KEEP_BYTES + 1
