"""Stopping a CLI run with Ctrl-C, SIGTERM or SIGHUP within seconds, leaving no process behind.

Prefect's flow engine, run in the main thread, swaps SIGTERM for a handler that waits for the
running tasks and reports a crash to the API, and a Ctrl-C only reaches the main thread between
two tasks. So the CLI runs the flow in a thread of its own (Prefect then installs no handler) while
the main thread only waits, and handles the signal itself. The run's temporary Prefect server is in
a session of its own (``entry.temporary_server``): a Ctrl-C to the terminal's process group
does not reach it, so it outlives the signal long enough to record the stop.

- the first SIGINT, SIGTERM or SIGHUP (the terminal closed, an SSH session dropped) prints one
  line (what is complete, what was cut, how to resume; the last line the process prints: the
  abandoned flow thread's log lines and errors are dropped), marks the flow run Cancelled in the
  Prefect API (best effort, at most two seconds: a server that is gone or busy records nothing),
  stops every process the run started (SIGTERM, then SIGKILL after a grace period), and exits with
  128 + the signal number (130, 143, 129) through ``os._exit``. A run started under ``nohup``
  (SIGHUP ignored when it starts) keeps ignoring SIGHUP. Running shard tasks are abandoned: every
  shard is written to a temporary file and renamed, and a stage's manifest is written only after
  its last shard, so a stage cut anywhere is a stage without a manifest whose whole shards a rerun
  reuses. The OS releases the run lock (a ``flock``) with the process.
- a second Ctrl-C while the first is being handled kills the children at once and exits.
- a SIGKILL cannot be handled: the run's watcher (``rde.common.reaper``) stops its processes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import psutil

from rde.common import reaper

T = TypeVar("T")
_watcher: subprocess.Popen[bytes] | None = None  # this process's watcher: lives as long as the process
SIGNAL_NAMES = {signal.SIGINT: "Ctrl-C (SIGINT)", signal.SIGTERM: "SIGTERM",
                signal.SIGHUP: "SIGHUP (its terminal closed)"}
JOIN_POLL_S = 0.2  # the main thread's wait slices: a signal is handled within one
MARK_TIMEOUT_S = 2.0  # at most this long to record the stop in the Prefect API
_flow_run_id: str | None = None  # the run the CLI started in this process (one per process)


class RunGuard:
    """Runs a flow call so that a signal stops it promptly and cleanly (see the module docstring).

    ``describe``: what is complete and what was cut (a clause), read when the signal comes;
    ``resume``: the command that resumes the run; ``before_exit``: called first on a signal (e.g. to
    end a live display); ``watch``: start the watcher that stops the run's processes after a SIGKILL;
    ``prepare``: called in the flow's thread before the call, after the watcher started (what it
    starts, e.g. a temporary Prefect server, carries the run's token, and a signal meanwhile stops it).
    """

    def __init__(self, describe: Callable[[], str], resume: str, before_exit: Callable[[], None] | None = None,
                 watch: bool = True, prepare: Callable[[], object] | None = None) -> None:
        self.describe, self.resume, self.before_exit, self.watch = describe, resume, before_exit, watch
        self.prepare = prepare
        self._stopping = False

    hooks = ("record_flow_run",)  # the hooks :meth:`watching` adds (their INFO lines stay off the terminal)

    @staticmethod
    def watching(flow: Any) -> Any:
        """``flow`` (a Prefect flow) with a hook that records its run's id, so a stopped run can be
        marked Cancelled in the Prefect API instead of staying Running there."""
        return flow.with_options(on_running=[*flow.on_running_hooks, record_flow_run])

    def run(self, call: Callable[[], T]) -> T:
        """``call()`` in a worker thread, its result or exception passed on; signals handled meanwhile.
        Off the main thread (signals cannot be set there) it is just ``prepare()`` and ``call()``."""
        if threading.current_thread() is not threading.main_thread():
            if self.prepare is not None:
                self.prepare()
            return call()
        if self.watch:
            _start_watcher()
        outcome: dict[str, Any] = {}

        def target() -> None:
            try:
                if self.prepare is not None:
                    self.prepare()
                outcome["value"] = call()
            except BaseException as exc:
                outcome["error"] = exc

        previous = {sig: signal.signal(sig, self._on_signal) for sig in handled_signals()}
        try:
            worker = threading.Thread(target=target, name="rde-flow", daemon=True)
            worker.start()
            while worker.is_alive():
                worker.join(JOIN_POLL_S)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    def _children(self) -> list[psutil.Process]:
        """Every live process this one started (recursively), except the watcher."""
        skip = {_watcher.pid} if _watcher is not None else set()
        try:
            return [p for p in psutil.Process().children(recursive=True) if p.pid not in skip]
        except psutil.Error:
            return []

    def _on_signal(self, signum: int, _frame: object) -> None:
        code = 128 + signum
        if self._stopping:  # a second signal while the first is handled: no more waiting
            for proc in self._children():
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            _exit(code)
        self._stopping = True
        if self.before_exit is not None:
            with contextlib.suppress(Exception):
                self.before_exit()
        try:
            state = self.describe()
        except Exception as exc:
            state = f"state unknown ({exc})"
        name = SIGNAL_NAMES.get(signal.Signals(signum), f"signal {signum}")
        _quiet_the_abandoned_run()
        with contextlib.suppress(OSError, ValueError):  # a closed terminal (SIGHUP) takes no more lines
            sys.stderr.write(f"\nrde: stopped by {name}: {state}. To resume, run the same command again: complete "
                             f"stages are skipped and written shards reused.\n  {self.resume}\n")
            sys.stderr.flush()
        _to_devnull()  # the stop line is the last line this process prints
        self._mark_cancelled(name)
        reaper.stop_processes(self._children())
        for late in self._children():  # started meanwhile (a Dask nanny restarting its worker): no grace
            with contextlib.suppress(psutil.Error):
                late.kill()
        _exit(code)

    def _mark_cancelled(self, name: str) -> None:
        """Best effort, within ``MARK_TIMEOUT_S``: the flow run ends Cancelled in the API (a server
        that is gone or does not answer in time records nothing)."""
        if _flow_run_id is None:
            return
        try:
            from prefect.client.orchestration import get_client
            from prefect.states import Cancelled

            with get_client(sync_client=True, httpx_settings={"timeout": MARK_TIMEOUT_S}) as client:
                client.set_flow_run_state(_flow_run_id, Cancelled(message=f"stopped by {name}; rerun the "
                                                                               "same command to resume"), force=True)
        except Exception:  # an unreachable API: the stop goes on
            pass


def handled_signals() -> list[int]:
    """The signals a run stops on: SIGINT, SIGTERM, and SIGHUP unless it was ignored when the process
    started (``nohup``: the run is meant to outlive its terminal)."""
    return [sig for sig in SIGNAL_NAMES if sig != signal.SIGHUP or signal.getsignal(signal.SIGHUP) != signal.SIG_IGN]


def record_flow_run(_flow: object, flow_run: Any, _state: object) -> None:
    """The flow's on-running hook: remember this process's flow run. A module function, not a
    closure: the flow travels with its tasks to Dask workers, so its hooks must pickle."""
    global _flow_run_id
    _flow_run_id = str(flow_run.id)


def _start_watcher() -> None:
    """Start this process's watcher once. Held in a module global, never closed: the pipe to it
    must end with the process (after the exit handlers have stopped the temporary server), not when a
    guard object is collected."""
    global _watcher
    if _watcher is None:
        _watcher = reaper.start()


def _quiet_the_abandoned_run() -> None:
    """No more log lines or thread tracebacks from this process: the flow thread runs on until the
    exit, meets the stopped server and logs what fails; none of it is news to a user who stopped it."""
    logging.disable(logging.CRITICAL)
    threading.excepthook = lambda _args: None


def _to_devnull() -> None:
    """Point this process's stdout and stderr at /dev/null (its children keep theirs)."""
    with contextlib.suppress(OSError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        for fd in (1, 2):
            os.dup2(devnull, fd)
        os.close(devnull)


def _exit(code: int) -> None:
    """Flush what was printed and leave at once (threads running shard tasks are abandoned)."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)
