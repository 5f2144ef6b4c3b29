"""Slow imports made ahead, in one background thread, while earlier stages compute.

A model stack's first import costs seconds on one core (torch 1.5–2 s, sentence-transformers and
transformers 4–6 s here; more when the page cache has dropped torch's CUDA libraries) and, made
when the stage that needs it starts, it stands alone on the flow's critical path. The runner
starts an ``ImportWarmup`` with the later stages' ``Stage.imports`` when the first stage that does
work starts; a stage that then imports a module the thread is importing waits for it (Python's
per-module import lock) instead of importing it again. Nothing else changes: the same modules are
imported, once. An import that fails here is left for the stage to make, and fail, in its own
thread with its own message.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)


class ImportWarmup:
    """Imports modules in order in a daemon thread; ``join`` waits for it (the runner joins before
    the flow returns, so no import is cut short by the interpreter's exit)."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self.imported: list[str] = []  # in order: imported here, or already by another thread
        self.failed: dict[str, str] = {}
        self.seconds = 0.0

    @property
    def started(self) -> bool:
        return self._thread is not None

    def start(self, modules: Iterable[str]) -> bool:
        """Start importing ``modules`` (once per warm-up; later calls do nothing). Returns whether
        it started a thread (not when every module is already imported)."""
        import sys

        wanted = [m for m in dict.fromkeys(modules) if m not in sys.modules]
        if self._thread is not None or not wanted:
            return False
        self._thread = threading.Thread(target=self._run, args=(wanted,), name="import-warmup", daemon=True)
        self._thread.start()
        return True

    def _run(self, modules: list[str]) -> None:
        start = time.perf_counter()
        for name in modules:
            try:
                importlib.import_module(name)
                self.imported.append(name)
            except Exception as exc:  # the stage's own import reports it
                self.failed[name] = f"{type(exc).__name__}: {exc}"
                log.debug("import warm-up: %s failed (%s)", name, exc)
        self.seconds = time.perf_counter() - start

    def join(self, timeout: float | None = None) -> None:
        if self._thread is not None:
            self._thread.join(timeout)
