"""fsspec access to artifact locations: local paths and URLs (``s3://``, ``memory://``) alike."""

from __future__ import annotations

import errno
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


class StorageWriteError(RuntimeError):
    """An artifact file could not be written (disk full, permission denied, read-only...); the
    message names the path. Nothing partial is left behind."""


_HINTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded",
          errno.EACCES: "permission denied: check the owner and mode of the artifact folder",
          errno.EPERM: "operation not permitted on the artifact folder", errno.EROFS: "the filesystem is read-only"}


def is_object_store(fs: AbstractFileSystem) -> bool:
    """An object store (S3, GCS, Azure...): no rename, but a single PUT is atomic."""
    protocols = fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)
    return not any(p in ("file", "local", "memory") for p in protocols)


def atomic_write_bytes(fs: AbstractFileSystem, path: str, data: bytes, tmp_tag: str) -> None:
    """Write ``data`` to ``path`` so that readers see either nothing or the whole file.

    On a local filesystem the bytes go to a temporary sibling first and are then renamed over
    the target (POSIX ``rename`` is atomic). An object store has no rename (fsspec's ``mv`` is a
    copy and a delete), but one PUT of the whole object is atomic: the object is visible only
    once complete, and a writer killed mid-upload leaves nothing (an unfinished multipart upload
    is invisible to readers). So there the bytes are PUT once, straight to ``path``. An OSError
    becomes a ``StorageWriteError`` naming the path, after any temporary file is removed.
    """
    if is_object_store(fs):
        try:
            fs.pipe_file(path, data)
        except OSError as exc:
            raise StorageWriteError(f"cannot write artifact file {path}: {exc}") from exc
        return
    parent = posixpath.dirname(path)
    tmp = f"{path}.tmp-{tmp_tag}"
    try:
        fs.makedirs(parent, exist_ok=True)
        with fs.open(tmp, "wb") as handle:
            handle.write(data)
        fs.mv(tmp, path)
    except BaseException as exc:
        try:
            if fs.exists(tmp):
                fs.rm(tmp)
        except OSError:
            pass
        if isinstance(exc, OSError):
            hint = _HINTS.get(exc.errno or -1, exc.strerror or str(exc))
            raise StorageWriteError(f"cannot write artifact file {path}: {hint} ({exc})") from exc
        raise
