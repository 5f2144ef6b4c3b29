"""Per-image results kept on disk, so another process that asks about the same pixels reads them.

``ContentMemo`` keeps a model's per-image results within one process. Many processes measure the
same images: every run over one pool on a worker, a rerun into another output folder, an
experiment repeated with another threshold downstream, the test suite's dozens of runs over slices
of the demo pool. Where ``RDE_DETECTION_CACHE`` names a folder, a ``DiskMemo`` under it keeps one
small ``.npz`` file per image (a few named arrays), named by the image's digest, in a subfolder
named by a digest of everything the result depends on (the model, its weights, its settings, the
library that runs it): another model or setting is another subfolder, never a stale answer.
Writes are atomic (temp file + rename), so concurrent processes may store the same image; a file
that cannot be read is computed again and replaced. Off when the variable is unset: a result on
disk is only as fresh as the identity it is keyed by, so keeping it is the operator's choice.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from models.backends.content_memo import image_digest

logger = logging.getLogger(__name__)

DETECTION_CACHE_ENV = "RDE_DETECTION_CACHE"

Arrays = dict[str, np.ndarray]


def detection_cache_folder() -> Path | None:
    """The folder ``RDE_DETECTION_CACHE`` names, or None (detections are not kept on disk)."""
    value = os.environ.get(DETECTION_CACHE_ENV, "").strip()
    return Path(value) if value else None


def identity_key(identity: Mapping[str, Any]) -> str:
    """A digest of what a result depends on (JSON of ``identity``, keys sorted)."""
    return hashlib.sha256(json.dumps(dict(identity), sort_keys=True, default=str).encode()).hexdigest()[:32]


class DiskMemo:
    """Per-image arrays named ``names`` under ``folder/<identity key>/<digest[:2]>/<digest>.npz``."""

    def __init__(self, folder: Path, identity: Mapping[str, Any], names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.root = Path(folder)
        self.folder = self.root / identity_key(identity)
        self.hits = 0
        self.misses = 0

    def path(self, image: np.ndarray) -> Path:
        digest = image_digest(image).hex()
        return self.folder / digest[:2] / f"{digest}.npz"

    def get_or_compute(self, images: Sequence[np.ndarray],
                       compute: Callable[[list[np.ndarray]], Sequence[Arrays]]) -> list[Arrays]:
        """One result per image: read where a file exists, the rest from one ``compute`` call (in
        their order) and then stored."""
        paths = [self.path(image) for image in images]
        out: list[Arrays | None] = [_read(path, self.names) for path in paths]
        missing = [i for i, found in enumerate(out) if found is None]
        if missing:
            computed = list(compute([images[i] for i in missing]))
            if len(computed) != len(missing):
                raise ValueError(f"compute returned {len(computed)} results for {len(missing)} images")
            for i, arrays in zip(missing, computed, strict=True):
                if set(arrays) != set(self.names):
                    raise ValueError(f"compute returned arrays {sorted(arrays)}, not {sorted(self.names)}")
                out[i] = arrays
                _write(paths[i], arrays)
        self.hits += len(images) - len(missing)
        self.misses += len(missing)
        return [found for found in out if found is not None]


def _read(path: Path, names: tuple[str, ...]) -> Arrays | None:
    if not path.exists():
        return None
    try:
        with np.load(path, allow_pickle=False) as data:
            if set(data.files) != set(names):
                raise ValueError(f"holds {sorted(data.files)}, not {sorted(names)}")
            return {name: data[name] for name in names}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:  # torn or foreign: computed again
        logger.warning("disk memo: ignoring unreadable %s (%s)", path, exc)
        return None


def _write(path: Path, arrays: Arrays) -> None:
    """Temp file + rename: a reader sees the whole file or none; two writers write the same result."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npz", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only or full folder costs time, never results
        logger.warning("disk memo: could not store %s (%s)", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def keep_nothing_on_disk() -> None:
    """Turn the disk memo off in this process and in the processes it starts: a benchmark times the
    models, not the files an earlier run left behind."""
    os.environ.pop(DETECTION_CACHE_ENV, None)
