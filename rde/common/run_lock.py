"""One run at a time per output folder: a second run of a flow on the same artifacts root fails
at once with a message naming the holder, instead of interleaving its writes with the first.

Local folders use an advisory ``flock`` on ``<root>/.run.lock`` (released by the OS even when the
holder is killed with SIGKILL, so a crash never leaves a stale lock). Object-store roots
(``s3://``...) have no such lock: there, runs must be serialised by the orchestrator (one
deployment run per output, e.g. a deployment concurrency limit of 1).
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import json
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from storage.filesystem import StorageWriteError


class RunLockedError(RuntimeError):
    """Another run holds the output folder."""


_held: dict[str, int] = {}  # roots this process holds → nesting depth (the CLI locks, then the flow)
_guard = threading.Lock()


@contextmanager
def output_lock(root: str, flow_name: str, wait: bool = False) -> Iterator[None]:
    """Hold ``root`` for one run (re-entrant within this process); RunLockedError if another
    process holds it, or with ``wait`` block until it lets go (a shared output another flow is
    writing: the waiter then finds it complete)."""
    if "://" in root:
        yield
        return
    key = str(Path(root).resolve())
    with _guard:
        if key in _held:
            _held[key] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        try:
            yield
        finally:
            with _guard:
                _held[key] -= 1
        return
    folder = Path(root)
    path = folder / ".run.lock"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        handle = open(path, "a+")  # noqa: SIM115 - held for the whole run
    except OSError as exc:
        raise StorageWriteError(f"cannot use the output folder {folder}: {exc.strerror or exc} ({exc})") from exc
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise RunLockedError(f"another run is writing {folder} ({holder}); wait for it to finish, or give "
                                 "this run another --output") from None
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps({"flow": flow_name, "pid": os.getpid(),
                                 "since": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")}))
        handle.flush()
        with _guard:
            _held[key] = 1
        try:
            yield
        finally:
            with _guard:
                _held.pop(key, None)
    finally:
        handle.close()  # closing releases the flock
