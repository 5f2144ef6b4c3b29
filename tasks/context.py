"""What every stage of a run needs: the profile, where its artifacts live, the code version."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rde.common.profiles import Profile, load_profile
from rde.common.run_lock import output_lock
from rde.common.runtime import code_version
from storage.filesystem import join
from storage.locations import flow_root

T = TypeVar("T")


@dataclass(frozen=True)
class RunContext:
    """A flow run's settings. Artifacts land in ``<artifacts_root>/<flow>/<profile>/<name>``."""

    profile: Profile
    flow_name: str
    output_root: str | None = None

    @property
    def root(self) -> str:
        return flow_root(self.profile.artifacts_root, self.flow_name, self.profile.name, self.output_root)

    def artifact_url(self, name: str) -> str:
        return join(self.root, name)

    @property
    def code_version(self) -> str:
        return code_version()


def run_locked(flow_name: str, stages: Sequence[str], profile: str, overrides: dict[str, Any] | None,
               output_root: str | None, until: str | None, body: Callable[[RunContext, str | None], T]) -> T:
    """Validate ``until``, load the profile and run ``body`` holding the output folder's run lock
    (one run per output folder at a time)."""
    if until is not None and until not in stages:
        raise ValueError(f"until must be one of {tuple(stages)}, got {until!r}")
    ctx = RunContext(load_profile(profile, overrides), flow_name, output_root)
    with output_lock(ctx.root, flow_name):
        return body(ctx, until)
