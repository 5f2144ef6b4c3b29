"""The ``prefect`` profile section: how the flows use Prefect (the GPU concurrency limit, the fan-out
of GPU stages' shards over a work pool, how often a crashed deployment run is resumed).

Its readers are the stage framework's fan-out (``tasks/framework/fanout.py``) and the flows, all above
the pipelines, and the framework knows no pipeline; the section must sit below whatever composes a
profile, so it is here in ``rde.common``, which they all import downward. ``rde.profile`` composes it
into a ``Profile``.
"""

from __future__ import annotations

from pydantic import Field

from models.specs import Strict


class FanoutSpec(Strict):
    """Shard fan-out over work pools: a per-shard GPU stage runs as shard-range flow runs of the
    ``deployment`` (any worker of its pool picks them up) instead of as tasks of this flow run, and a
    per-shard CPU stage as runs of ``cpu_deployment`` where one is named. Off by default: small runs
    keep the single-worker path."""

    def deployment_for(self, device: str) -> str | None:
        """The deployment that runs shard ranges of a stage on ``device`` ("cpu" or "gpu"); None:
        such stages stay in the parent flow run."""
        return self.deployment if device == "gpu" else self.cpu_deployment

    enabled: bool = Field(False, description="Fan the per-shard GPU stages (and, with cpu_deployment, the "
                          "per-shard CPU stages) out over the work pools.")
    stages: list[str] = Field(default_factory=list, description="The per-shard stages that fan out, by "
                              "name; empty: all of them (CPU stages only where cpu_deployment is set).")
    deployment: str = Field("run-shards/gpu", description="The deployment that runs a shard range of a GPU "
                            "stage, as \"flow name/deployment name\" in prefect.yaml.")
    cpu_deployment: str | None = Field(None, description="The deployment that runs a shard range of a per-shard "
                                       "CPU stage (ingest, denoise, hard-negatives, the exports), on a pool of CPU "
                                       "workers; null: CPU stages run in the parent flow run.")
    shards_per_run: int = Field(1, ge=1, description="Shards in one range (one flow run, which loads its "
                                "models once).")
    max_attempts: int = Field(3, ge=1, description="Runs of one range before the stage fails.")
    poll_s: float = Field(2.0, gt=0, description="Interval between checks of the ranges' flow runs (seconds).")
    # PREFECT_FLOWS_HEARTBEAT_FREQUENCY is 30 s in `rde stack up`
    stale_after_s: float = Field(90.0, ge=1, description="A flow run that sent no heartbeat this long is marked "
                                 "Crashed by the server's zombie automation (the window `rde stack up` and `rde "
                                 "stack automations` give it; by the parent itself on a server without one), and "
                                 "a shard-range run so marked is resubmitted (seconds).")
    unclaimed_warn_s: float = Field(300.0, gt=0, description="Warn when no worker has started a range's run "
                                    "this long (seconds).")


class PrefectSpec(Strict):
    """How the flows use Prefect: the GPU concurrency limit and the fan-out of shards over a pool."""

    # the flows' task runner reads RDE_TASK_RUNNER / RDE_TASK_WORKERS (tasks/framework/task_runners.py), not this key
    task_runner_workers: int = Field(2, ge=1, description="Not read: the flows' worker threads are set by the "
                                     "environment variable RDE_TASK_WORKERS.")
    gpu_concurrency_limit: str = Field("gpu", description="Tag of the Prefect global concurrency limit that "
                                       "GPU stages' shard tasks take a slot of.")
    fanout: FanoutSpec = Field(FanoutSpec(), description="Shard fan-out of GPU stages over a work pool.")
    resume_max_runs: int = Field(3, ge=1, description="Runs of one deployment flow run, counting those the "
                                 "server's resume automation starts after a crash: a run started more often "
                                 "fails at once instead (a crash that repeats, such as running out of memory, is "
                                 "not retried forever).")
