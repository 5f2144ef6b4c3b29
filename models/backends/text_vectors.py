"""Embeddings of fixed prompt lists kept on disk, so a new process does not encode them again.

The semantic-bridge expert compares every image with the MiniLM embeddings of the 1000 ImageNet
class prompts. Encoding them costs 10-17 CPU seconds on these two cores, and every process that
encodes images with the bridge paid it once: each flow run on a worker, each CLI run, each test
worker. The vectors depend only on the encoder and the exact texts, so they are stored under a key
of both (``<folder>/<key>.npy``, written atomically) and read back by later processes; an edited
prompt or another encoder is another key. ``RDE_TEXT_VECTOR_CACHE`` names the folder (default: the
registry's ``<state dir>/text_vectors``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from models.backends.interfaces import TextEncoder

logger = logging.getLogger(__name__)

CACHE_ENV = "RDE_TEXT_VECTOR_CACHE"

_memo: dict[str, np.ndarray] = {}
_lock = threading.Lock()


def encoder_identity(encoder: TextEncoder) -> dict[str, object]:
    """What the vectors depend on besides the texts: the model (id, revision, width) and torch's version."""
    import torch

    spec = getattr(encoder, "spec", None)
    return {"model_id": encoder.model_id, "revision": getattr(spec, "revision", None), "dim": int(encoder.dim),
            "torch": torch.__version__}


def vectors_key(encoder: TextEncoder, texts: Sequence[str]) -> str:
    payload = json.dumps({"encoder": encoder_identity(encoder), "texts": list(texts)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()


def cache_folder(default: Path | None) -> Path | None:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else default


def cached_text_vectors(encoder: TextEncoder, texts: Sequence[str], folder: Path | None) -> np.ndarray:
    """``encoder.encode(texts)``, from this process's memo, else from ``folder`` (when given), else
    encoded and stored there. A file of the wrong shape or unreadable is ignored and replaced."""
    key = vectors_key(encoder, texts)
    with _lock:
        if key in _memo:
            return _memo[key]
    path = folder / f"{key[:32]}.npy" if folder is not None else None
    vectors = _read(path, (len(texts), int(encoder.dim)))
    if vectors is None:
        vectors = np.asarray(encoder.encode(list(texts)), np.float32)
        if path is not None:
            _write(path, vectors)
    with _lock:
        _memo[key] = vectors
    return vectors


def _read(path: Path | None, shape: tuple[int, int]) -> np.ndarray | None:
    if path is None or not path.exists():
        return None
    try:
        vectors = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        logger.warning("text vectors: ignoring unreadable %s (%s)", path, exc)
        return None
    if vectors.shape != shape or vectors.dtype != np.float32:
        logger.warning("text vectors: ignoring %s of shape %s (expected %s)", path, vectors.shape, shape)
        return None
    return vectors


def _write(path: Path, vectors: np.ndarray) -> None:
    """Temp file + rename: a reader sees the whole file or none; two writers write the same bytes."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".npy", dir=path.parent)
        with os.fdopen(fd, "wb") as f:
            np.save(f, vectors, allow_pickle=False)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only state folder costs time, never results
        logger.warning("text vectors: could not store %s (%s)", path, exc)
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
