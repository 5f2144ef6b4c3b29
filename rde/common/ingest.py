"""Ingest: turn each shard of listed inputs into image rows or rejected rows.

Each input ends as exactly one images row or one rejects row (an input shard, a WebDataset tar or
an image Parquet: one per sample). Each input is decoded fully once, so truncated files are caught
here, not downstream. What the inputs are comes from ``rde.common.input_listing`` (``list_inputs``,
``shard_refs``); where they may be read from, and how a local file is read, from
``rde.common.input_confinement``. This module holds the reading and the rows.
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa

from rde.common import shard_inputs, url_inputs
from rde.common.image_decoding import DecodeError, decode_rgb, read_header
from rde.common.input_confinement import confined_file, read_local_file
from rde.common.input_listing import InputRef, listed_input_id
from rde.common.pool_config import IngestSpec
from rde.common.reasons import Reason, rejected_row
from rde.common.url_inputs import ReadPolicy, is_url
from storage import Artifact
from storage.hashing import sha256_bytes
from storage.schemas import IMAGES, REJECTS


def reject_row(ref: InputRef, stage: str, reasons: list[str], detail: str | None,
               image_id: str | None = None, kind: str = "image", **measured: Any) -> dict[str, Any]:
    """A row of the common rejects schema for an input that did not become an image (or a video)."""
    return rejected_row(ref.input_id, stage, reasons[0], kind=kind, domain=ref.domain, source=ref.source,
                        image_id=image_id, detail=detail, all_reasons=reasons, **measured)


def ingest_shard(refs: list[InputRef], spec: IngestSpec, known_domains: list[str],
                 pool_url: str | None = None, *, roots: list[str] | None) -> tuple[pa.Table, pa.Table]:
    """Read, verify and describe one shard of inputs → (images table, rejects table).

    ``roots`` are real folder paths and URL prefixes an input may resolve into (``allowed_roots``);
    None reads anything and must be asked for explicitly. The shard's URLs are read first, together
    (concurrent ranged GETs, retried: ``url_inputs.read_objects``). Each input is decoded fully once
    so truncated files are caught here, not downstream; the stored size is the displayed one (EXIF
    orientation applied), with the orientation tag kept in ``exif_orientation``.
    """
    pool_tables: dict[int, pa.Table] = {}
    fetched = _read_urls(refs, spec, roots, known_domains)
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
            elif ref.input_id in fetched:
                got = fetched[ref.input_id]
                if isinstance(got, DecodeError):
                    raise got
                data = got
            else:
                data = read_local_file(ref, spec, roots)
            images.append(_image_row(ref.input_id, ref.source, ref.domain, ref.identity, ref.source_meta, data, spec))
        except DecodeError as err:
            rejects.append(reject_row(ref, "ingest", [str(err.reason)], err.detail))
        except Exception as exc:
            rejects.append(reject_row(ref, "ingest", [str(Reason.READ_ERROR)], f"{type(exc).__name__}: {exc}"))
    return pa.Table.from_pylist(images, schema=IMAGES), pa.Table.from_pylist(rejects, schema=REJECTS)


def _image_row(input_id: str, source: str, domain: str, identity: str | None, source_meta: str | None,
               data: bytes, spec: IngestSpec) -> dict[str, Any]:
    """The images row of verified bytes (header read, fully decoded once), or a DecodeError."""
    if len(data) > spec.max_file_bytes:
        raise DecodeError(Reason.FILE_TOO_LARGE, f"{len(data)} bytes exceeds limit {spec.max_file_bytes}")
    header = read_header(data, spec.max_pixels)
    decode_rgb(data, spec.max_pixels)
    return {"input_id": input_id, "image_id": sha256_bytes(data), "source": source, "domain": domain,
            "identity": identity, "width": header.width, "height": header.height, "source_mode": header.mode,
            "image_format": header.format, "exif_orientation": header.orientation, "source_meta": source_meta,
            "image_bytes": data}


def _read_urls(refs: list[InputRef], spec: IngestSpec, roots: list[str] | None,
               known_domains: list[str]) -> dict[str, bytes | DecodeError]:
    """The bytes (or the rejecting error) of the shard's URL inputs that pass the listing's checks
    and confinement, read together; an input outside the roots is never requested."""
    wanted: list[InputRef] = []
    out: dict[str, bytes | DecodeError] = {}
    for ref in refs:
        if ref.reject_reason is not None or not is_url(ref.source) or ref.domain not in known_domains:
            continue
        try:
            confined_file(ref, roots)
        except DecodeError as err:
            out[ref.input_id] = err
            continue
        wanted.append(ref)
    if wanted:
        policy = ReadPolicy(spec.max_file_bytes, spec.read_attempts, spec.retry_backoff_s)
        results = url_inputs.read_objects([r.source for r in wanted], [r.size for r in wanted], policy)
        out.update({r.input_id: got for r, got in zip(wanted, results, strict=True)})
    return out


def ingest_container(ref: InputRef, spec: IngestSpec, known_domains: list[str], *,
                     roots: list[str] | None) -> tuple[pa.Table, pa.Table, int]:
    """One input shard (a WebDataset tar, an image Parquet) → (images, rejects, samples counted from
    the shard's own structure). Each sample's source is ``<shard>#<key>``; a rejected sample's
    detail names the shard and key."""
    images, rejects = [], []
    try:
        if ref.reject_reason is not None:
            raise DecodeError(ref.reject_reason, ref.reject_detail or str(ref.reject_reason))
        confined_file(ref, roots)
        read = shard_inputs.read_shard(ref.source, ref.container or "webdataset", spec.read_attempts,
                                       spec.retry_backoff_s)
    except Exception as exc:  # the shard as a whole: one rejected row
        err = exc if isinstance(exc, DecodeError) else url_inputs.permanent_error(exc) or \
            DecodeError(Reason.READ_ERROR, f"{type(exc).__name__}: {exc}")
        row = reject_row(ref, "ingest", [str(err.reason)], f"{ref.source}: {err.detail}", kind="shard")
        return IMAGES.empty_table(), _rejects([row]), 1
    for position, sample in enumerate(read.samples):
        source = f"{ref.source}#{sample.key}"
        sample_ref = InputRef(listed_input_id(source, position), source, _sample_field(sample, "domain") or ref.domain,
                              _sample_field(sample, "identity"))
        where = f"shard {ref.source}, key {sample.key}"
        try:
            if sample_ref.domain not in known_domains:
                raise DecodeError(Reason.UNKNOWN_DOMAIN, f"{where}: domain {sample_ref.domain!r} is not one of "
                                                         f"{known_domains}")
            if sample.image is None:
                raise DecodeError(Reason.MISSING_IMAGE, f"{where}: no image member or column (has {sample.members})")
            meta = json.dumps({"shard": ref.source, "key": sample.key, **sample.meta}, sort_keys=True, default=str)
            images.append(_image_row(sample_ref.input_id, source, sample_ref.domain, sample_ref.identity, meta,
                                     sample.image, spec))
        except DecodeError as err:
            detail = err.detail if err.detail.startswith(where) else f"{where}: {err.detail}"
            rejects.append(reject_row(sample_ref, "ingest", [str(err.reason)], detail))
        except Exception as exc:
            rejects.append(reject_row(sample_ref, "ingest", [str(Reason.READ_ERROR)],
                                      f"{where}: {type(exc).__name__}: {exc}"))
    if read.broken is not None:
        rest = InputRef(listed_input_id(f"{ref.source}#rest", len(read.samples)), f"{ref.source}#rest", ref.domain)
        rejects.append(reject_row(rest, "ingest", [str(Reason.UNREADABLE_SHARD)],
                                  f"shard {ref.source} unreadable after {len(read.samples)} samples: {read.broken}",
                                  kind="shard"))
    return pa.Table.from_pylist(images, schema=IMAGES), _rejects(rejects), read.counted


def _sample_field(sample: shard_inputs.Sample, name: str) -> str | None:
    """A sample's own ``domain`` or ``identity``: its json member's field, or its Parquet column."""
    value = sample.meta.get("json", {}).get(name) if isinstance(sample.meta.get("json"), dict) else None
    value = sample.meta.get(name) if value is None else value
    return None if value is None else str(value)


def _rejects(rows: list[dict[str, Any]]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=REJECTS)
