"""Dask worker preload: Dask puts the worker's scratch folder first on ``sys.path`` and keeps a
``storage/`` spill folder there, which would shadow this project's ``storage`` package. Removing the
scratch entries at worker start lets task code import the engine's packages."""

from __future__ import annotations

import sys
from typing import Any


def dask_setup(worker: Any) -> None:  # a distributed.Worker
    scratch = str(worker.local_directory).rsplit("/", 1)[0]
    sys.path[:] = [p for p in sys.path if not p.startswith(scratch)]
    stale = sys.modules.get("storage")
    if stale is not None and getattr(stale, "__file__", None) is None:
        del sys.modules["storage"]
