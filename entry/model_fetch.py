"""``rde models fetch``: download every model a profile names, once, on a machine that can reach
the hubs, so that runs (which never reach a hub: ``HF_HUB_OFFLINE=1``) find them.

- a Hugging Face id: ``huggingface_hub.snapshot_download`` into the Hugging Face cache (``--cache-dir``,
  default the cache ``HF_HUB_CACHE`` / ``HF_HOME`` name), at the profile's ``revision``; a run on this
  machine, or on a worker whose ``HF_HUB_CACHE`` points at the same folder, then loads the same id
  offline. ``HF_ENDPOINT`` selects a mirror.
- an open-vocabulary detector (``detector.backend: owl``) is a Hugging Face id like the others;
- YOLO weights (``detector.weights``, a ``.pt`` path): the file of that name from the Ultralytics
  assets release (``RDE_YOLO_ASSETS_URL``), written to that path.
- bundled models, offline backends and served endpoints: nothing to download (their state is shown
  as ``rde doctor`` shows it); a local path that is missing cannot be fetched: the report says so.

Each download is then checked: the snapshot holds a ``config.json`` (or the one file asked for) and
at least one weights file, and its size is reported.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from entry.doctor import hub_id, model_check, profile_models, size_text, tree_size
from rde.profile import Profile
from storage.locations import project_root

YOLO_ASSETS_URL = "https://github.com/ultralytics/assets/releases/download/v8.3.0"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".onnx", ".msgpack", ".h5")


@dataclass(frozen=True)
class Fetched:
    """One model after ``fetch``: ``status`` is ``fetched``, ``present`` (already here), ``served``
    or ``missing``; ``where`` the folder or file, ``size`` in bytes, ``note`` what to do if missing."""

    role: str
    model: str
    status: str
    where: str = ""
    size: int = 0
    note: str = ""


@contextlib.contextmanager
def hub_online() -> Iterator[None]:
    """Hugging Face requests allowed while the block runs (runs set ``HF_HUB_OFFLINE=1``; the
    library reads that setting on each request, from its constants)."""
    from huggingface_hub import constants

    before = constants.HF_HUB_OFFLINE
    constants.HF_HUB_OFFLINE = False
    try:
        yield
    finally:
        constants.HF_HUB_OFFLINE = before


def _weights_in(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file()]


def fetch_hub(model_id: str, revision: str | None, cache_dir: Path | None) -> Path:
    """The snapshot folder of ``model_id`` in the cache, downloaded when not there; raises
    ``ValueError`` when the snapshot has no config or no weights file."""
    from huggingface_hub import snapshot_download

    with hub_online():
        folder = Path(snapshot_download(model_id, revision=revision, cache_dir=cache_dir,
                                        endpoint=os.environ.get("HF_ENDPOINT") or None))
    if not (folder / "config.json").exists() and not (folder / "config_sentence_transformers.json").exists():
        raise ValueError(f"{model_id}: the download holds no config.json")
    if not _weights_in(folder):
        raise ValueError(f"{model_id}: the download holds no weights file ({', '.join(WEIGHT_SUFFIXES)})")
    return folder


def fetch_yolo(weights: str) -> Path:
    """``weights`` (a ``.pt`` path) downloaded from the Ultralytics assets release by its file name."""
    target = Path(weights) if Path(weights).is_absolute() else project_root() / weights
    base = os.environ.get("RDE_YOLO_ASSETS_URL", YOLO_ASSETS_URL).rstrip("/")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    with httpx.stream("GET", f"{base}/{target.name}", follow_redirects=True, timeout=60.0) as answer:
        answer.raise_for_status()
        with partial.open("wb") as out:
            for chunk in answer.iter_bytes():
                out.write(chunk)
    if partial.stat().st_size == 0:
        partial.unlink()
        raise ValueError(f"{target.name}: the download is empty")
    partial.replace(target)  # whole or not there
    return target


def fetch_one(role: str, spec: Any, cache_dir: Path | None) -> Fetched:
    """One model of the profile fetched, or why it is not."""
    here = model_check(role, spec, cache_dir)
    name = str(getattr(spec, "model_id", None) or getattr(spec, "weights", None) or spec.backend)
    if here.status != "fail":  # here (a warning, e.g. a YOLO built from its config, keeps its note)
        status = "served" if spec.backend == "openai-http" else "present"
        return Fetched(role, name, status, here.fact, note=here.todo)
    try:
        if role == "detector" and spec.backend == "yolo" and str(spec.weights).endswith(".pt"):
            path = fetch_yolo(spec.weights)
            return Fetched(role, name, "fetched", str(path), path.stat().st_size)
        if getattr(spec, "model_id", None) and hub_id(spec.model_id) and spec.backend != "openai-http":
            folder = fetch_hub(spec.model_id, spec.revision, cache_dir)
            return Fetched(role, name, "fetched", str(folder), tree_size(folder))
    except (httpx.HTTPError, OSError, ValueError) as exc:
        return Fetched(role, name, "missing", note=f"download failed: {str(exc).splitlines()[0][:300]}")
    except Exception as exc:  # the hub library's own errors (repository not found, gated, offline...)
        return Fetched(role, name, "missing", note=f"download failed: {type(exc).__name__}: "
                                                   f"{str(exc).splitlines()[0][:300]}")
    return Fetched(role, name, "missing", note=f"{here.fact}; {here.todo}".strip("; "))


def fetch_models(prof: Profile, cache_dir: Path | None = None) -> list[Fetched]:
    """Every model the profile runs, fetched where it can be (see the module docstring)."""
    return [fetch_one(role, spec, cache_dir) for role, spec in profile_models(prof)]


def describe(item: Fetched) -> tuple[str, str]:
    """The report's ``where`` and ``size`` cells of one model."""
    return item.where or item.note, size_text(item.size) if item.size else ""
