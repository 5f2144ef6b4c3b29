"""Process-local progress of running stages: stages report here, an installed renderer shows it.

One mechanism for every stage: a stage opens a :class:`StageProgress` (items, shards or steps done
of a total, or just "running" when no total is known) and updates it as work finishes; whoever runs
the flow in this process (the CLI, on a terminal) may :func:`install` a renderer. Without one,
reporting only updates a few numbers. Progress is reported by the thread that runs the stage (the
flow's thread collects finished shard tasks), never by the shard tasks themselves, so a stage has
one display however many shards it maps. A progress opened while the same thread's innermost open
progress has no total (a stage shown as "running") takes over that display instead of adding one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Snapshot:
    """One stage at its last update: done of total, when it started and was last updated
    (``time.monotonic``), so a renderer can tick the time between updates; ``items`` of
    ``item_unit`` (e.g. images) counts the rows its finished units held, for a rate a person reads
    (images/s) where ``unit`` (shards) is only how the work is cut."""

    description: str
    done: float
    total: float | None
    unit: str
    started: float
    updated: float
    finished: bool = False
    items: float = 0.0
    item_unit: str = ""

    def elapsed(self, now: float | None = None) -> float:
        """Seconds since the stage started (up to the last update once finished)."""
        return (self.updated if self.finished or now is None else now) - self.started

    @property
    def rate(self) -> float | None:
        """Units per second from the start to the last update (None before the first unit)."""
        spent = self.updated - self.started
        return self.done / spent if self.done > 0 and spent > 0 else None

    @property
    def item_rate(self) -> float | None:
        """Items per second from the start to the last update (None without items)."""
        spent = self.updated - self.started
        return self.items / spent if self.items > 0 and spent > 0 and self.item_unit else None

    def remaining(self, now: float | None = None) -> float | None:
        """Seconds left at that rate, counting down between updates (None: no total or no rate)."""
        rate = self.rate
        if rate is None or self.total is None:
            return None
        since = 0.0 if now is None else max(now - self.updated, 0.0)
        return max((self.total - self.done) / rate - since, 0.0)


class Renderer(Protocol):
    """Shows stage progress; called from the threads that run stages (implementations lock)."""

    def start(self, snap: Snapshot) -> int:
        """Add a display for a stage; returns its handle."""

    def update(self, handle: int, snap: Snapshot) -> None:
        """Redraw one stage's display."""

    def stop(self, handle: int, snap: Snapshot) -> None:
        """The stage finished: its display goes."""


_renderer: Renderer | None = None
_local = threading.local()


@contextmanager
def install(renderer: Renderer | None) -> Iterator[None]:
    """Show every stage progress opened in this process on ``renderer`` while the block runs."""
    global _renderer
    previous, _renderer = _renderer, renderer
    try:
        yield
    finally:
        _renderer = previous


def _stack() -> list[StageProgress]:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


class StageProgress:
    """Progress of one stage: ``update(done)`` or ``advance(n)`` as work finishes, ``close()`` at the
    end (or use it as a context manager). ``total`` None shows the stage as running, with its time.
    ``item_unit``: what the rows counted with ``update(..., items=)`` are (images), shown as a rate."""

    def __init__(self, description: str, total: float | None = None, unit: str = "items",
                 item_unit: str = "") -> None:
        self.description, self.total, self.unit, self.item_unit = description, total, unit, item_unit
        self.done = 0.0
        self.items = 0.0
        self.start = self.updated = time.monotonic()
        self.closed = False
        self._renderer = _renderer
        stack = _stack()
        host = stack[-1] if stack else None
        self._host = host if host is not None and host.total is None and host._guest is None else None
        self._guest: StageProgress | None = None
        self._handle: int | None = None
        if self._host is not None:
            self._host._guest = self
            self._handle = self._host._handle
            self._renderer = self._host._renderer
            self._draw()
        elif self._renderer is not None:
            self._handle = self._renderer.start(self.snapshot())
        stack.append(self)

    def snapshot(self) -> Snapshot:
        return Snapshot(self.description, self.done, self.total, self.unit, self.start, self.updated, self.closed,
                        self.items, self.item_unit)

    def update(self, done: float, total: float | None = None, items: float | None = None) -> None:
        """``done`` units of work finished so far (``total`` updates the total when it changes;
        ``items``: the rows those units held, so far)."""
        self.done = float(done)
        if items is not None:
            self.items = float(items)
        self.updated = time.monotonic()
        if total is not None:
            self.total = float(total)
        self._draw()

    def advance(self, n: float = 1.0, items: float = 0.0) -> None:
        """``n`` more units finished, holding ``items`` rows."""
        self.update(self.done + n, items=self.items + items)

    def _draw(self) -> None:
        if self._renderer is not None and self._handle is not None and not self.closed:
            self._renderer.update(self._handle, self.snapshot())

    def close(self) -> None:
        """Finish: the display goes (a taken-over display shows its stage as running again)."""
        if self.closed:
            return
        if self._guest is not None:  # a stage that ends (or fails) ends what it showed inside it
            self._guest.close()
        self.closed = True
        stack = _stack()
        if self in stack:
            stack.remove(self)
        if self._host is not None:
            self._host._guest = None
            self._host._draw()
        elif self._renderer is not None and self._handle is not None:
            self._renderer.stop(self._handle, self.snapshot())

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
