"""A table of a benchmark read one shard at a time, wherever it lies: an artifact folder with its
manifest (what ``build-secmm`` writes), or a folder of Parquet files without one (the dataset
folder its card describes, copied or uploaded as it is: what ``load_dataset("parquet", …)`` reads).
Local paths and fsspec URLs (``s3://``) alike."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from storage import Artifact, ArtifactError
from storage.filesystem import join, resolve
from storage.hashing import sha256_bytes, sha256_json


@dataclass(frozen=True)
class ShardedTable:
    """One table: its shard files (in order) and a fingerprint of their content (the manifest's
    fingerprint; where no manifest is there, each file's name, size and the digest of its last
    64 KiB, which hold Parquet's footer: row counts and per-column statistics)."""

    url: str
    files: tuple[str, ...]
    fingerprint: str
    artifact: Artifact | None = None  # where the table is an artifact with a manifest

    @property
    def shards(self) -> int:
        return len(self.files)

    def read_shard(self, index: int, columns: Sequence[str] | None = None) -> pa.Table:
        if self.artifact is not None:
            return self.artifact.read_shard(index, columns)
        fs, _ = resolve(self.url)
        with fs.open(self.files[index], "rb") as handle:
            return pq.read_table(handle, columns=list(columns) if columns else None)

    def iter_shards(self, columns: Sequence[str] | None = None) -> Iterator[pa.Table]:
        for index in range(self.shards):
            yield self.read_shard(index, columns)

    def rows(self, columns: Sequence[str] | None = None) -> list[dict]:
        return [row for table in self.iter_shards(columns) for row in table.to_pylist()]


def open_table(url: str) -> ShardedTable | None:
    """The table at ``url``: an artifact when it has a manifest (its shards must all be there), else
    its ``*.parquet`` files in name order; None when there is neither."""
    artifact = Artifact(url)
    if artifact.fs.exists(artifact.manifest_path):
        manifest = artifact.manifest()
        missing = artifact.missing_shards(manifest)
        if missing:
            raise ArtifactError(f"{url}: shards listed in its manifest are missing or resized: {missing[:3]}")
        return ShardedTable(url, tuple(join(artifact.path, s.file) for s in manifest.shards), manifest.fingerprint,
                            artifact)
    fs, path = resolve(url)
    if not fs.isdir(path):
        return None
    found = sorted(p for p in fs.glob(join(path, "*.parquet")))
    if not found:
        return None
    return ShardedTable(url, tuple(found), sha256_json([_file_identity(fs, p) for p in found]))


def _file_identity(fs, path: str, tail: int = 65536) -> tuple[str, int, str]:
    size = fs.size(path)
    with fs.open(path, "rb") as handle:
        handle.seek(max(0, size - tail))
        return path.rsplit("/", 1)[-1], size, sha256_bytes(handle.read())
