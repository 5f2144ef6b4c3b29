"""What every stage of a run needs: the profile, where its artifacts live, the code version."""

from __future__ import annotations

from dataclasses import dataclass

from rde.profiles import Profile
from rde.runtime import code_version, resolve_location
from storage.filesystem import join


@dataclass(frozen=True)
class RunContext:
    """A flow run's settings. Artifacts land in ``<artifacts_root>/<flow>/<profile>/<name>``."""

    profile: Profile
    flow_name: str
    output_root: str | None = None

    @property
    def root(self) -> str:
        base = self.output_root or resolve_location(self.profile.artifacts_root)
        return join(resolve_location(base), self.flow_name, self.profile.name)

    def artifact_url(self, name: str) -> str:
        return join(self.root, name)

    @property
    def code_version(self) -> str:
        return code_version()
