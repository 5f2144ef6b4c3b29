"""Listing inputs: what the profile's ``input`` names, as ``InputRef``s in a deterministic order.

Inputs are the bundled demo pool (an artifact), a folder (every entry that is not a folder,
recursively: files, links, FIFOs, sockets, devices), a Parquet file with a ``path`` column
(optional ``domain`` and ``identity``), or sharded image datasets (WebDataset tars, image-bytes
Parquet: ``rde.common.shard_inputs``). A folder, a path list, a path-list row and a shard may be an
fsspec URL (``s3://bucket/prefix/``: ``rde.common.url_inputs``). Each input gets a stable
``input_id``; each one ends as exactly one images row or one rejects row (a shard: one per sample).

A path-list row that cannot name an input is rejected without touching any store: one holding a
NUL byte (``invalid_path``: no OS path can contain one), and a URL whose protocol no installed
fsspec store reads, a ``file://`` URL, or any URL in a video list (``unsupported_url``). The other
rows go on.

Split from ``rde.common.ingest`` (which reads what is listed here) so that what an input is, and its
listing's fingerprint for the stage keys, are read apart from reading bytes; where a listed input
may be read from is ``rde.common.input_confinement``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from rde.common import shard_inputs, url_inputs
from rde.common.pool_config import InputSpec
from rde.common.reasons import Reason
from rde.common.url_inputs import is_url
from storage import Artifact
from storage.hashing import sha256_json


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
    size: int | None = None  # bytes, where the listing tells (an object store's listing does)
    container: str | None = None  # 'webdataset' or 'image_parquet': the input is a shard of samples


# a URL's scheme, as RFC 3986 spells it, followed by '://' (a local path never holds '://')
_URL_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def listed_input_id(source: str, position: int) -> str:
    return sha256_json([source, position])[:16]


def list_inputs(spec: InputSpec, project_root: Path, known_domains: list[str],
                allow_urls: bool = True) -> tuple[list[InputRef], str]:
    """All inputs in a deterministic order, plus a fingerprint of the listing (for stage keys).
    ``allow_urls`` False (video lists) rejects a path list's URL rows as ``unsupported_url``."""
    check_input(spec, project_root)
    if spec.default_domain is None and known_domains:  # a spec outside a profile: the first domain
        spec = spec.model_copy(update={"default_domain": known_domains[0]})
    location = input_location(spec, project_root)
    if spec.kind == "pool":
        return list_pool(location)
    if spec.kind in shard_inputs.SHARD_SUFFIXES:
        return _list_shards(location, spec)
    if spec.kind == "folder":
        if is_url(location):
            return _list_url_folder(location, spec.default_domain, known_domains)
        return _list_folder(Path(location), spec.default_domain, known_domains)
    return _list_paths_file(location, spec, allow_urls)


def input_location(spec: InputSpec, project_root: Path) -> str:
    """``input.path`` as a URL, or as an absolute local path (relative ones: to the project root)."""
    if is_url(spec.path):
        return spec.path
    path = Path(spec.path)
    return str(path if path.is_absolute() else project_root / path)


def check_input(spec: InputSpec, project_root: Path) -> None:
    """Fail fast, with a user message, when the input as a whole is unusable (before any run starts)."""
    location = input_location(spec, project_root)
    if is_url(location):
        _check_url_input(spec, location)
        return
    path = Path(location)
    if spec.kind == "folder" and not path.is_dir():
        raise InputError(f"input folder {path} does not exist or is not a folder")
    if spec.kind == "video" and not path.is_dir() and path.suffix != ".parquet":
        raise InputError(f"video input {path} is neither a folder of videos nor a Parquet path list (.parquet)")
    if spec.kind in shard_inputs.SHARD_SUFFIXES and not path.exists():
        raise InputError(f"{spec.kind} input {path} does not exist")
    if spec.kind == "paths" or (spec.kind == "video" and not path.is_dir()):
        if not path.is_file():
            raise InputError(f"input Parquet file {path} does not exist")
        _check_path_list_schema(location)
    if spec.kind == "pool" and not Artifact(location).is_complete():
        raise InputError(f"input pool {location} is not a complete artifact (no _manifest.json or missing shards)")


def _check_url_input(spec: InputSpec, url: str) -> None:
    if spec.kind == "video":
        raise InputError(f"video input {url}: videos are read from local files (copy the recordings to a folder)")
    if spec.kind == "pool" and not Artifact(url).is_complete():
        raise InputError(f"input pool {url} is not a complete artifact (no _manifest.json or missing shards)")
    if spec.kind == "paths":
        _check_path_list_schema(url)
    if spec.kind == "folder" or (spec.kind in shard_inputs.SHARD_SUFFIXES and not names_shard(url, spec.kind)):
        problem = url_inputs.url_folder_problem(url)
        if problem:
            raise InputError(problem)


def _check_path_list_schema(location: str) -> None:
    try:
        names = _read_schema(location).names
    except FileNotFoundError:
        raise InputError(f"input Parquet file {location} does not exist") from None
    except (pa.ArrowInvalid, OSError) as exc:
        raise InputError(f"input {location} is not a readable Parquet file: {exc}") from None
    if "path" not in names:
        raise InputError(f"input {location} has no 'path' column (columns: {names})")


def _read_schema(location: str) -> pa.Schema:
    with url_inputs.open_input(location) as handle:
        return pq.read_schema(handle)


def parquet_input_kind(location: str) -> str:
    """``paths`` for a Parquet with a ``path`` column (or one that cannot be read: check_input says
    why), ``image_parquet`` for one with an image-bytes column and no ``path``."""
    try:
        schema = _read_schema(location)
    except (pa.ArrowInvalid, OSError):
        return "paths"
    if "path" not in schema.names and shard_inputs.image_parquet_problem(schema) is None:
        return "image_parquet"
    return "paths"


def names_shard(location: str, kind: str) -> bool:
    """Whether the input path names one shard file (else a folder or prefix of shards)."""
    return location.rstrip("/").lower().endswith(shard_inputs.SHARD_SUFFIXES[kind])


def list_pool(url: str) -> tuple[list[InputRef], str]:
    pool = Artifact(url)
    manifest = pool.manifest()
    refs: list[InputRef] = []
    for shard_index, table in pool.iter_shards(["pool_id", "domain", "identity", "source_meta"]):
        for row, rec in enumerate(table.to_pylist()):
            source = f"pool:{rec['pool_id']}"
            refs.append(InputRef(listed_input_id(source, len(refs)), source, rec["domain"], rec["identity"],
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


def _folder_domain(parts: tuple[str, ...] | list[str], default_domain: str, known_domains: list[str]) -> str:
    """A first subfolder named after a domain gives its files that domain."""
    return parts[0] if len(parts) > 1 and parts[0] in known_domains else default_domain


def _list_folder(folder: Path, default_domain: str, known_domains: list[str]) -> tuple[list[InputRef], str]:
    files = _walk_entries(folder)
    refs = []
    for path in files:
        domain = _folder_domain(path.relative_to(folder).parts, default_domain, known_domains)
        refs.append(InputRef(listed_input_id(str(path), len(refs)), str(path), domain))
    return refs, sha256_json([_file_signature(p) for p in files])


def _list_url_folder(root_url: str, default_domain: str, known_domains: list[str]) -> tuple[list[InputRef], str]:
    """Every object under the prefix, listed page by page; the fingerprint hashes (URL, size, ETag)."""
    prefix = url_inputs.parse_url(root_url.rstrip("/") + "/x").key[:-1]  # the key prefix, ending in '/'
    refs: list[InputRef] = []
    fingerprint = url_inputs.ListingFingerprint()
    for obj in url_inputs.iter_objects(root_url):
        parts = url_inputs.parse_url(obj.url).key[len(prefix):].split("/")
        refs.append(InputRef(listed_input_id(obj.url, len(refs)), obj.url,
                             _folder_domain(parts, default_domain, known_domains), size=obj.size))
        fingerprint.add(obj.url, obj.size, obj.version)
    return refs, fingerprint.hexdigest()


def _list_shards(location: str, spec: InputSpec) -> tuple[list[InputRef], str]:
    """The shard files of a sharded input: the one named, or every one under the folder or prefix
    (sorted); one ref per shard, its samples read at ingest."""
    suffixes = shard_inputs.SHARD_SUFFIXES[spec.kind]
    fingerprint = url_inputs.ListingFingerprint()
    found: list[tuple[str, int | None]] = []
    if is_url(location):
        if names_shard(location, spec.kind):
            import fsspec

            fs, path = fsspec.core.url_to_fs(location)
            try:
                info = fs.info(path)
            except FileNotFoundError:
                raise InputError(f"{spec.kind} input {location} does not exist") from None
            found.append((location, int(info.get("size") or 0)))
            fingerprint.add(location, info.get("size"), info.get("ETag") or info.get("mtime"))
        else:
            for obj in url_inputs.iter_objects(location, suffixes):
                found.append((obj.url, obj.size))
                fingerprint.add(obj.url, obj.size, obj.version)
    else:
        root = Path(location)
        files = [root] if root.is_file() else [p for p in _walk_entries(root) if p.name.lower().endswith(suffixes)]
        for path in files:
            found.append((str(path), None))
            fingerprint.add(*_file_signature(path))
    if not found:
        raise InputError(f"{spec.kind} input {location} holds no {' or '.join(suffixes)} files")
    refs = [InputRef(listed_input_id(source, i), source, spec.default_domain, size=size, container=spec.kind)
            for i, (source, size) in enumerate(found)]
    return refs, fingerprint.hexdigest()


def path_problem(raw: str, allow_urls: bool = True) -> tuple[Reason, str] | None:
    """Why a path-list row cannot name an input (reason, detail), or None when it may.

    Checked before any ``stat``: a NUL byte makes every OS call raise ``ValueError``, and a URL
    joined to the list's folder would become a mangled local path reported as ``missing_file``.
    A URL is fine when ``allow_urls`` and an installed fsspec store reads its protocol (not ``file``).
    """
    if "\x00" in raw:
        return Reason.INVALID_PATH, f"{raw!r} holds a NUL byte, which no file path can contain"
    url = _URL_SCHEME.match(raw)
    if url and not (allow_urls and url_inputs.protocol_known(raw)):
        why = ("video lists name local files" if not allow_urls else
               "file:// is not read: name local files by their path" if url.group(1).lower() == "file" else
               "no installed fsspec store reads that protocol")
        return Reason.UNSUPPORTED_URL, f"{raw} is a {url.group(1)}:// URL: {why}"
    return None


def _printable(raw: str) -> str:
    """``raw`` with NUL bytes written as ``\\x00``: the rejected row's source stays plain text."""
    return raw.replace("\x00", "\\x00")


def _list_paths_file(location: str, spec: InputSpec, allow_urls: bool = True) -> tuple[list[InputRef], str]:
    """A path list's rows: local paths (relative ones to the list's folder) and, when allowed, URLs
    (relative rows of a list on a store: to the list's prefix)."""
    refs, signature = [], []
    base = url_inputs.parent_location(location)
    for rec in _path_rows(location):
        raw = rec.get("path")
        raw = "" if raw is None else str(raw)
        domain = str(rec.get("domain") or spec.default_domain)
        input_id = listed_input_id(raw, len(refs))
        problem = path_problem(raw, allow_urls)
        if problem is not None:  # rejected as listed: never joined to the folder, never stat'ed
            source = _printable(raw)
            refs.append(InputRef(input_id, source, domain, rec.get("identity"), reject_reason=problem[0],
                                 reject_detail=problem[1]))
            signature.append([source, str(problem[0])])
            continue
        if raw and (is_url(raw) or is_url(base)):
            url = raw if is_url(raw) else f"{base}/{raw.lstrip('/')}"
            refs.append(InputRef(input_id, url, domain, rec.get("identity")))
            signature.append([url])  # no request per row: an object replaced under its name is not noticed
            continue
        path = Path(raw)
        if raw and not path.is_absolute():
            path = Path(base) / path
        refs.append(InputRef(input_id, str(path) if raw else "", domain, rec.get("identity")))
        signature.append(_file_signature(path))
    return refs, sha256_json(signature)


def _path_rows(location: str) -> list[dict[str, Any]]:
    """The list's ``path`` column and, where present, ``domain`` and ``identity`` (check_input has
    made sure it is readable and has ``path``): one open, one footer read."""
    with url_inputs.open_input(location) as handle:
        table = pq.ParquetFile(handle)
        names = table.schema_arrow.names
        return table.read(columns=[c for c in ("path", "domain", "identity") if c in names]).to_pylist()


def shard_refs(refs: list[InputRef], shard_size: int) -> list[list[InputRef]]:
    """Consecutive chunks of at most ``shard_size`` inputs (at least one shard, maybe empty); an
    input shard (a tar, an image Parquet) is a chunk of its own: one ingest shard per input shard."""
    if refs and refs[0].container is not None:
        return [[ref] for ref in refs]
    return [refs[i : i + shard_size] for i in range(0, len(refs), shard_size)] or [[]]


def describe_listing(refs: list[InputRef]) -> str:
    """Short JSON summary (counts per domain) for logs."""
    counts: dict[str, int] = {}
    for ref in refs:
        counts[ref.domain] = counts.get(ref.domain, 0) + 1
    return json.dumps(counts, sort_keys=True)
