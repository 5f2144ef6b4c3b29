"""Sharded Parquet artifacts with a manifest.

An artifact is a folder (local path or fsspec URL) holding ``part-NNNNN.parquet`` shards and
``_manifest.json``. The manifest records the schema, rows and SHA-256 of every shard, the stage
key (a hash of everything that determines the content), the config, model ids, prompt versions,
code version and the manifests of upstream artifacts (lineage).

Invariants:

* Every shard is written to a temporary name and renamed into place, so a killed writer never
  leaves a readable partial shard. Temporary files are ignored by readers and removed on the
  next run.
* Each shard carries its stage key in the Parquet footer, so a resumed run reuses the shards
  that an interrupted run of the *same* inputs already wrote, and rewrites the others.
* The manifest is written last; an artifact without a manifest (or with one whose shards are
  missing or resized) is incomplete and its stage runs again.
"""

from __future__ import annotations

import datetime as _dt
import json
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from storage.filesystem import atomic_write_bytes, join, resolve
from storage.hashing import sha256_bytes, sha256_json

MANIFEST_NAME = "_manifest.json"
SHARD_PATTERN = re.compile(r"^part-(\d{5})\.parquet$")
KEY_FIELD = b"rde.stage_key"
SHARD_FIELD = b"rde.shard"
STATS_FIELD = b"rde.stats"  # the stage's own counts for this shard (JSON), read back on resume
# Rows per Parquet row group of a table that holds image bytes: a reader that needs a few images of
# a shard (a caption task's hard negatives) reads the row groups holding them, not the whole shard.
IMAGE_ROW_GROUP = 64
IMAGE_COLUMN = "image_bytes"
FORMAT_VERSION = 1


class ArtifactError(RuntimeError):
    """An artifact is missing, incomplete or inconsistent; the message names the path."""


def content_key(**parts: Any) -> str:
    """Stage key: SHA-256 over the canonical JSON of everything that determines an output."""
    return sha256_json(parts)


def shard_name(index: int) -> str:
    """File name of shard ``index`` (zero-padded so names sort in shard order)."""
    return f"part-{index:05d}.parquet"


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records per shard."""

    index: int
    file: str
    rows: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    """The JSON document that completes an artifact."""

    kind: str
    stage_key: str
    schema: str
    shards: list[ShardInfo]
    total_rows: int
    fingerprint: str
    created_at: str
    code_version: str
    config: dict[str, Any] = field(default_factory=dict)
    models: dict[str, Any] = field(default_factory=dict)
    prompt_versions: dict[str, str] = field(default_factory=dict)
    upstream: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    def to_json(self) -> str:
        data = asdict(self)
        return json.dumps(data, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> Manifest:
        data = json.loads(text)
        data["shards"] = [ShardInfo(**s) for s in data["shards"]]
        return cls(**data)

    def lineage_entry(self, path: str) -> dict[str, Any]:
        """Summary of this manifest as recorded in a downstream manifest (recursive lineage)."""
        return {
            "path": path,
            "kind": self.kind,
            "stage_key": self.stage_key,
            "fingerprint": self.fingerprint,
            "total_rows": self.total_rows,
            "code_version": self.code_version,
            "models": self.models,
            "prompt_versions": self.prompt_versions,
            "upstream": self.upstream,
        }


def serialize_table(table: pa.Table, stage_key: str, index: int, stats: dict[str, Any] | None = None) -> bytes:
    """Parquet bytes of ``table`` with the stage key, shard index and (optionally) the stage's
    stats for this shard in the footer."""
    meta = dict(table.schema.metadata or {})
    meta[KEY_FIELD] = stage_key.encode()
    meta[SHARD_FIELD] = str(index).encode()
    meta.pop(STATS_FIELD, None)  # a table read from another shard must not carry that shard's stats
    if stats is not None:
        meta[STATS_FIELD] = json.dumps(stats, sort_keys=True, default=str).encode()
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    if table.num_rows:
        rows_per_group = IMAGE_ROW_GROUP if IMAGE_COLUMN in table.column_names else None
        pq.write_table(table, sink, compression="zstd", row_group_size=rows_per_group)
    else:  # no row group at all: `datasets` fails on a 0-row row group ("BatchSize must be greater than 0")
        pq.ParquetWriter(sink, table.schema, compression="zstd").close()
    return sink.getvalue().to_pybytes()


class Artifact:
    """Read access to an artifact folder (complete or not)."""

    def __init__(self, url: str) -> None:
        self.url = str(url)
        self.fs, self.path = resolve(self.url)

    # -- state ---------------------------------------------------------------------------
    @property
    def manifest_path(self) -> str:
        return join(self.path, MANIFEST_NAME)

    def manifest(self) -> Manifest:
        """The manifest; raises ArtifactError if the artifact is not complete."""
        if not self.fs.exists(self.manifest_path):
            raise ArtifactError(f"artifact {self.url} has no manifest (not built, or its run did not finish)")
        with self.fs.open(self.manifest_path, "r") as handle:
            return Manifest.from_json(handle.read())

    def missing_shards(self, manifest: Manifest, verify_hashes: bool = False) -> list[str]:
        """Shard files of the manifest that are absent, resized or (optionally) altered."""
        problems: list[str] = []
        for shard in manifest.shards:
            path = join(self.path, shard.file)
            if not self.fs.exists(path):
                problems.append(f"{shard.file}: missing")
                continue
            size = self.fs.size(path)
            if size != shard.bytes:
                problems.append(f"{shard.file}: {size} bytes, manifest says {shard.bytes}")
            elif verify_hashes:
                with self.fs.open(path, "rb") as handle:
                    if sha256_bytes(handle.read()) != shard.sha256:
                        problems.append(f"{shard.file}: content hash differs from manifest")
        return problems

    def is_complete(self, stage_key: str | None = None, verify_hashes: bool = False) -> bool:
        """True if the manifest exists, matches ``stage_key`` (if given) and all shards are intact."""
        try:
            manifest = self.manifest()
        except ArtifactError:
            return False
        except (json.JSONDecodeError, TypeError, KeyError):
            return False
        if stage_key is not None and manifest.stage_key != stage_key:
            return False
        return not self.missing_shards(manifest, verify_hashes=verify_hashes)

    # -- reading -------------------------------------------------------------------------
    def shard_paths(self) -> list[str]:
        """Paths of the manifest's shards, in shard order."""
        manifest = self.manifest()
        problems = self.missing_shards(manifest)
        if problems:
            raise ArtifactError(f"artifact {self.url} is damaged: " + "; ".join(problems))
        return [join(self.path, s.file) for s in manifest.shards]

    def _footer(self, path: str) -> dict[bytes, bytes]:
        try:
            with self.fs.open(path, "rb") as handle:
                return dict(pq.ParquetFile(handle).schema_arrow.metadata or {})
        except (OSError, pa.ArrowInvalid):
            return {}

    def written_indices(self) -> set[int]:
        """Indices of the shard files in the folder now (one listing; no footer read): what a
        watcher of writers elsewhere counts while they work."""
        try:
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(self.path, detail=False, refresh=True)]
        except FileNotFoundError:
            return set()
        return {int(m.group(1)) for m in map(SHARD_PATTERN.match, names) if m}

    def shard_stats(self, index: int) -> dict[str, Any] | None:
        """The stats the stage recorded in shard ``index``'s footer (None: none recorded)."""
        value = self._footer(join(self.path, shard_name(index))).get(STATS_FIELD)
        return json.loads(value) if value else None

    def read_shard(self, index: int, columns: Sequence[str] | None = None) -> pa.Table:
        """One shard as a table (shards are sized to fit memory)."""
        path = join(self.path, shard_name(index))
        with self.fs.open(path, "rb") as handle:
            return pq.read_table(handle, columns=list(columns) if columns else None)

    def read_matching(self, index: int, key: str, wanted: set[Any], columns: Sequence[str]) -> pa.Table:
        """The rows of shard ``index`` whose ``key`` is in ``wanted`` (``columns``, ``key`` first),
        reading ``key`` whole and the other columns only from the row groups that hold such rows:
        a few images of a shard cost their row groups (``IMAGE_ROW_GROUP`` rows), not the shard."""
        with self.fs.open(join(self.path, shard_name(index)), "rb") as handle:
            parquet = pq.ParquetFile(handle)
            others = [c for c in columns if c != key]
            keys = parquet.read(columns=[key]).column(key)
            hit = np.fromiter((k in wanted for k in keys.to_pylist()), bool, len(keys))
            parts, start = [], 0
            for group in range(parquet.num_row_groups):
                stop = start + parquet.metadata.row_group(group).num_rows
                mask = hit[start:stop]
                if mask.any():
                    rest = parquet.read_row_group(group, columns=others) if others else None
                    part = pa.table({key: keys.slice(start, stop - start),
                                     **({c: rest.column(c) for c in others} if rest is not None else {})})
                    parts.append(part.filter(pa.array(mask)))
                start = stop
            schema = pa.schema([parquet.schema_arrow.field(c) for c in [key, *others]])
        return pa.concat_tables(parts) if parts else schema.empty_table()

    def iter_shards(self, columns: Sequence[str] | None = None) -> Iterator[tuple[int, pa.Table]]:
        """Yield (shard index, table) one shard at a time."""
        for shard in self.manifest().shards:
            yield shard.index, self.read_shard(shard.index, columns)

    def rows(self, columns: Sequence[str] | None = None) -> list[dict[str, Any]]:
        """Every row as a dict (the selected columns), shard by shard: for artifacts that fit in memory."""
        return [row for _, table in self.iter_shards(columns) for row in table.to_pylist()]

    def iter_batches(self, columns: Sequence[str] | None = None, batch_size: int = 1024) -> Iterator[pa.RecordBatch]:
        """Stream record batches across all shards without loading a whole shard at once."""
        for path in self.shard_paths():
            with self.fs.open(path, "rb") as handle:
                yield from pq.ParquetFile(handle).iter_batches(
                    batch_size=batch_size, columns=list(columns) if columns else None
                )

    def count_rows(self) -> int:
        return self.manifest().total_rows

    def count_equal(self, column: str, value: Any) -> int:
        """Rows whose ``column`` equals ``value``, read from that column alone, shard by shard (a
        stage's input counted apart from the rows its own loader builds)."""
        return sum(v == value for _, table in self.iter_shards([column]) for v in table.column(column).to_pylist())

    def to_pandas(self, columns: Sequence[str] | None = None):  # pragma: no cover - convenience
        """Whole artifact as a DataFrame (for small artifacts, notebooks and tests)."""
        tables = [t for _, t in self.iter_shards(columns)]
        return pa.concat_tables(tables).to_pandas() if tables else pa.table({}).to_pandas()


class ArtifactWriter(Artifact):
    """Writes the shards and finally the manifest of one artifact for one stage key.

    ``begin()`` removes the manifest (the artifact becomes incomplete), temporary files from
    killed writers, and shards written under a different stage key; shards already written for
    the same key stay and are reported by ``existing_shard`` so a resumed run can skip them.
    """

    def __init__(self, url: str, kind: str, schema: pa.Schema, stage_key: str) -> None:
        super().__init__(url)
        self.kind = kind
        self.schema = schema
        self.stage_key = stage_key

    def begin(self) -> None:
        self.fs.makedirs(self.path, exist_ok=True)
        if self.fs.exists(self.manifest_path):
            self.fs.rm(self.manifest_path)
        for entry in self._entries():
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if ".tmp-" in name or (SHARD_PATTERN.match(name) and self._footer_key(entry) != self.stage_key):
                self.fs.rm(entry)

    def _entries(self) -> list[str]:
        """The folder's entries; none where nothing was written yet (an object store has no
        empty folders: listing a prefix without objects is FileNotFoundError)."""
        try:
            return list(self.fs.ls(self.path, detail=False, refresh=True))
        except FileNotFoundError:
            return []

    def _footer_key(self, path: str) -> str | None:
        value = self._footer(path).get(KEY_FIELD)
        return value.decode() if value else None

    def existing_shard(self, index: int) -> ShardInfo | None:
        """ShardInfo of shard ``index`` if a previous run of the same stage key wrote it."""
        path = join(self.path, shard_name(index))
        if not self.fs.exists(path) or self._footer_key(path) != self.stage_key:
            return None
        with self.fs.open(path, "rb") as handle:
            data = handle.read()
        rows = pq.ParquetFile(pa.BufferReader(data)).metadata.num_rows
        return ShardInfo(index=index, file=shard_name(index), rows=rows, bytes=len(data), sha256=sha256_bytes(data))

    def remove_shard(self, index: int) -> None:
        """Remove shard ``index``'s file, if there is one (a shard its stage must compute again)."""
        path = join(self.path, shard_name(index))
        if self.fs.exists(path):
            self.fs.rm(path)

    def write_shard(self, index: int, table: pa.Table, stats: dict[str, Any] | None = None) -> ShardInfo:
        """Validate ``table`` against the schema and write it atomically as shard ``index`` (with
        the stage's ``stats`` for it in the footer)."""
        table = conform(table, self.schema, self.url)
        data = serialize_table(table, self.stage_key, index, stats)
        atomic_write_bytes(self.fs, join(self.path, shard_name(index)), data, uuid.uuid4().hex[:8])
        return ShardInfo(
            index=index, file=shard_name(index), rows=table.num_rows, bytes=len(data), sha256=sha256_bytes(data)
        )

    def finalize(
        self,
        shards: Sequence[ShardInfo],
        *,
        code_version: str,
        config: dict[str, Any] | None = None,
        models: dict[str, Any] | None = None,
        prompt_versions: dict[str, str] | None = None,
        upstream: Sequence[Artifact] = (),
        stats: dict[str, Any] | None = None,
    ) -> Manifest:
        """Remove stray shards and write the manifest (last, atomically): the artifact is complete."""
        shards = sorted(shards, key=lambda s: s.index)
        if [s.index for s in shards] != list(range(len(shards))):
            raise ArtifactError(f"artifact {self.url}: shard indices are not 0..{len(shards) - 1}")
        keep = {s.file for s in shards}
        for entry in self._entries():
            name = entry.rstrip("/").rsplit("/", 1)[-1]
            if SHARD_PATTERN.match(name) and name not in keep:
                self.fs.rm(entry)
        manifest = Manifest(
            kind=self.kind,
            stage_key=self.stage_key,
            schema=self.schema.to_string(show_schema_metadata=False),
            shards=list(shards),
            total_rows=sum(s.rows for s in shards),
            fingerprint=sha256_json([s.sha256 for s in shards]),
            created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            code_version=code_version,
            config=config or {},
            models=models or {},
            prompt_versions=prompt_versions or {},
            upstream=[a.manifest().lineage_entry(a.url) for a in upstream],
            stats=stats or {},
        )
        atomic_write_bytes(self.fs, self.manifest_path, manifest.to_json().encode(), uuid.uuid4().hex[:8])
        return manifest


def conform(table: pa.Table, schema: pa.Schema, where: str) -> pa.Table:
    """Select and cast ``table``'s columns to ``schema``; a missing column is a clear error."""
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ArtifactError(f"artifact {where}: rows lack columns {missing}")
    try:
        return table.select(schema.names).cast(schema)
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise ArtifactError(f"artifact {where}: rows do not fit the schema: {exc}") from exc


def empty_table(schema: pa.Schema) -> pa.Table:
    """A zero-row table of ``schema`` (a shard with no rows keeps shard indices aligned)."""
    return schema.empty_table()
