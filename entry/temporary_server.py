"""The temporary Prefect server a CLI run starts when no ``PREFECT_API_URL`` names one.

Prefect's own ephemeral server runs in the run's process group and writes to the run's terminal, so
a Ctrl-C reaches it at the same moment as the run: it dies mid-write, printing the tracebacks of its
interrupted database flushes under rde's stop line, and the run can no longer record in the API
that it was cancelled. This one is the same server (Prefect's app, served by uvicorn, as Prefect
starts it) in a session of its own, its output in ``<state>/prefect/temporary-server.log``: a
Ctrl-C reaches only the run, which marks its flow run Cancelled and then stops the server
(``entry.interrupt``). It carries the run's token, so the run's watcher stops it after a
SIGKILL (``rde.common.reaper``); a run that ends normally stops it at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil

from storage.locations import state_dir

LOG_NAME = "temporary-server.log"
LOG_KEEP_BYTES = 5 * 2**20  # a log above this is moved to ``.old`` when the next server starts
PORT_TAKEN_EXIT = 3  # uvicorn's exit status when its port was taken between the choice and the bind
STARTS = 3  # tries when the port is taken meanwhile (another run chose the same free port)
_server: subprocess.Popen[bytes] | None = None  # this process's server: one per process
_owner: int | None = None  # the pid that started it (a forked child's exit must not stop it)
_header = ""  # its start's line in the shared log


class ServerStartError(RuntimeError):
    """The temporary server exited or did not answer in time (the message quotes its log)."""


def ensure_api() -> str | None:
    """Start this process's temporary server unless Prefect's settings name an API (from the
    environment, a Prefect profile or a settings file), Prefect's ephemeral mode is off, or it runs
    already; point Prefect at it. Returns the API URL it started, ``None`` when it started none."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_ALLOW_EPHEMERAL_MODE

    if PREFECT_API_URL.value() or not PREFECT_SERVER_ALLOW_EPHEMERAL_MODE.value() or _server is not None:
        return None
    url = start()
    os.environ["PREFECT_API_URL"] = url  # Dask workers and model servers inherit it
    # no "View at <link>" lines: the server runs without its UI and ends with the run (as Prefect's
    # own temporary server prints none); `prefect server start` shows the runs afterwards
    os.environ.setdefault("PREFECT_UI_URL", "")
    from prefect.context import refresh_global_settings_context

    refresh_global_settings_context()  # Prefect read its settings at import
    return url


def start(timeout_s: float | None = None) -> str:
    """Start the server, wait until it listens and ``/health`` answers; its API URL. Stopped at this
    process's exit."""
    global _server, _owner, _header
    log_path = _log_path()
    if timeout_s is None:  # Prefect's own setting (rde's environment raises its default to 180 s)
        from prefect.settings import PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS

        timeout_s = float(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS.value())
    atexit.register(stop)
    header = ""
    for _ in range(STARTS):
        port = _free_port()
        header = f"== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: port {port}"
        with log_path.open("ab") as log:
            log.write(f"\n{header}\n".encode())
            log.flush()
            proc = subprocess.Popen(_command(port), env=_environment(), stdin=subprocess.DEVNULL, stdout=log,
                                    stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
        _server, _owner, _header = proc, os.getpid(), header
        url = f"http://127.0.0.1:{port}/api"
        if _wait_healthy(proc, port, url, timeout_s):
            return url
        if proc.returncode != PORT_TAKEN_EXIT:  # 3 is also uvicorn's code for a failed start-up: 3 tries at most
            break
    code = proc.returncode
    stop()
    what = f"exited with code {code}" if code is not None else f"did not answer within {timeout_s:.0f} s"
    raise ServerStartError(f"the temporary Prefect server {what}; its log ({log_path}) ends:\n"
                           f"{_tail(log_path, header)}")


def stop(grace_s: float = 5.0) -> None:
    """Stop the server: SIGTERM, then SIGKILL after ``grace_s``."""
    global _server
    if _owner != os.getpid():  # a forked child exiting: the server is its parent's
        return
    proc, _server = _server, None
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def exit_note() -> str | None:
    """When this process's server has exited mid-run: what to tell a user whose run failed (the
    exit code and the end of its log); ``None`` while it runs or when none was started."""
    if _server is None or _server.poll() is None:
        return None
    path = _log_path(rotate=False)
    return (f"the run's temporary Prefect server exited with code {_server.returncode}; its log ({path}) ends:\n"
            f"{_tail(path, _header)}")


def _command(port: int) -> list[str]:
    """Prefect's app served by uvicorn, as Prefect's own temporary server is started."""
    import prefect

    return [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
            "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "error", "--lifespan", "on"]


def _environment() -> dict[str, str]:
    """This process's environment with Prefect's temporary-server switches (no UI, its services
    as an ephemeral server runs them)."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"})
    return env


def _wait_healthy(proc: subprocess.Popen[bytes], port: int, url: str, timeout_s: float) -> bool:
    """Whether ``proc`` listens on ``port`` and ``/health`` answers there within ``timeout_s`` (a
    health answer alone could come from another run's server that took the port first)."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200 and _listens(proc.pid, port):
                    return True
            time.sleep(0.1)
    return False


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a listening TCP socket on ``port``."""
    try:
        return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in psutil.Process(pid).net_connections(kind="tcp"))
    except psutil.Error:
        return False


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _log_path(rotate: bool = True) -> Path:
    """The shared server log; with ``rotate`` (before a start), a log above ``LOG_KEEP_BYTES`` is
    moved to ``.old`` first."""
    folder = state_dir() / "prefect"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOG_NAME
    with contextlib.suppress(OSError):
        if rotate and path.stat().st_size > LOG_KEEP_BYTES:
            path.replace(path.with_name(LOG_NAME + ".old"))
    return path


def _tail(path: Path, header: str, chars: int = 2000) -> str:
    """The end of this start's part of the shared log (from its ``header`` line on)."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(unreadable: {exc})"
    return text[text.rfind(header) if header in text else 0:][-chars:]
