"""The Dask task runner the flows use: ``prefect-dask``'s, except that a worker process slow to be
reaped after the run does not fail a run whose work is done.

Closing a local cluster asks each worker process to stop, kills it after 4 s, and raises
``TimeoutError`` when the killed process is not joined within the next second (distributed's
``Nanny.close(timeout=5)``, not configurable). On a loaded machine a worker that held models can
take that long to be reaped after its SIGKILL; the run's shards and manifests are all written by
then, and Prefect would report the finished run as Failed. Here that timeout is a warning instead;
the process has been sent SIGKILL already, and the run's watcher (``rde.common.reaper``) stops
whatever the run started when the run's process ends. Every other error on exit propagates.
A module of its own so that importing the task runners does not import Dask.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect.task_runners import TaskRunner
from prefect_dask import DaskTaskRunner

logger = logging.getLogger(__name__)


class ReapingDaskTaskRunner(DaskTaskRunner):
    """``DaskTaskRunner`` whose exit turns a worker's late reaping (``TimeoutError``) into a warning."""

    def __exit__(self, *args: Any) -> None:
        try:
            self._exit_stack.__exit__(*args)
        except TimeoutError:
            logger.warning("a Dask worker process was not reaped within distributed's 5 s close timeout "
                           "after the run; it was sent SIGKILL and the run's results are complete")
        TaskRunner.__exit__(self, *args)
