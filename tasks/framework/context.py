"""What every stage of a run needs: the profile, where its artifacts live, the code version."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rde.common.run_lock import output_lock
from rde.common.runtime import code_version
from rde.profile import Profile, load_profile
from storage.filesystem import join
from storage.locations import flow_root, resolve_location

T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """A flow run's settings. Artifacts land in ``<artifacts_root>/<flow>/<profile>/<name>``."""

    profile: Profile
    flow_name: str
    output_root: str | None = None
    # folders of this run's shared (content-addressed) outputs, set by the runner: folder → URL
    locations: dict[str, str] = field(default_factory=dict, compare=False, hash=False, repr=False)
    # how the profile was loaded (name or path, run overrides): a shard-range flow run of a fanned-out
    # stage (tasks/framework/fanout.py) loads it the same way, so input confinement is checked there too
    source: str = ""
    overrides: dict[str, Any] | None = field(default=None, compare=False, hash=False, repr=False)
    # redo the inputs a complete stage rejected for a transient reason (tasks/framework/retry.py)
    retry_rejects: bool = False

    @property
    def root(self) -> str:
        return flow_root(self.profile.artifacts_root, self.flow_name, self.profile.name, self.output_root)

    def artifact_url(self, name: str) -> str:
        """Where the artifact ``name`` of this run lives: under the flow's folder, or where the runner
        put a shared output of that name."""
        return self.locations.get(name) or join(self.root, name)

    @property
    def base(self) -> str:
        """The root every flow of this run's output writes under (``--output`` or the profile's
        ``artifacts_root``): its ``cache/`` (content-keyed embeddings) and ``shared/`` folders are
        shared by all flows and profiles writing there."""
        return resolve_location(self.output_root or self.profile.artifacts_root)

    def shared_url(self, folder: str, key: str) -> str:
        """A content-addressed folder that every flow of the profile writing ``folder`` with the
        same stage key shares: ``<base>/shared/<profile>/<folder>/<key[:16]>``."""
        return join(self.base, "shared", self.profile.name, folder, key[:16])

    @property
    def code_version(self) -> str:
        return code_version()


def run_locked(flow_name: str, stages: Sequence[str], profile: str, overrides: dict[str, Any] | None,
               output_root: str | None, until: str | None, body: Callable[[RunContext, str | None], T],
               retry_rejects: bool = False) -> T:
    """Validate ``until``, load the profile, refuse a run resumed too often (``check_run_count``)
    and run ``body`` holding the output folder's run lock (one run per output folder at a time)."""
    if until is not None and until not in stages:
        raise ValueError(f"until must be one of {tuple(stages)}, got {until!r}")
    ctx = RunContext(load_profile(profile, overrides), flow_name, output_root, source=profile, overrides=overrides,
                     retry_rejects=retry_rejects)
    check_run_count(ctx.profile.prefect.resume_max_runs)
    with output_lock(ctx.root, flow_name):
        return body(ctx, until)


class ResumeLimitError(RuntimeError):
    """A flow run was started more often than ``prefect.resume_max_runs`` allows."""


def check_run_count(max_runs: int) -> None:
    """Fail (a Failed state, which the server's resume automation leaves alone: it acts on Crashed
    only) when this flow run has been started more than ``max_runs`` times: each crash and resume
    counts one (Prefect's ``run_count``). Outside a flow run, or on its first run, nothing happens."""
    from prefect.runtime import flow_run

    runs = int(flow_run.run_count or 0)
    if runs > max_runs:
        raise ResumeLimitError(f"flow run {flow_run.name} has been started {runs} times (it crashed and was resumed "
                               f"each time); prefect.resume_max_runs is {max_runs}. Find why it crashes (its logs, "
                               "the worker's memory), then start a new run of the deployment (a Retry of this run "
                               "counts as one more start): the shards written so far are reused")
