"""Inputs on object storage: URLs (``s3://bucket/prefix/x.jpg``) listed, confined and read.

Any fsspec protocol with an installed implementation works; S3 (s3fs) is the one tested, against
moto's server. Credentials and endpoints never come from a profile: s3fs reads the environment
(``AWS_ACCESS_KEY_ID``, ``AWS_PROFILE``...), ``~/.aws`` and fsspec's own configuration
(``FSSPEC_S3_ENDPOINT_URL``, ``~/.config/fsspec/*.json``).

- **Confinement.** A URL is compared after its key is normalised (``..`` and ``.`` resolved, as
  ``posixpath.normpath`` does): it is inside a root URL when the protocol and bucket are the same
  and the key lies under the root's key. So ``s3://b/in/../other.jpg`` and ``s3://other-bucket/x``
  are both outside ``s3://b/in/``.
- **Listing** is streamed page by page (S3 lists at most 1,000 keys a request); each object is
  reduced to (URL, size, ETag) before the next page is asked for, and the listing's fingerprint is a
  running hash of those triples, so no object is read to fingerprint the listing.
- **Reads** are ranged GETs of at most ``max_file_bytes + 1`` bytes, issued concurrently for a
  shard (fsspec's ``cat_ranges``), and retried with a doubling back-off when they fail for a
  reason that may pass (a dropped connection, a timeout, throttling); a missing object is
  ``missing_file`` and a refused one (HTTP 403) ``access_denied`` at once, without a retry.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import fsspec
from fsspec import AbstractFileSystem
from fsspec.asyn import sync

from rde.common.image_decoding import DecodeError
from rde.common.reasons import Reason

# the longest single wait between two attempts of one read (seconds)
MAX_BACKOFF_S = 8.0


@dataclass(frozen=True)
class ObjectUrl:
    """A URL split into protocol, bucket (the URL's first part) and normalised key."""

    protocol: str
    bucket: str
    key: str

    @property
    def url(self) -> str:
        return f"{self.protocol}://{self.bucket}/{self.key}" if self.key else f"{self.protocol}://{self.bucket}/"


# one spelling per store: 's3a://' and 's3://' name the same objects
_ALIASES = {"s3a": "s3", "gcs": "gs"}


def is_url(raw: str) -> bool:
    return "://" in raw


def parse_url(raw: str) -> ObjectUrl:
    """``s3://b/a/../c.jpg`` → ObjectUrl('s3', 'b', 'c.jpg'). A key that climbs above the bucket keeps
    its leading ``..`` (and so is inside no root)."""
    protocol, rest = raw.split("://", 1)
    bucket, _, key = rest.partition("/")
    key = posixpath.normpath(key) if key else ""
    key = "" if key == "." else key.lstrip("/")
    return ObjectUrl(_ALIASES.get(protocol.lower(), protocol.lower()), bucket, key)


def url_inside(raw: str, roots: list[str]) -> bool:
    """Whether the URL lies under one of the root URLs (local roots never match a URL)."""
    target = parse_url(raw)
    if target.key.startswith("..") or not target.bucket:
        return False
    for root in roots:
        if not is_url(root):
            continue
        base = parse_url(root)
        if (base.protocol, base.bucket) != (target.protocol, target.bucket):
            continue
        if not base.key or target.key == base.key or target.key.startswith(base.key.rstrip("/") + "/"):
            return True
    return False


def protocol_known(raw: str) -> bool:
    """Whether fsspec has an importable implementation for the URL's protocol (``file`` excluded:
    a path list names local files by their path)."""
    protocol = raw.split("://", 1)[0].lower()
    if protocol in ("file", "local"):
        return False
    try:
        fsspec.get_filesystem_class(protocol)
    except (ValueError, ImportError):
        return False
    return True


@dataclass(frozen=True)
class ListedObject:
    url: str
    size: int
    version: str  # the ETag where the store gives one, else the modification time


def iter_objects(root_url: str, suffixes: tuple[str, ...] | None = None,
                 page_size: int | None = None) -> Iterator[ListedObject]:
    """Every object under the root URL (a prefix; ``/`` ends it), in the store's key order, page by
    page (``page_size`` keys a page at most; S3's default and largest is 1,000); ``suffixes`` keeps
    only names ending so (lower case). Folder markers (keys ending in ``/``) are skipped."""
    fs, path = fsspec.core.url_to_fs(root_url)
    protocol = parse_url(root_url).protocol
    prefix_path = path.rstrip("/")
    keep = (lambda name: name.lower().endswith(suffixes)) if suffixes else (lambda name: True)
    if hasattr(fs, "_list_pages"):  # s3fs: list_objects_v2 pages, each retried by s3fs itself
        bucket, _, key = prefix_path.partition("/")
        size = {"MaxKeys": page_size} if page_size else {}
        pages = fs._list_pages("list_objects_v2", Bucket=bucket, Prefix=f"{key}/" if key else "", **size, **fs.req_kw)
        try:
            while True:
                try:
                    page = sync(fs.loop, pages.__anext__)
                except StopAsyncIteration:
                    return
                for item in page.get("Contents", []):
                    name = item["Key"]
                    if name.endswith("/") or not keep(name):
                        continue
                    yield ListedObject(f"{protocol}://{bucket}/{name}", int(item["Size"]),
                                       str(item.get("ETag", "")).strip('"'))
        finally:
            sync(fs.loop, pages.aclose)
    else:  # any other fsspec store: one folder level at a time
        for _, _, files in fs.walk(prefix_path, detail=True):
            for name in sorted(files):
                info = files[name]
                full = info["name"]
                if keep(full):
                    yield ListedObject(f"{protocol}://{full.lstrip('/')}", int(info.get("size") or 0),
                                       str(info.get("ETag") or info.get("mtime") or info.get("created") or ""))


class ListingFingerprint:
    """A running SHA-256 of (URL, size, version) triples: the listing's fingerprint without holding it."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def add(self, *fields: object) -> None:
        self._hash.update(json.dumps(list(fields), default=str).encode() + b"\n")

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def url_folder_problem(root_url: str) -> str | None:
    """Why the prefix cannot serve as an input (no such bucket, no credentials, access denied,
    nothing under it), as a user message; None when it lists at least one object."""
    try:
        first = next(iter_objects(root_url, page_size=1), None)  # one key asked for, not a page
    except FileNotFoundError:
        return f"input {root_url}: no such bucket or prefix"
    except PermissionError as exc:
        return f"input {root_url}: listing was refused (access denied: {exc})"
    except Exception as exc:  # no credentials, an unreachable endpoint...
        return (f"input {root_url} cannot be listed: {type(exc).__name__}: {exc}. S3 credentials and endpoints "
                "come from the environment or fsspec's configuration (docs: 'Inputs on object storage').")
    return f"input {root_url} holds no objects" if first is None else None


@dataclass(frozen=True)
class ReadPolicy:
    """How reads are bounded and retried (the profile's ``ingest`` section)."""

    max_bytes: int
    attempts: int = 4
    backoff_s: float = 0.5


def open_input(location: str) -> BinaryIO:
    """A local path or a URL opened for reading (fsspec's ``open`` serves both); close it after."""
    return fsspec.open(location, "rb").open()  # type: ignore[no-any-return]


def parent_location(location: str) -> str:
    """The folder (or prefix) holding a local file or an object."""
    return location.rstrip("/").rsplit("/", 1)[0] if is_url(location) else str(Path(location).parent)


def permanent_error(exc: BaseException) -> DecodeError | None:
    """The rejected row for an error no retry can fix, or None for one that may pass (for objects
    and, from a sharded input, local files alike)."""
    if isinstance(exc, FileNotFoundError):
        return DecodeError(Reason.MISSING_FILE, "it does not exist (any more)")
    if isinstance(exc, PermissionError):
        return DecodeError(Reason.ACCESS_DENIED, f"reading it was refused (an object store: HTTP 403): {exc}")
    if isinstance(exc, IsADirectoryError):
        return DecodeError(Reason.NOT_A_REGULAR_FILE, "a folder or prefix, not a file or object")
    return None


def read_objects(urls: list[str], sizes: list[int | None], policy: ReadPolicy,
                 sleep: Callable[[float], None] = time.sleep) -> list[bytes | DecodeError]:
    """The bytes of each URL (or the DecodeError that rejects it), read concurrently per store.

    An object listed larger than ``policy.max_bytes`` is rejected without a read; the others are
    read with one ranged GET of ``max_bytes + 1`` bytes (so one that grew is caught). Failures that
    may pass are retried ``policy.attempts`` times in all, waiting ``backoff_s``, then twice that...
    (at most ``MAX_BACKOFF_S``) between rounds; the last error becomes ``read_error``."""
    out: list[bytes | DecodeError | None] = [None] * len(urls)
    pending: list[int] = []
    for i, size in enumerate(sizes):
        if size is not None and size > policy.max_bytes:
            out[i] = DecodeError(Reason.FILE_TOO_LARGE, f"{size} bytes exceeds limit {policy.max_bytes}")
        else:
            pending.append(i)
    last: dict[int, BaseException] = {}
    for attempt in range(policy.attempts):
        if not pending:
            break
        if attempt:
            sleep(min(policy.backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        retry: list[int] = []
        for fs, group in _by_store([urls[i] for i in pending], pending):
            results = _cat_ranges(fs, [p for p, _ in group], policy.max_bytes + 1)
            for (_, i), result in zip(group, results, strict=True):
                if isinstance(result, BaseException):
                    permanent = permanent_error(result)
                    if permanent is not None:
                        out[i] = permanent
                    else:
                        last[i] = result
                        retry.append(i)
                elif len(result) > policy.max_bytes:
                    out[i] = DecodeError(Reason.FILE_TOO_LARGE, f"over {policy.max_bytes} bytes (larger than listed)")
                else:
                    out[i] = bytes(result)
        pending = retry
    for i in pending:
        exc = last[i]
        out[i] = DecodeError(Reason.READ_ERROR, f"{urls[i]}: {type(exc).__name__}: {exc} "
                                                 f"(after {policy.attempts} attempts)")
    return [r if r is not None else DecodeError(Reason.READ_ERROR, "not read") for r in out]


def _by_store(urls: list[str], indices: list[int]) -> list[tuple[AbstractFileSystem, list[tuple[str, int]]]]:
    """The URLs grouped by filesystem (one per protocol and its options), paths inside each."""
    groups: dict[int, tuple[AbstractFileSystem, list[tuple[str, int]]]] = {}
    for url, i in zip(urls, indices, strict=True):
        fs, path = fsspec.core.url_to_fs(url)
        groups.setdefault(id(fs), (fs, []))[1].append((path, i))
    return list(groups.values())


def _cat_ranges(fs: AbstractFileSystem, paths: list[str], end: int) -> list[bytes | BaseException]:
    """One ranged read per path, concurrent on an async store; each failure returned, not raised."""
    try:
        return list(fs.cat_ranges(paths, [0] * len(paths), [end] * len(paths), on_error="return"))
    except Exception as exc:  # the whole batch failed (the store is unreachable): retry every path
        return [exc] * len(paths)
