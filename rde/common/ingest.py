"""Ingest: list inputs, then turn each shard of inputs into image rows or rejected rows.

Inputs are the bundled demo pool (an artifact), a folder (every entry that is not a folder,
recursively: files, links, FIFOs, sockets, devices) or a Parquet file with a ``path`` column
(optional ``domain`` and ``identity``). Each input gets a stable ``input_id``; each one ends as
exactly one images row or one rejects row.

Confinement (secure by default): a file is read only when its real path (after every symbolic
link and ``..``) lies inside the input's root — the folder itself, or for a path list the
profile's ``input.roots`` or, when none are set, the list file's own folder. ``input.confine:
false`` turns this off explicitly. A path outside is the rejected row ``outside_root``.

A path-list row that cannot name a local file is rejected without touching the filesystem: one
holding a NUL byte (``invalid_path``: no OS path can contain one) and a URL such as ``s3://...`` or
``file://...`` (``unsupported_url``: a path list names local files only). The other rows go on.
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rde.common.image_decoding import DecodeError, decode_rgb, read_header
from rde.common.profiles import IngestSpec, InputSpec
from rde.common.reasons import Reason, rejected_row
from storage import Artifact
from storage.hashing import sha256_bytes, sha256_json
from storage.schemas import IMAGES, REJECTS


class InputError(ValueError):
    """The input as a whole is unusable (missing folder, Parquet without ``path``...)."""


@dataclass(frozen=True)
class InputRef:
    """One input: where its bytes are and what we know about it before reading them."""

    input_id: str
    source: str
    domain: str
    identity: str | None = None
    pool_shard: int | None = None  # set for demo-pool inputs
    pool_row: int | None = None
    source_meta: str | None = None
    # set when the listing already knows the input is unusable (a path list's bad row): ingest
    # rejects it with this reason and detail without reading anything
    reject_reason: Reason | None = None
    reject_detail: str | None = None


# a URL's scheme, as RFC 3986 spells it, followed by '://' (a local path never holds '://')
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def _input_id(source: str, position: int) -> str:
    return sha256_json([source, position])[:16]


def list_inputs(spec: InputSpec, project_root: Path, known_domains: list[str]) -> tuple[list[InputRef], str]:
    """All inputs in a deterministic order, plus a fingerprint of the listing (for stage keys)."""
    check_input(spec, project_root)
    path = _input_location(spec, project_root)
    if spec.kind == "pool":
        return list_pool(str(path))
    if spec.kind == "folder":
        return _list_folder(path, spec.default_domain, known_domains)
    return _list_paths_file(path, spec, project_root)


def _input_location(spec: InputSpec, project_root: Path) -> Path:
    path = Path(spec.path)
    return path if path.is_absolute() or "://" in spec.path else project_root / path


def check_input(spec: InputSpec, project_root: Path) -> None:
    """Fail fast, with a user message, when the input as a whole is unusable (before any run starts)."""
    path = _input_location(spec, project_root)
    location = spec.path if "://" in spec.path else str(path)
    if spec.kind == "folder" and not path.is_dir():
        raise InputError(f"input folder {path} does not exist or is not a folder")
    if spec.kind == "video" and not path.is_dir() and path.suffix != ".parquet":
        raise InputError(f"video input {path} is neither a folder of videos nor a Parquet path list (.parquet)")
    if spec.kind == "paths" or (spec.kind == "video" and not path.is_dir()):
        if not path.is_file():
            raise InputError(f"input Parquet file {path} does not exist")
        try:
            names = pq.read_schema(path).names
        except (pa.ArrowInvalid, OSError) as exc:
            raise InputError(f"input {path} is not a readable Parquet file: {exc}") from None
        if "path" not in names:
            raise InputError(f"input {path} has no 'path' column (columns: {names})")
    if spec.kind == "pool" and not Artifact(location).is_complete():
        raise InputError(f"input pool {location} is not a complete artifact (no _manifest.json or missing shards)")


def list_pool(url: str) -> tuple[list[InputRef], str]:
    pool = Artifact(url)
    manifest = pool.manifest()
    refs: list[InputRef] = []
    for shard_index, table in pool.iter_shards(["pool_id", "domain", "identity", "source_meta"]):
        for row, rec in enumerate(table.to_pylist()):
            source = f"pool:{rec['pool_id']}"
            refs.append(InputRef(_input_id(source, len(refs)), source, rec["domain"], rec["identity"],
                                 shard_index, row, rec["source_meta"]))
    return refs, manifest.fingerprint


def _file_signature(path: Path) -> list[Any]:
    """Path, size and mtime of what the input reads: a link's target (an edited or re-pointed target
    changes the listing key), the link itself when it dangles. ``stat`` never opens, so a FIFO is safe."""
    for probe in (path.stat, path.lstat):
        try:
            st = probe()
            return [str(path), st.st_size, st.st_mtime_ns]
        except OSError:
            continue
    return [str(path), None, None]


def _walk_entries(folder: Path) -> list[Path]:
    """Every entry under ``folder`` that is not a real folder, sorted; links are listed, not followed,
    so a link to a folder is one input (rejected later) and a link loop cannot hang the listing."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(folder, followlinks=False):
        base = Path(dirpath)
        found.extend(base / name for name in filenames)
        found.extend(base / name for name in dirnames if (base / name).is_symlink())
    return sorted(found)


def _list_folder(folder: Path, default_domain: str, known_domains: list[str]) -> tuple[list[InputRef], str]:
    files = _walk_entries(folder)
    refs = []
    for path in files:
        first = path.relative_to(folder).parts[0]
        domain = first if first in known_domains and len(path.relative_to(folder).parts) > 1 else default_domain
        refs.append(InputRef(_input_id(str(path), len(refs)), str(path), domain))
    return refs, sha256_json([_file_signature(p) for p in files])


def path_problem(raw: str) -> tuple[Reason, str] | None:
    """Why a path-list row cannot name a local file (reason, detail), or None when it may.

    Checked before any ``stat``: a NUL byte makes every OS call raise ``ValueError``, and a URL
    joined to the list's folder would become a mangled local path reported as ``missing_file``.
    """
    if "\x00" in raw:
        return Reason.INVALID_PATH, f"{raw!r} holds a NUL byte, which no file path can contain"
    url = _URL_SCHEME.match(raw)
    if url:
        return Reason.UNSUPPORTED_URL, (f"{raw} is a {url.group(1)}:// URL; a path list names local files "
                                        "(absolute, or relative to the list's folder)")
    return None


def _printable(raw: str) -> str:
    """``raw`` with NUL bytes written as ``\\x00``: the rejected row's source stays plain text."""
    return raw.replace("\x00", "\\x00")


def _list_paths_file(table_path: Path, spec: InputSpec, project_root: Path) -> tuple[list[InputRef], str]:
    table = pq.read_table(table_path)  # check_input has made sure it is readable and has 'path'
    refs, signature = [], []
    for rec in table.to_pylist():
        raw = rec.get("path")
        raw = "" if raw is None else str(raw)
        domain = str(rec.get("domain") or spec.default_domain)
        input_id = _input_id(raw, len(refs))
        problem = path_problem(raw)
        if problem is not None:  # rejected as listed: never joined to the folder, never stat'ed
            source = _printable(raw)
            refs.append(InputRef(input_id, source, domain, rec.get("identity"), reject_reason=problem[0],
                                 reject_detail=problem[1]))
            signature.append([source, str(problem[0])])
            continue
        path = Path(raw)
        if raw and not path.is_absolute():
            path = table_path.parent / path
        refs.append(InputRef(input_id, str(path) if raw else "", domain, rec.get("identity")))
        signature.append(_file_signature(path))
    return refs, sha256_json(signature)


def shard_refs(refs: list[InputRef], shard_size: int) -> list[list[InputRef]]:
    """Consecutive chunks of at most ``shard_size`` inputs (at least one shard, maybe empty)."""
    return [refs[i : i + shard_size] for i in range(0, len(refs), shard_size)] or [[]]


def allowed_roots(spec: InputSpec, project_root: Path) -> list[str] | None:
    """The real folders a file input may resolve into, or None when ``input.confine`` is off.

    A folder input is confined to itself; a path list to ``input.roots`` or, when none are set,
    to the list file's own folder; a pool reads no files (no roots).
    """
    if not spec.confine:
        return None
    if spec.kind in ("pool", "video"):  # a video input's images are the videos stage's crops (an artifact)
        return []
    if spec.kind == "folder":
        return [os.path.realpath(_input_location(spec, project_root))]
    if spec.roots:
        return [os.path.realpath(_input_location(spec.model_copy(update={"path": r}), project_root))
                for r in spec.roots]
    return [os.path.realpath(_input_location(spec, project_root).parent)]


def _inside(real: str, roots: list[str]) -> bool:
    return any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in roots)


def confined_file(ref: InputRef, roots: list[str] | None) -> str:
    """The real path of a listed input that is a regular file inside the allowed roots (checked with
    ``stat`` on the real path, after every link; ``roots`` None: anywhere), else a DecodeError with
    the reason: outside_root (whether a path outside exists is not told), missing_file,
    not_a_regular_file."""
    if not ref.source:
        raise DecodeError(Reason.MISSING_FILE, "empty path")
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


def _read_file(ref: InputRef, spec: IngestSpec, roots: list[str] | None) -> bytes:
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


def reject_row(ref: InputRef, stage: str, reasons: list[str], detail: str | None,
               image_id: str | None = None, kind: str = "image", **measured: Any) -> dict[str, Any]:
    """A row of the common rejects schema for an input that did not become an image (or a video)."""
    return rejected_row(ref.input_id, stage, reasons[0], kind=kind, domain=ref.domain, source=ref.source,
                        image_id=image_id, detail=detail, all_reasons=reasons, **measured)


def ingest_shard(refs: list[InputRef], spec: IngestSpec, known_domains: list[str],
                 pool_url: str | None = None, *, roots: list[str] | None) -> tuple[pa.Table, pa.Table]:
    """Read, verify and describe one shard of inputs → (images table, rejects table).

    ``roots`` are real folder paths a file may resolve into (``allowed_roots``); None reads any
    path and must be asked for explicitly. Each input is decoded fully once so truncated files
    are caught here, not downstream; the stored size is the displayed one (EXIF orientation
    applied), with the orientation tag kept in ``exif_orientation``.
    """
    pool_tables: dict[int, pa.Table] = {}
    images, rejects = [], []
    for ref in refs:
        try:
            if ref.reject_reason is not None:
                raise DecodeError(ref.reject_reason, ref.reject_detail or str(ref.reject_reason))
            if ref.domain not in known_domains:
                raise DecodeError(Reason.UNKNOWN_DOMAIN, f"domain {ref.domain!r} is not one of {known_domains}")
            if ref.pool_shard is not None:
                if ref.pool_shard not in pool_tables:
                    pool_tables[ref.pool_shard] = Artifact(pool_url or "").read_shard(ref.pool_shard, ["image_bytes"])
                data = pool_tables[ref.pool_shard].column("image_bytes")[ref.pool_row].as_py()
            else:
                data = _read_file(ref, spec, roots)
            header = read_header(data, spec.max_pixels)
            decode_rgb(data, spec.max_pixels)
        except DecodeError as err:
            rejects.append(reject_row(ref, "ingest", [str(err.reason)], err.detail))
            continue
        except Exception as exc:
            rejects.append(reject_row(ref, "ingest", [str(Reason.READ_ERROR)], f"{type(exc).__name__}: {exc}"))
            continue
        images.append({"input_id": ref.input_id, "image_id": sha256_bytes(data), "source": ref.source,
                       "domain": ref.domain, "identity": ref.identity, "width": header.width,
                       "height": header.height, "source_mode": header.mode, "image_format": header.format,
                       "exif_orientation": header.orientation,
                       "source_meta": ref.source_meta, "image_bytes": data})
    return pa.Table.from_pylist(images, schema=IMAGES), pa.Table.from_pylist(rejects, schema=REJECTS)


def describe_listing(refs: list[InputRef]) -> str:
    """Short JSON summary (counts per domain) for logs."""
    counts: dict[str, int] = {}
    for ref in refs:
        counts[ref.domain] = counts.get(ref.domain, 0) + 1
    return json.dumps(counts, sort_keys=True)
