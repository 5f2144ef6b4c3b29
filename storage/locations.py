"""Where things are: the project root, the state folder, profile locations, a flow's artifacts.

At the bottom of the import order (with the models), so model code can find its caches and the
prompt files without reaching up into the pipelines.
"""

from __future__ import annotations

import os
from pathlib import Path

from storage.filesystem import join


def project_root() -> Path:
    """The repository root (``RDE_PROJECT_ROOT`` overrides): profile-relative paths resolve here."""
    env = os.environ.get("RDE_PROJECT_ROOT")
    return Path(env).resolve() if env else Path(__file__).resolve().parent.parent


def state_dir() -> Path:
    """Folder for Prefect's home, results and logs (``RDE_STATE_DIR`` overrides; default ``.rde``)."""
    env = os.environ.get("RDE_STATE_DIR")
    return Path(env).resolve() if env else project_root() / ".rde"


def resolve_location(location: str) -> str:
    """A profile location as an absolute path or an fsspec URL (URLs are left as they are)."""
    if "://" in location:
        return location
    path = Path(location)
    return str(path if path.is_absolute() else project_root() / path)


def flow_root(artifacts_root: str, flow_name: str, profile_name: str, output_root: str | None = None) -> str:
    """The folder of one flow's artifacts under one profile: ``<output or artifacts root>/<flow>/<profile>``."""
    return join(resolve_location(output_root or artifacts_root), flow_name, profile_name)
