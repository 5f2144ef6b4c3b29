"""Which Prefect task runner the flows map their shard tasks on, chosen by environment so the
same setting works for the CLI and for deployments (set it in the work pool's job variables):

- ``RDE_TASK_RUNNER=threads`` (default): a thread pool of ``RDE_TASK_WORKERS`` (2) in the flow
  process; model weights are loaded once and shared.
- ``RDE_TASK_RUNNER=dask``: ``prefect-dask``; ``RDE_DASK_ADDRESS`` (``tcp://scheduler:8786``)
  joins an existing cluster, otherwise a local cluster of ``RDE_TASK_WORKERS`` single-threaded
  worker processes is started for the run. Each worker process loads its own models. A worker
  slow to be reaped when the cluster closes is a warning, not a failed run (``tasks.framework.dask_runner``).
"""

from __future__ import annotations

import os

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from storage.locations import project_root

KINDS = ("threads", "dask")


def default_task_runner() -> TaskRunner:
    kind = os.environ.get("RDE_TASK_RUNNER", "threads").strip().lower() or "threads"
    workers = int(os.environ.get("RDE_TASK_WORKERS", "2"))
    if kind == "threads":
        return ThreadPoolTaskRunner(max_workers=workers)
    if kind == "dask":
        try:
            from tasks.framework.dask_runner import ReapingDaskTaskRunner as DaskTaskRunner
        except ImportError as exc:
            raise RuntimeError("RDE_TASK_RUNNER=dask needs `pip install -e '.[dask]'` (prefect-dask)") from exc
        # Worker processes must import this checkout's packages; rde.common.dask_preload removes Dask's scratch
        # folder (which holds a `storage/` spill folder) from their path. Join a cluster with the same
        # preload (`dask worker --preload rde.common.dask_preload`).
        root = str(project_root())
        paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if root not in paths:
            os.environ["PYTHONPATH"] = os.pathsep.join([root, *paths])
        address = os.environ.get("RDE_DASK_ADDRESS")
        if address:
            return DaskTaskRunner(address=address)
        return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True,
                                              "dashboard_address": None, "preload": ["rde.common.dask_preload"]})
    raise RuntimeError(f"RDE_TASK_RUNNER must be one of {KINDS}, got {kind!r}")
