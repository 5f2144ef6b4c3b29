"""The run's temporary Prefect server: started only without ``PREFECT_API_URL``, a clear error
quoting its log when it cannot start. (A real one is started, stopped by signals and checked out of
the run's process group in ``test_signals``.)"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from entry import temporary_server


@pytest.fixture
def state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path))
    monkeypatch.setattr(temporary_server, "_server", None)
    return tmp_path


def test_a_configured_api_url_starts_no_server(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(temporary_server, "start", lambda *a, **k: pytest.fail("a server was started"))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:4200/api"}):  # as a Prefect profile sets it
        assert temporary_server.ensure_api() is None


def test_without_an_api_url_a_server_is_started_and_prefect_pointed_at_it(state: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import prefect.context
    from prefect.settings import PREFECT_API_URL, temporary_settings

    monkeypatch.setattr(temporary_server, "start", lambda *a, **k: "http://127.0.0.1:4999/api")
    session_settings = prefect.context.GLOBAL_SETTINGS_CONTEXT
    for key in ("PREFECT_API_URL", "PREFECT_UI_URL"):
        monkeypatch.setenv(key, "recorded")  # so that the undo below restores what was there
        monkeypatch.delenv(key)
    try:
        with temporary_settings(restore_defaults={PREFECT_API_URL}):
            assert temporary_server.ensure_api() == "http://127.0.0.1:4999/api"
        assert os.environ["PREFECT_API_URL"] == "http://127.0.0.1:4999/api"  # child processes inherit it
        assert os.environ["PREFECT_UI_URL"] == ""  # no links to a UI the server does not serve
        # the global settings (a test session may hold a settings context of its own above them)
        assert prefect.context.GLOBAL_SETTINGS_CONTEXT.settings.api.url == "http://127.0.0.1:4999/api"
    finally:
        monkeypatch.undo()
        prefect.context.GLOBAL_SETTINGS_CONTEXT = session_settings  # the session's own settings again


def test_the_health_answer_of_another_server_on_the_port_is_not_taken_as_ours(state: Path) -> None:
    """A process that does not listen on the port is not the server, whatever answers there."""
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            assert temporary_server._listens(os.getpid(), port)
            assert not temporary_server._listens(sleeper.pid, port)
        finally:
            sleeper.kill()
            sleeper.wait()


def test_a_server_that_exits_is_a_clear_error_quoting_its_log(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(temporary_server, "_command", lambda port: [
        sys.executable, "-c", f"import sys; print('cannot open the database on port {port}'); sys.exit(1)"])
    with pytest.raises(temporary_server.ServerStartError) as caught:
        temporary_server.start(timeout_s=30)
    message = str(caught.value)
    assert "exited with code 1" in message and "temporary-server.log" in message
    assert "cannot open the database on port" in message  # the server's own words, from its log
    assert temporary_server._server is None


def test_a_taken_port_is_tried_again_on_another(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ports: list[int] = []

    def command(port: int) -> list[str]:
        ports.append(port)
        return [sys.executable, "-c", f"import sys; sys.exit({temporary_server.PORT_TAKEN_EXIT})"]

    monkeypatch.setattr(temporary_server, "_command", command)
    with pytest.raises(temporary_server.ServerStartError) as caught:
        temporary_server.start(timeout_s=30)
    assert len(ports) == temporary_server.STARTS
    log = (state / "prefect" / temporary_server.LOG_NAME).read_text()
    assert all(f"port {port}" in log for port in ports)
    assert f"port {ports[-1]}" in str(caught.value) and f"port {ports[0]}" not in str(caught.value)  # its own part


def test_a_large_log_is_moved_aside_when_the_next_server_starts(state: Path) -> None:
    folder = state / "prefect"
    folder.mkdir()
    (folder / temporary_server.LOG_NAME).write_bytes(b"x" * (temporary_server.LOG_KEEP_BYTES + 1))
    path = temporary_server._log_path()
    assert not path.exists()
    assert (folder / (temporary_server.LOG_NAME + ".old")).stat().st_size == temporary_server.LOG_KEEP_BYTES + 1


def test_a_server_that_died_mid_run_is_named_with_its_log(state: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    assert temporary_server.exit_note() is None  # none started
    log = state / "prefect" / temporary_server.LOG_NAME
    log.parent.mkdir(parents=True)
    log.write_text("== earlier run\nnot ours\n== 2026-12-04 10:00:00 pid 1: port 5\ndatabase is locked\n")
    died = subprocess.Popen([sys.executable, "-c", "import sys; sys.exit(7)"])
    died.wait()
    monkeypatch.setattr(temporary_server, "_server", died)
    monkeypatch.setattr(temporary_server, "_header", "== 2026-12-04 10:00:00 pid 1: port 5")
    note = temporary_server.exit_note()
    assert note is not None and "exited with code 7" in note and note.endswith("database is locked\n")
    assert "not ours" not in note
