"""No orphans, even when the run is killed with SIGKILL: a small watcher process per CLI run.

The run puts a token of its own in its environment before it starts anything, so every process it
starts (its temporary Prefect server, Dask workers, a model server) and every process those start
inherit it. It also starts this watcher, in a session of its own (a Ctrl-C or a signal to the
run's process group does not reach it), with a pipe from the run as its stdin. The watcher blocks
on that pipe; the pipe ends when the run's process ends, however it ends (the kernel closes the
run's end, SIGKILL included). The watcher then stops every process of this user that carries the
token: SIGTERM, then SIGKILL after a grace period. A run that ends normally has stopped its
children by then, so the watcher finds nothing and exits. A run that hands work over on purpose
writes ``STAND_DOWN`` first, and the watcher exits without stopping anything.

Run as ``python -m rde.common.reaper TOKEN``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import uuid

import psutil

TOKEN_VAR = "RDE_RUN_TOKEN"  # the environment variable every process of one run carries
GRACE_S = 3.0  # seconds between SIGTERM and SIGKILL
STAND_DOWN = b"q"


def carrying(token: str, exclude: set[int] = frozenset()) -> list[psutil.Process]:  # type: ignore[assignment]
    """The live processes whose environment carries ``token`` (this user's: others' are unreadable)."""
    found = []
    for proc in psutil.process_iter():
        if proc.pid in exclude:
            continue
        try:
            if proc.environ().get(TOKEN_VAR) == token and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.Error, OSError):
            continue  # gone, a zombie, or another user's
    return found


def stop_processes(procs: list[psutil.Process], grace_s: float = GRACE_S) -> None:
    """SIGTERM each, wait up to ``grace_s`` for all, SIGKILL those still alive."""
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=grace_s)


def start() -> subprocess.Popen[bytes]:
    """Give this process a fresh run token and start its watcher; keep the returned process (its
    stdin is the pipe) for as long as this process lives."""
    token = uuid.uuid4().hex
    os.environ[TOKEN_VAR] = token
    env = {k: v for k, v in os.environ.items() if k != TOKEN_VAR}  # the watcher must not sweep itself
    return subprocess.Popen([sys.executable, "-m", "rde.common.reaper", token], stdin=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True, close_fds=True)


def main(token: str) -> None:
    """Wait until the run's pipe ends, then stop what carries ``token`` unless told to stand down."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    told = sys.stdin.buffer.read()  # returns at EOF: the run's process has ended (or closed the pipe)
    if STAND_DOWN in told:
        return
    stop_processes(carrying(token, exclude={os.getpid()}))


if __name__ == "__main__":  # pragma: no cover - runs as its own process
    main(sys.argv[1])
