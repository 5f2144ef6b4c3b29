"""The terminal display of stage progress: one rich line per running stage (done of total, rate,
elapsed, time left), drawn on stderr while a flow runs in this process, nothing when stderr is not
a terminal (CI, log files, pipes) or with ``RDE_PROGRESS=off``.

Log lines (Prefect's console handler, warnings, prints) print above the live lines: while the
display is up, every logging handler that writes to the terminal writes through its console.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, ProgressColumn, SpinnerColumn, Task, TextColumn
from rich.text import Text

from rde.common import progress

REFRESH_PER_SECOND = 4  # redraws per second of the live lines
PROGRESS_ENV = "RDE_PROGRESS"  # "off" hides the display even on a terminal


def _duration(seconds: float) -> str:
    hours, rest = divmod(round(seconds), 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def _amount(value: float) -> str:
    return f"{value:.0f}" if float(value).is_integer() else f"{value:.1f}"


def describe(snap: progress.Snapshot, now: float | None = None) -> dict[str, str]:
    """The text of one stage's line at ``now``: count, rate, time (elapsed, and left when known)."""
    unit = snap.unit
    if snap.total is None:
        count = "running" if snap.done == 0 else f"{_amount(snap.done)} {unit}"
    else:
        count = f"{_amount(snap.done)}/{_amount(snap.total)} {unit}"
    rate = ""
    if snap.rate:
        rate = f"{snap.rate:.1f} {unit}/s" if snap.rate >= 1 else f"{1 / snap.rate:.1f} s/{unit.removesuffix('s')}"
    when = _duration(snap.elapsed(now))
    remaining = snap.remaining(now)
    if remaining is not None and not snap.finished:
        when += f", ~{_duration(remaining)} left"
    return {"count": count, "rate": rate, "when": when}


class StageColumn(ProgressColumn):
    """Count, rate and times of a stage, computed at every redraw so the clock ticks between updates."""

    def __init__(self, field: str) -> None:
        super().__init__()
        self.field = field

    def render(self, task: Task) -> Text:
        snap = task.fields.get("snap")
        return Text(describe(snap, time.monotonic())[self.field] if snap is not None else "")


class RichRenderer:
    """A :class:`rde.common.progress.Renderer` on a rich ``Progress``: a line per running stage, drawn once
    finished and then removed (the stage's own log line and the run summary say how it ended)."""

    def __init__(self, console: Console) -> None:
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(), StageColumn("count"),
            StageColumn("rate"), StageColumn("when"),
            console=console, transient=True, refresh_per_second=REFRESH_PER_SECOND)
        self._lock = threading.Lock()

    def start(self, snap: progress.Snapshot) -> int:
        with self._lock:
            return int(self.progress.add_task(snap.description, total=snap.total, completed=snap.done, snap=snap))

    def update(self, handle: int, snap: progress.Snapshot) -> None:
        with self._lock:
            self.progress.update(handle, description=snap.description, total=snap.total,  # type: ignore[arg-type]
                                 completed=snap.done, snap=snap)

    def stop(self, handle: int, snap: progress.Snapshot) -> None:
        with self._lock:  # drawn once finished, then removed
            self.progress.update(handle, total=snap.total, completed=snap.done, snap=snap)  # type: ignore[arg-type]
            self.progress.refresh()
            self.progress.remove_task(handle)  # type: ignore[arg-type]


def wanted(console: Console) -> bool:
    """Whether to draw: only on a terminal (rich's test, so ``TTY_COMPATIBLE=1`` forces it), never with
    ``RDE_PROGRESS=off``."""
    if os.environ.get(PROGRESS_ENV, "").strip().lower() in ("off", "0", "false", "no"):
        return False
    return console.is_terminal and not console.is_dumb_terminal


def _terminal_handlers(streams: tuple[Any, ...]) -> list[logging.StreamHandler]:
    """Every logging handler (root and named loggers) that writes to one of ``streams``."""
    loggers = [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                       if isinstance(lg, logging.Logger)]
    found: dict[int, logging.StreamHandler] = {}
    for lg in loggers:
        for handler in lg.handlers:
            if isinstance(handler, logging.StreamHandler) and handler.stream in streams:
                found[id(handler)] = handler
    return list(found.values())


@contextmanager
def _logs_through(live_stream: Any, streams: tuple[Any, ...]) -> Iterator[None]:
    """Point terminal log handlers (and a rich console inside one, as Prefect's has) at ``live_stream``."""
    swapped: list[tuple[logging.StreamHandler, Any]] = []
    for handler in _terminal_handlers(streams):
        swapped.append((handler, handler.stream))
        handler.setStream(live_stream)
        inner = getattr(handler, "console", None)
        if isinstance(inner, Console):
            inner.file = live_stream
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
            inner = getattr(handler, "console", None)
            if isinstance(inner, Console):
                inner.file = stream


@contextmanager
def live_progress(console: Console | None = None) -> Iterator[RichRenderer | None]:
    """Show stage progress on ``console`` (default: stderr) while the block runs, when :func:`wanted`;
    yields the renderer, or None when nothing is drawn."""
    console = console or Console(stderr=True)
    if not wanted(console):
        yield None
        return
    renderer = RichRenderer(console)
    originals = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, console.file)
    # entered in order: once the live display is up it proxies sys.stderr/sys.stdout, and log handlers
    # holding an original stream are pointed at that proxy
    with renderer.progress, progress.install(renderer), \
            _logs_through(sys.stderr if console.stderr else sys.stdout, tuple(s for s in originals if s)):
        yield renderer
