"""The terminal display of stage progress: one rich line per running stage (done of total, rate,
elapsed, time left), drawn on stderr while a flow runs in this process, nothing when stderr is not
a terminal (CI, log files, pipes) or with ``RDE_PROGRESS=off``.

Log lines (Prefect's console handler, warnings, prints) print above the live lines: while the
display is up, every logging handler that writes to the terminal writes through its console (a
handler that draws with a rich console of its own, as Prefect's does, is stood in for by a
``RichHandler`` on the display's console: its own console would write past the display, onto the
line being drawn). A flow run's terminal leaves out Prefect's per-task INFO lines (one per shard:
they bury the stages' own lines); they still reach the Prefect API, and ``--verbose`` brings them
back.
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
from rich.logging import RichHandler
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
    """The text of one stage's line at ``now``: count, rate (of its items, e.g. images, when it
    counts them), time (elapsed, and left when known)."""
    unit = snap.unit
    if snap.total is None:
        count = "running" if snap.done == 0 else f"{_amount(snap.done)} {unit}"
    else:
        count = f"{_amount(snap.done)}/{_amount(snap.total)} {unit}"
    rate = ""
    if snap.item_rate:  # images/s: what a person reads, where shards are only how the work is cut
        rate = f"{snap.item_rate:.1f} {snap.item_unit}/s"
    elif snap.rate:
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


TASK_RUN_LOGGER = "prefect.task_runs"  # Prefect's logger of task runs (and of get_run_logger() in a task)


class QuietTaskRuns(logging.Filter):
    """What a flow run's terminal leaves out (the Prefect API and UI still get every line):

    - unless ``verbose``, task runs' lines below WARNING (``Task run 'measure-3' - Finished in
      state Completed()``, one per shard), and the traceback Prefect logs with an exception of one
      of ``user_errors`` (a missing model, a bad input): the CLI prints such an error as one
      ``error:`` line, so the traceback would only bury it;
    - always, the CLI's own flow hooks' INFO lines (``Running hook ...``: how the CLI learns its
      flow run's id, nothing a user acts on).

    Task runs' other warnings and errors, and every other flow-run line (a stage's one-line
    result), pass."""

    def __init__(self, verbose: bool = False, hooks: tuple[str, ...] = (),
                 user_errors: tuple[type[BaseException], ...] = ()) -> None:
        super().__init__()
        self.verbose = verbose
        self.hook_lines = tuple(f"{start}{name!r}" for name in hooks for start in ("Running hook ", "Hook "))
        self.user_errors = user_errors

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            error = record.exc_info[1] if record.exc_info else None
            return self.verbose or not (self.user_errors and isinstance(error, self.user_errors))
        if self.hook_lines and record.getMessage().startswith(self.hook_lines):
            return False
        return self.verbose or not (record.name == TASK_RUN_LOGGER or record.name.startswith(TASK_RUN_LOGGER + "."))


class RunLineFormatter(logging.Formatter):
    """A log message named as Prefect names it (``Flow run 'x' - ``, ``Task run 'x' - ``, else the
    logger's name), for a ``RichHandler`` that draws time and level itself."""

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        task_run, flow_run = getattr(record, "task_run_name", None), getattr(record, "flow_run_name", None)
        if task_run:
            return f"Task run {task_run!r} - {message}"
        if flow_run:
            return f"Flow run {flow_run!r} - {message}"
        return f"{record.name} - {message}"


def console_log_handler(console: Console, level: int = logging.NOTSET,
                        filters: list[Any] | None = None) -> RichHandler:
    """A handler that prints log lines through ``console``: above its live display, if it has one."""
    handler = RichHandler(console=console, level=level, show_path=False, markup=False, rich_tracebacks=False,
                          log_time_format="%H:%M:%S")
    handler.setFormatter(RunLineFormatter("%(message)s"))
    for item in filters or []:
        handler.addFilter(item)
    return handler


def _loggers() -> list[logging.Logger]:
    return [logging.getLogger()] + [lg for lg in list(logging.Logger.manager.loggerDict.values())
                                    if isinstance(lg, logging.Logger)]


@contextmanager
def _logs_through(live_console: Console, live_stream: Any, streams: tuple[Any, ...]) -> Iterator[None]:
    """Point terminal log handlers at ``live_stream``; one that draws with a rich console of its own
    (Prefect's) is replaced, on every logger that holds it, by :func:`console_log_handler` on
    ``live_console`` (a rich console given the display's stream proxy unwraps it and writes under it)."""
    swapped: list[tuple[logging.StreamHandler, Any]] = []
    replaced: list[tuple[logging.Logger, logging.Handler, logging.Handler]] = []
    stand_ins: dict[int, logging.Handler] = {}
    for handler in _terminal_handlers(streams):
        if isinstance(getattr(handler, "console", None), Console):
            stand_ins[id(handler)] = console_log_handler(live_console, handler.level, list(handler.filters))
        else:
            swapped.append((handler, handler.stream))
            handler.setStream(live_stream)
    for lg in _loggers():
        for handler in list(lg.handlers):
            stand_in = stand_ins.get(id(handler))
            if stand_in is not None:
                lg.removeHandler(handler)
                lg.addHandler(stand_in)
                replaced.append((lg, handler, stand_in))
    try:
        yield
    finally:
        for handler, stream in swapped:
            handler.setStream(stream)
        for lg, handler, stand_in in replaced:
            lg.removeHandler(stand_in)
            lg.addHandler(handler)


@contextmanager
def _filtered(streams: tuple[Any, ...], log_filter: logging.Filter | None) -> Iterator[None]:
    """Add ``log_filter`` to every handler that writes to one of ``streams`` while the block runs."""
    handlers = _terminal_handlers(streams) if log_filter is not None else []
    for handler in handlers:
        handler.addFilter(log_filter)  # type: ignore[arg-type]
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(log_filter)  # type: ignore[arg-type]


@contextmanager
def live_progress(console: Console | None = None, log_filter: logging.Filter | None = None
                  ) -> Iterator[RichRenderer | None]:
    """Show stage progress on ``console`` (default: stderr) while the block runs, when :func:`wanted`;
    yields the renderer, or None when nothing is drawn. ``log_filter`` (e.g. :class:`QuietTaskRuns`)
    applies to every log handler that writes to the terminal or the pipe meanwhile, drawn or not."""
    console = console or Console(stderr=True)
    originals = tuple(s for s in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__, console.file) if s)
    if not wanted(console):
        with _filtered(originals, log_filter):
            yield None
        return
    renderer = RichRenderer(console)
    # entered in order: the filter first (stand-in handlers copy it); once the live display is up it
    # proxies sys.stderr/sys.stdout, and log handlers holding an original stream are pointed at it
    with _filtered(originals, log_filter), renderer.progress, progress.install(renderer), \
            _logs_through(console, sys.stderr if console.stderr else sys.stdout, originals):
        yield renderer
