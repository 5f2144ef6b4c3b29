"""fsspec access to artifact locations: local paths and URLs (``s3://``, ``memory://``) alike."""

from __future__ import annotations

import posixpath

import fsspec
from fsspec import AbstractFileSystem


def resolve(url: str) -> tuple[AbstractFileSystem, str]:
    """Split a path or URL into (filesystem, path inside it)."""
    fs, path = fsspec.core.url_to_fs(str(url))
    return fs, path


def join(base: str, *parts: str) -> str:
    """Join path parts with '/' (valid for local paths and object stores)."""
    return posixpath.join(str(base), *parts)


def atomic_write_bytes(fs: AbstractFileSystem, path: str, data: bytes, tmp_tag: str) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file.

    The bytes go to a temporary sibling first and are then renamed over the target;
    on a local filesystem the rename is atomic (POSIX ``rename``).
    """
    parent = posixpath.dirname(path)
    fs.makedirs(parent, exist_ok=True)
    tmp = f"{path}.tmp-{tmp_tag}"
    try:
        with fs.open(tmp, "wb") as handle:
            handle.write(data)
        fs.mv(tmp, path)
    except BaseException:
        if fs.exists(tmp):
            fs.rm(tmp)
        raise
