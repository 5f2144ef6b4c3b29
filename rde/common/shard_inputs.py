"""Sharded image datasets as inputs: WebDataset tars and Parquet files with an image-bytes column.

- **WebDataset** (``input.kind: webdataset``): a ``.tar`` shard (or ``.tar.gz``, ``.tgz``), or a
  folder or URL prefix of them.
  Members are grouped into samples by the ``webdataset`` library's own reader (``tar_file_iterator``,
  ``group_by_keys``: a sample is the members sharing a key, the name before the first dot). A
  sample's image is its first member with an image extension (``jpg``, ``png``...); its ``json``,
  ``txt`` and ``cls`` members become the row's ``source_meta``. A json's ``domain`` and
  ``identity`` fields, when present, are the row's.
- **Image Parquet** (``input.kind: image_parquet``): a ``.parquet`` file, or a folder or prefix of
  them, as img2dataset writes (``jpg``/``png``/``webp`` bytes with ``key``, ``caption``, ``url``...)
  or Hugging Face ``datasets`` does (an ``image`` struct ``{bytes, path}``). The other scalar
  columns become ``source_meta``.

One input shard is one ingest shard (one task), read as a stream: a tar member or a Parquet batch
at a time. Each sample ends as one image row or one rejected row whose ``detail`` names the shard
and the key (``missing_image`` when it holds no image). The number of samples (the stage's input)
is counted apart from the rows: the runs of member names sharing a key in the tar (a key whose
members are split by another's is two samples, as webdataset reads it), the row count in the
Parquet footer. A shard that becomes unreadable part way (a truncated tar) gives the samples
whose members were read whole before the damage (the last of them with the members it had by
then), and one ``unreadable_shard`` row for the rest: how many samples the rest held cannot be
known. A read that fails for a reason that may pass is retried from the shard's start
(``ingest.read_attempts``).
"""

from __future__ import annotations

import json
import tarfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import pyarrow as pa
import pyarrow.parquet as pq

from rde.common.image_decoding import DecodeError
from rde.common.reasons import Reason
from rde.common.url_inputs import MAX_BACKOFF_S, open_input

IMAGE_SUFFIXES = ("jpg", "jpeg", "png", "webp", "bmp", "ppm", "pgm", "tif", "tiff", "gif")
META_SUFFIXES = ("json", "txt", "cls")
SHARD_SUFFIXES = {"webdataset": (".tar", ".tar.gz", ".tgz"), "image_parquet": (".parquet",)}
# the image-bytes column of an image Parquet, in the order looked for
IMAGE_COLUMNS = ("jpg", "jpeg", "png", "webp", "image", "img", "image_bytes")
BATCH_ROWS = 256  # Parquet rows decoded at a time


@dataclass
class Sample:
    """One sample of an input shard: its key, image bytes (None: it has none) and metadata."""

    key: str
    image: bytes | None
    meta: dict[str, Any]
    members: list[str] = field(default_factory=list)


@dataclass
class ShardRead:
    """What one input shard gave: its samples in order, how many there are (counted apart), and the
    error that stopped the read part way, if one did."""

    samples: list[Sample]
    counted: int
    broken: str | None = None


def _tar_samples(handle: BinaryIO, source: str, keys: list[str]) -> Iterator[Sample]:
    """The webdataset library's grouping of a tar stream into samples. ``keys`` gets each run of
    member names sharing a key as the names stream past (a sample is such a run, for webdataset
    too): the independent count. When the stream breaks, the members read whole before the break
    still form their sample, then the error is raised."""
    # imported here: the webdataset package imports torch (seconds of CPU), which the other inputs'
    # ingest processes never need
    from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_iterator

    failure: list[BaseException] = []

    def members() -> Iterator[dict[str, Any]]:
        try:
            for member in tar_file_iterator(handle):
                key, _ = base_plus_ext(member["fname"])
                if key is not None and (not keys or keys[-1] != key):
                    keys.append(key)
                yield {**member, "__url__": source}
        except Exception as exc:  # ends the stream here: group_by_keys yields the group in progress
            failure.append(exc)

    for grouped in group_by_keys(members()):
        suffixes = [k for k in grouped if not k.startswith("__")]
        image = next((grouped[s] for s in IMAGE_SUFFIXES if s in grouped), None)
        meta: dict[str, Any] = {}
        for suffix in META_SUFFIXES:
            if suffix in grouped:
                text = grouped[suffix].decode("utf-8", errors="replace")
                meta[suffix] = _json_or_text(text) if suffix == "json" else text.strip()
        yield Sample(grouped["__key__"], image, meta, suffixes)
    if failure:
        raise failure[0]


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _image_column(schema: pa.Schema) -> str | None:
    for name in IMAGE_COLUMNS:
        if name not in schema.names:
            continue
        kind = schema.field(name).type
        if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
            return name
        if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
            return name
    return None


def image_parquet_problem(schema: pa.Schema) -> str | None:
    """Why a Parquet schema is no image Parquet (as a message), or None."""
    if _image_column(schema) is None:
        return (f"no image-bytes column: expected one of {list(IMAGE_COLUMNS)} holding bytes or a "
                f"{{bytes, path}} struct (columns: {schema.names})")
    return None


def _parquet_samples(handle: BinaryIO, counted: list[int]) -> Iterator[Sample]:
    table_file = pq.ParquetFile(handle)
    counted.append(table_file.metadata.num_rows)
    column = _image_column(table_file.schema_arrow)
    if column is None:
        raise DecodeError(Reason.UNREADABLE_SHARD, image_parquet_problem(table_file.schema_arrow) or "")
    scalars = [f.name for f in table_file.schema_arrow if f.name != column and not (
        pa.types.is_binary(f.type) or pa.types.is_large_binary(f.type) or pa.types.is_nested(f.type))]
    row = 0
    for batch in table_file.iter_batches(batch_size=BATCH_ROWS, columns=[column, *scalars]):
        for rec in batch.to_pylist():
            value = rec.pop(column)
            image = value.get("bytes") if isinstance(value, dict) else value
            key = rec.get("key") or rec.get("__key__") or f"row{row}"
            meta = {k: v for k, v in rec.items() if v is not None}
            if isinstance(value, dict) and value.get("path"):
                meta["image_path"] = value["path"]
            yield Sample(str(key), image or None, meta, [column])
            row += 1


def read_shard(source: str, kind: str, attempts: int = 1, backoff_s: float = 0.0,
               sleep: Callable[[float], None] = time.sleep) -> ShardRead:
    """Every sample of one input shard (see the module docstring). An error that may pass (a dropped
    connection) restarts the read, up to ``attempts`` times; a damaged shard stops it for good."""
    for attempt in range(attempts):
        if attempt:
            sleep(min(backoff_s * 2 ** (attempt - 1), MAX_BACKOFF_S))
        samples: list[Sample] = []
        keys: list[str] = []
        counted: list[int] = []
        try:
            with open_input(source) as handle:
                if kind == "webdataset":
                    samples.extend(_tar_samples(handle, source, keys))
                else:
                    samples.extend(_parquet_samples(handle, counted))
        except (DecodeError, FileNotFoundError, PermissionError, IsADirectoryError):  # not the bytes: the caller's
            raise
        except (tarfile.TarError, pa.ArrowInvalid, ValueError, EOFError) as exc:  # the bytes are damaged
            return ShardRead(samples, len(samples) + 1, f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            if attempt + 1 == attempts:
                return ShardRead(samples, len(samples) + 1, f"{type(exc).__name__}: {exc} (after {attempts} attempts)")
            continue
        # counted from the shard's own structure, not from the samples: tar member names, Parquet footer
        return ShardRead(samples, len(keys) if kind == "webdataset" else counted[0])
    raise AssertionError("unreachable")  # pragma: no cover
