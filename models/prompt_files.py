"""Versioned prompt files in ``prompts/``: YAML with ``name``, ``version`` and named templates.

A prompt's identity is ``name@version#sha`` (the hash of the file), which enters the manifest of
every artifact it helped make: editing a prompt changes the lineage and re-runs its stages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import yaml

from storage.hashing import sha256_bytes
from storage.locations import project_root


class PromptError(ValueError):
    """A prompt file is missing or malformed."""


@dataclass(frozen=True)
class PromptFile:
    name: str
    version: str
    sha256: str
    templates: dict[str, str]
    extras: dict[str, Any] = field(default_factory=dict)  # other keys of the file (word lists...)

    @property
    def identity(self) -> str:
        return f"{self.name}@{self.version}#{self.sha256[:12]}"

    def render(self, name: str, /, **values: object) -> str:
        """Template ``name`` with ``{placeholders}`` filled (unused values are ignored)."""
        try:
            return self.templates[name].format(**values)
        except KeyError as exc:
            raise PromptError(f"prompt {self.identity}: template {name!r} or value {exc} missing") from None


def prompt_dir() -> Path:
    return project_root() / "prompts"


@lru_cache(maxsize=64)
def load_prompt(name: str) -> PromptFile:
    """Load ``prompts/<name>.yaml``, or the file a path names (``.yaml``; relative to the project root)."""
    if name.endswith((".yaml", ".yml")):
        given = Path(name).expanduser()
        path = given if given.is_absolute() else project_root() / given
    else:
        path = prompt_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PromptError(f"prompt file {path} not found")
    raw = path.read_bytes()
    data = yaml.safe_load(raw)
    if not isinstance(data, dict) or not {"name", "version", "templates"} <= set(data):
        raise PromptError(f"prompt file {path} needs keys name, version, templates")
    templates = {str(k): str(v) for k, v in data["templates"].items()}
    extras = {k: v for k, v in data.items() if k not in {"name", "version", "templates"}}
    return PromptFile(str(data["name"]), str(data["version"]), sha256_bytes(raw), templates, extras)
