"""How a retriever is named on the command line (``rde evaluate --model KIND:TARGET``) and what its
results depend on (its files' fingerprints, used by ``retriever_lineage``). Loading is in
``retriever_loading``.

The forms (``FORMS``):

| form | the model |
|---|---|
| ``transformers-clip:<hub id or folder>`` | CLIP, SigLIP and friends through transformers' AutoModel |
| ``sentence-transformers:<hub id or folder>`` | a text-image sentence-transformers model (``clip-ViT-B-32``) |
| ``open-clip:<arch>:<pretrained tag or checkpoint file>`` | OpenCLIP; ``<arch>`` may be a model-config JSON |
|  | file, and ``open-clip:hf-hub:<repo>`` / ``open-clip:local-dir:<folder>`` name both at once |
| ``expert:<name>`` | the profile's expert whose ``backend`` or ``model_id`` is ``<name>`` |
| ``student:<path>`` | a model trained by ``rde train-saft`` / ``train-gtr``: a checkpoint or the run's folder |
| ``python:<module or file.py>:<factory>`` | user code: ``factory()`` returns an object with ``encode_text`` |
|  | and ``encode_image`` |
| ``scores:<file>`` | a precomputed ranking: a TREC run file or Parquet (query_id, item_id, score) |

Content fingerprints (``fingerprint``): a file or every file under a folder (hidden names left
out), by relative name, size and SHA-256; a file over 64 MiB (model weights) by its size and the
SHA-256 of its first and last 4 MiB (a safetensors header and its tail), so fingerprinting a 2 GB
checkpoint reads 8 MiB, and a copy of the weights on another worker (another time stamp) has the
same fingerprint: a fanned-out stage's key agrees. Weights changed only in their middle, at the
same size, would go unnoticed. No absolute path enters it (the spec's own text does).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.specs import OPEN_CLIP_SCHEMAS

FORMS: tuple[str, ...] = (
    "transformers-clip:<hub id or folder>",
    "sentence-transformers:<hub id or folder>",
    "open-clip:<arch>:<pretrained tag or checkpoint file>",
    "expert:<profile expert backend or model_id>",
    "student:<checkpoint file or training run folder>",
    "python:<module or file.py>:<factory>",
    "scores:<TREC run or Parquet file>",
)
KINDS: tuple[str, ...] = tuple(form.split(":", 1)[0] for form in FORMS)
MODEL_KINDS = ("transformers-clip", "sentence-transformers", "open-clip")  # loaded through the model registry
HASHED_BYTES = 64 * 1024 * 1024  # files up to this size are hashed whole; larger ones by size, head and tail
EDGE_BYTES = 4 * 1024 * 1024  # the head and the tail hashed of a larger file
WEIGHT_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".ckpt", ".json", ".py", ".parquet", ".trec", ".txt",
                   ".run", ".yaml")


class RetrieverError(ValueError):
    """A retriever that cannot be named, loaded or trusted: one line, naming the model."""


def looks_like_path(target: str) -> bool:
    """Whether ``target`` names a file or folder rather than a hub id: it exists, or it is written
    as a path (absolute, ``./``, ``~``, more than one ``/``, or a file suffix)."""
    return (os.path.exists(os.path.expanduser(target)) or target.startswith(("/", ".", "~"))
            or target.count("/") > 1 or target.endswith(WEIGHT_SUFFIXES))


def existing_path(spec_text: str, target: str) -> Path:
    """``target`` as an existing path, or the one-line error for it."""
    path = Path(target).expanduser()
    if not path.exists():
        raise RetrieverError(f"{spec_text}: no such file or folder: {path}")
    return path.resolve()


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _file_entry(path: Path) -> list[Any]:
    size = path.stat().st_size
    if size <= HASHED_BYTES:
        return [size, sha256_file(path)]
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        digest.update(handle.read(EDGE_BYTES))
        handle.seek(size - EDGE_BYTES)
        digest.update(handle.read(EDGE_BYTES))
    return [size, f"edges:{digest.hexdigest()}"]


def fingerprint(path: Path) -> dict[str, Any]:
    """The content fingerprint of a file or a folder (module docstring): its file count, bytes and
    one SHA-256 over every (relative name, size, hash) entry."""
    files = [path] if path.is_file() else sorted(
        p for p in path.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts))
    entries = [[p.name if p == path else p.relative_to(path).as_posix(), *_file_entry(p)] for p in files]
    digest = hashlib.sha256(repr(entries).encode()).hexdigest()
    return {"files": len(entries), "bytes": sum(e[1] for e in entries), "sha256": digest}


def model_location(spec_text: str, target: str) -> dict[str, Any]:
    """What a model named by hub id or path depends on: the hub id, or the local content."""
    if looks_like_path(target):
        return {"content": fingerprint(existing_path(spec_text, target))}
    return {"hub_id": target}


def split_python_target(target: str) -> tuple[str, str]:
    """``module:factory`` → (module or file, factory)."""
    module, _, factory = target.rpartition(":")
    return module, factory


def python_module_file(spec_text: str, module: str) -> Path:
    """The source file of a ``python:`` spec's module: the given ``.py`` path, or where the dotted
    name is found from the current folder and ``sys.path`` (its package's parents are imported to
    find it; the module itself is not)."""
    if module.endswith(".py") or os.sep in module or "/" in module:
        return existing_path(spec_text, module)
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise RetrieverError(f"{spec_text}: cannot find module {module!r} ({exc})") from exc
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if found is None or not found.origin or not os.path.isfile(found.origin):
        raise RetrieverError(f"{spec_text}: cannot find module {module!r} (a dotted name importable from the "
                             "current folder or sys.path, or a path to a .py file)")
    return Path(found.origin)


def _slug_part(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


@dataclass(frozen=True)
class RetrieverSpec:
    """A retriever as named on the command line: ``text`` as written, its ``kind`` and ``target``."""

    text: str
    kind: str
    target: str

    @property
    def slug(self) -> str:
        """Safe as a file name and a Prefect key (lowercase letters, digits, dashes): the kind, the
        target's last part, and 8 hex digits of the SHA-256 of the text (unique per spec text)."""
        tail = self.target.rstrip("/").replace(":", "/").rsplit("/", 1)[-1]
        tail = re.sub(r"\.(pt|pth|bin|safetensors|ckpt|json|py|parquet|trec|txt|run)$", "", tail)
        readable = f"{_slug_part(self.kind)}-{_slug_part(tail)}".strip("-")[:48].strip("-")
        return f"{readable}-{hashlib.sha256(self.text.encode()).hexdigest()[:8]}"



def open_clip_parts(spec: RetrieverSpec) -> tuple[str, str | None]:
    """(architecture, pretrained tag or file); no pretrained part after ``hf-hub:`` / ``local-dir:``."""
    if spec.target.startswith(OPEN_CLIP_SCHEMAS):
        return spec.target, None
    arch, _, pretrained = spec.target.partition(":")
    return arch, pretrained


def parse_retriever(text: str) -> RetrieverSpec:
    """``kind:target`` → a ``RetrieverSpec``; an unknown kind or a malformed target is a
    ``RetrieverError`` (an unknown one lists every form)."""
    written = text.strip()
    kind, sep, target = written.partition(":")
    if not sep or kind not in KINDS:
        raise RetrieverError(f"unknown model {written!r}: the forms are {'; '.join(FORMS)}")
    form = FORMS[KINDS.index(kind)]
    if not target.strip():
        raise RetrieverError(f"{written}: nothing after {kind + ':'!r} (the form is {form})")
    spec = RetrieverSpec(written, kind, target.strip())
    if kind == "open-clip":
        arch, pretrained = open_clip_parts(spec)
        if pretrained is not None and not (arch and pretrained):
            raise RetrieverError(f"{written}: needs an architecture and its weights (the form is {form}, e.g. "
                                 "open-clip:ViT-B-32:laion2b_s34b_b79k or open-clip:ViT-B-32:/weights/model.pt)")
    if kind == "python":
        module, factory = split_python_target(spec.target)
        if not module or not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", factory):
            raise RetrieverError(f"{written}: needs a module and a factory (the form is {form}, e.g. "
                                 "python:my_retriever:make or python:./my_retriever.py:make)")
    return spec
