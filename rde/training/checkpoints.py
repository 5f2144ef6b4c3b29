"""Training checkpoints in the artifact store: a local folder or an object-store URL (``s3://``).

A checkpoint is one file, ``step-<step>.pt``, written atomically (``storage.filesystem.
atomic_write_bytes``: a rename on a disk, one PUT on an object store), so a run killed while saving
leaves the previous checkpoint whole. It holds what a resumed run needs to go on as if it had never
stopped: the model and optimiser states, the step (the learning-rate schedule is a function of it),
the epoch and the position in that epoch's seeded order (so no pair of the epoch is seen twice),
the losses of the epoch so far, the pair weights, and the RNG states. Only the newest ``keep``
checkpoints are kept. Files of the earlier per-epoch form (``epoch-<n>.pt``) still resume, at the
end of their epoch.
"""

from __future__ import annotations

import io
import os
import re
from typing import Any

import torch

from storage.filesystem import atomic_write_bytes, join, resolve

STEP_FILE = re.compile(r"^step-(\d+)\.pt$")
EPOCH_FILE = re.compile(r"^epoch-(\d+)\.pt$")


class CheckpointStore:
    """Checkpoints under ``url`` (a folder path or an fsspec URL), the newest ``keep`` kept."""

    def __init__(self, url: str, keep: int = 2) -> None:
        self.url, self.keep = str(url), keep
        self.fs, self.path = resolve(self.url)

    def save(self, state: dict[str, Any]) -> str:
        """Write ``state`` (its ``step`` names the file) atomically, then drop all but the newest
        ``keep`` step checkpoints. Returns the file's URL."""
        buffer = io.BytesIO()
        torch.save(state, buffer)
        name = f"step-{int(state['step']):09d}.pt"
        atomic_write_bytes(self.fs, join(self.path, name), buffer.getvalue(), f"{os.getpid()}")
        for old in self._steps()[:-self.keep]:
            self.fs.rm_file(join(self.path, old))
        return join(self.url, name)

    def latest(self) -> dict[str, Any] | None:
        """The newest checkpoint's state (``torch.load(weights_only=True)``: tensors and plain
        values only), or None. A per-epoch file of the earlier form counts as the end of its epoch."""
        steps, epochs = self._steps(), self._names(EPOCH_FILE)
        newest = self._load(steps[-1]) if steps else None
        if epochs:  # its step is only inside it
            legacy = self._load(epochs[-1])
            legacy.setdefault("position", None)  # the earlier form: saved at the end of its epoch
            if newest is None or legacy["step"] > newest["step"]:
                newest = legacy
        return newest

    def _load(self, name: str) -> dict[str, Any]:
        with self.fs.open(join(self.path, name), "rb") as handle:
            return torch.load(io.BytesIO(handle.read()), weights_only=True, map_location="cpu")

    def _steps(self) -> list[str]:
        return self._names(STEP_FILE)

    def _names(self, pattern: re.Pattern[str]) -> list[str]:
        if not self.fs.exists(self.path):
            return []
        return sorted(os.path.basename(p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)
                      if pattern.match(os.path.basename(p.rstrip("/"))))
