"""Confinement (secure by default): where a listed input may be read from, and reading a local file safely.

A file is read only when its real path (after every symbolic link and ``..``) lies inside the
input's root — the folder itself, or for a path list the profile's ``input.roots`` or, when none
are set, the list file's own folder. A URL is read only under the root URL or a URL in
``input.roots`` (its key normalised: ``..`` resolved; another bucket is outside). ``input.confine:
false`` turns this off explicitly. Outside is the rejected row ``outside_root``.

Split from ``rde.common.ingest`` so the security rule stands on its own; the video input
(``rde.common.video_input``) confines its files with the same ``allowed_roots`` and ``confined_file``.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from rde.common import shard_inputs, url_inputs
from rde.common.image_decoding import DecodeError
from rde.common.input_listing import InputRef, input_location, names_shard
from rde.common.pool_config import IngestSpec, InputSpec
from rde.common.reasons import Reason
from rde.common.url_inputs import is_url


def allowed_roots(spec: InputSpec, project_root: Path) -> list[str] | None:
    """The real folders and URL prefixes an input may resolve into, or None when ``input.confine``
    is off.

    A folder input (or a sharded one's folder or prefix) is confined to itself, a single shard file
    to its folder; a path list to ``input.roots`` or, when none are set, to the list file's own
    folder or prefix; a pool reads no files (no roots).
    """
    if not spec.confine:
        return None
    if spec.kind in ("pool", "video"):  # a video input's images are the videos stage's crops (an artifact)
        return []
    location = input_location(spec, project_root)
    if spec.kind == "folder" or (spec.kind in shard_inputs.SHARD_SUFFIXES and not names_shard(location, spec.kind)):
        return [_root(location)]
    if spec.kind == "paths" and spec.roots:
        return [_root(input_location(spec.model_copy(update={"path": r}), project_root)) for r in spec.roots]
    return [_root(url_inputs.parent_location(location))]


def _root(location: str) -> str:
    """A root as compared: a URL normalised (``..`` resolved), a local folder's real path."""
    return url_inputs.parse_url(location).url if is_url(location) else os.path.realpath(location)


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def confined_file(ref: InputRef, roots: list[str] | None) -> str:
    """The real path of a listed input that is a regular file inside the allowed roots (checked with
    ``stat`` on the real path, after every link; ``roots`` None: anywhere), else a DecodeError with
    the reason: outside_root (whether a path outside exists is not told), missing_file,
    not_a_regular_file. A URL is checked against the root URLs only (a read tells the rest)."""
    if not ref.source:
        raise DecodeError(Reason.MISSING_FILE, "empty path")
    if is_url(ref.source):
        if roots is not None and not url_inputs.url_inside(ref.source, roots):
            raise DecodeError(Reason.OUTSIDE_ROOT, f"{ref.source} is outside the allowed roots {roots}")
        return ref.source
    path = Path(ref.source)
    real = os.path.realpath(path)  # confinement first: whether a path outside exists is not told
    if roots is not None and not _inside(real, roots):
        raise DecodeError(Reason.OUTSIDE_ROOT, f"{path} resolves to {real}, outside the allowed roots {roots}")
    try:
        mode = os.stat(real).st_mode
    except OSError:
        detail = f"{path} does not exist" if real == os.path.abspath(path) else \
            f"{path} resolves to {real}, which does not exist"
        raise DecodeError(Reason.MISSING_FILE, detail) from None
    if not stat.S_ISREG(mode):
        raise DecodeError(Reason.NOT_A_REGULAR_FILE, f"{path} is a {_file_kind(mode)}, not a regular file")
    return real


def read_local_file(ref: InputRef, spec: IngestSpec, roots: list[str] | None) -> bytes:
    """The bytes of a regular file inside the allowed roots (``confined_file``), then opened
    non-blocking and checked again with ``fstat`` (a FIFO swapped in never blocks)."""
    real = confined_file(ref, roots)
    path = Path(ref.source)
    try:
        fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        raise DecodeError(Reason.READ_ERROR, f"{path}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DecodeError(Reason.NOT_A_REGULAR_FILE, f"{path} is a {_file_kind(st.st_mode)}, not a regular file")
        if st.st_size > spec.max_file_bytes:
            raise DecodeError(Reason.FILE_TOO_LARGE, f"{st.st_size} bytes exceeds limit {spec.max_file_bytes}")
        with os.fdopen(fd, "rb", closefd=False) as handle:
            data = handle.read(spec.max_file_bytes + 1)
        if len(data) > spec.max_file_bytes:  # it grew after fstat
            raise DecodeError(Reason.FILE_TOO_LARGE, f"over {spec.max_file_bytes} bytes (the file grew while read)")
        return data
    except OSError as exc:
        raise DecodeError(Reason.READ_ERROR, f"{path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _file_kind(mode: int) -> str:
    kinds = [(stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device")]
    return next((name for test, name in kinds if test(mode)), "special file")
