"""Artifact store: round trip, manifest and lineage, skip/resume keys, atomicity under SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from storage import Artifact, ArtifactError, ArtifactWriter, content_key
from storage.artifact import shard_name

SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64())])


def _table(start: int, n: int) -> pa.Table:
    return pa.table({"id": [f"r{i}" for i in range(start, start + n)], "value": list(range(start, start + n))},
                    schema=SCHEMA)


def _write(url: str, key: str, shards: list[pa.Table], upstream=()) -> ArtifactWriter:
    writer = ArtifactWriter(url, "demo", SCHEMA, key)
    writer.begin()
    infos = [writer.write_shard(i, t) for i, t in enumerate(shards)]
    writer.finalize(infos, code_version="test", config={"a": 1}, models={"m": "x"},
                    prompt_versions={"p": "v1"}, upstream=upstream, stats={"n": sum(t.num_rows for t in shards)})
    return writer


def test_round_trip_and_manifest(tmp_path: Path) -> None:
    url = str(tmp_path / "a")
    _write(url, "k1", [_table(0, 3), _table(3, 2)])
    art = Artifact(url)
    m = art.manifest()
    assert m.total_rows == 5 and [s.rows for s in m.shards] == [3, 2]
    assert m.kind == "demo" and m.stage_key == "k1" and m.code_version == "test"
    assert m.prompt_versions == {"p": "v1"} and m.models == {"m": "x"}
    assert "value: int64" in m.schema
    values = [r["value"] for b in art.iter_batches(batch_size=2) for r in b.to_pylist()]
    assert values == [0, 1, 2, 3, 4]
    assert art.is_complete("k1") and art.is_complete("k1", verify_hashes=True)
    assert not art.is_complete("other-key")


def test_lineage_records_upstream_manifests(tmp_path: Path) -> None:
    up = _write(str(tmp_path / "up"), "k-up", [_table(0, 2)])
    mid = _write(str(tmp_path / "mid"), "k-mid", [_table(0, 1)], upstream=[Artifact(up.url)])
    down = _write(str(tmp_path / "down"), "k-down", [_table(0, 1)], upstream=[Artifact(mid.url)])
    lineage = Artifact(down.url).manifest().upstream
    assert lineage[0]["path"] == mid.url and lineage[0]["stage_key"] == "k-mid"
    assert lineage[0]["upstream"][0]["path"] == up.url  # recursive: the grand-parent is recorded
    assert lineage[0]["upstream"][0]["fingerprint"] == Artifact(up.url).manifest().fingerprint


def test_same_content_gives_same_bytes(tmp_path: Path) -> None:
    a = _write(str(tmp_path / "a"), "k", [_table(0, 10)])
    b = _write(str(tmp_path / "b"), "k", [_table(0, 10)])
    assert a.manifest().fingerprint == b.manifest().fingerprint


def test_missing_or_altered_shard_makes_artifact_incomplete(tmp_path: Path) -> None:
    url = str(tmp_path / "a")
    _write(url, "k", [_table(0, 3), _table(3, 3)])
    shard1 = Path(url) / shard_name(1)
    data = shard1.read_bytes()
    shard1.write_bytes(data[:-1] + bytes([data[-1] ^ 1]))  # same size, altered content
    assert Artifact(url).is_complete("k")
    assert not Artifact(url).is_complete("k", verify_hashes=True)
    shard1.unlink()
    assert not Artifact(url).is_complete("k")
    with pytest.raises(ArtifactError, match="missing"):
        Artifact(url).shard_paths()


def test_resume_keeps_shards_of_same_key_and_drops_others(tmp_path: Path) -> None:
    url = str(tmp_path / "a")
    w = ArtifactWriter(url, "demo", SCHEMA, "k1")
    w.begin()
    w.write_shard(0, _table(0, 2))
    w.write_shard(1, _table(2, 2))
    # a new run of the same key finds both shards; a run of another key removes them
    w2 = ArtifactWriter(url, "demo", SCHEMA, "k1")
    w2.begin()
    assert w2.existing_shard(0) is not None and w2.existing_shard(1).rows == 2
    w3 = ArtifactWriter(url, "demo", SCHEMA, "k2")
    w3.begin()
    assert w3.existing_shard(0) is None
    assert not list(Path(url).glob("part-*.parquet"))


def test_finalize_requires_contiguous_shards_and_removes_strays(tmp_path: Path) -> None:
    url = str(tmp_path / "a")
    w = ArtifactWriter(url, "demo", SCHEMA, "k")
    w.begin()
    s0 = w.write_shard(0, _table(0, 1))
    s2 = w.write_shard(2, _table(1, 1))
    with pytest.raises(ArtifactError, match="shard indices"):
        w.finalize([s0, s2], code_version="t")
    w.finalize([s0], code_version="t")
    assert sorted(p.name for p in Path(url).glob("part-*")) == [shard_name(0)]


def test_an_empty_shard_opens_with_the_standard_readers(tmp_path: Path) -> None:
    """an empty shard is written without a row group, so `datasets` reads the artifact
    (a 0-row row group fails it with "BatchSize must be greater than 0"); the key still resumes."""
    import pandas as pd
    import pyarrow.dataset as pads
    from datasets import load_dataset

    url = str(tmp_path / "a")
    writer = _write(url, "k1", [_table(0, 3), SCHEMA.empty_table()])
    assert len(pd.read_parquet(url)) == pads.dataset(url, format="parquet").count_rows() == 3
    ds = load_dataset("parquet", data_files=f"{url}/*.parquet", split="train", cache_dir=str(tmp_path / "hf"))
    assert ds.num_rows == 3
    assert pq.ParquetFile(Path(url, shard_name(1))).metadata.num_row_groups == 0
    assert writer.existing_shard(1) is not None and Artifact(url).read_shard(1).schema.names == SCHEMA.names


def test_schema_violations_are_clear_errors(tmp_path: Path) -> None:
    w = ArtifactWriter(str(tmp_path / "a"), "demo", SCHEMA, "k")
    w.begin()
    with pytest.raises(ArtifactError, match=r"lack columns \['value'\]"):
        w.write_shard(0, pa.table({"id": ["x"]}))
    with pytest.raises(ArtifactError, match="do not fit the schema"):
        w.write_shard(0, pa.table({"id": ["x"], "value": ["not a number"]}))
    with pytest.raises(ArtifactError, match="no manifest"):
        Artifact(str(tmp_path / "nothing")).manifest()


def test_fsspec_memory_filesystem(tmp_path: Path) -> None:
    url = "memory://rde-test/artifact"
    _write(url, "k", [_table(0, 4)])
    art = Artifact(url)
    assert art.is_complete("k", verify_hashes=True)
    assert [r["id"] for _, t in art.iter_shards() for r in t.to_pylist()] == ["r0", "r1", "r2", "r3"]


def test_content_key_is_order_independent() -> None:
    assert content_key(a=1, b={"x": 2, "y": 3}) == content_key(b={"y": 3, "x": 2}, a=1)
    assert content_key(a=1) != content_key(a=2)


_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    import storage.filesystem as fsmod
    from storage import ArtifactWriter

    class SlowHandle:
        # writes the first half of the shard, flushes it to disk, then stalls until killed
        def __init__(self, inner): self.inner = inner
        def __enter__(self): return self
        def __exit__(self, *exc): self.inner.close()
        def write(self, data):
            half = len(data) // 2
            self.inner.write(data[:half]); self.inner.flush()
            print("HALF-WRITTEN", flush=True)
            time.sleep(120)
            self.inner.write(data[half:])

    class SlowFs:
        def __init__(self, fs): self.fs = fs
        def __getattr__(self, name): return getattr(self.fs, name)
        def open(self, path, mode="rb"):
            return SlowHandle(self.fs.open(path, mode)) if "w" in mode else self.fs.open(path, mode)

    schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64())])
    w = ArtifactWriter(sys.argv[1], "demo", schema, "k")
    w.begin()
    w.write_shard(0, pa.table({"id": ["a"], "value": [1]}, schema=schema))
    w.fs = SlowFs(w.fs)
    n = 200_000
    w.write_shard(1, pa.table({"id": [str(i) for i in range(n)], "value": list(range(n))}, schema=schema))
    """
)


def test_sigkill_mid_write_leaves_no_readable_partial_shard(tmp_path: Path) -> None:
    url = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    try:
        deadline = time.time() + 60
        line = ""
        while time.time() < deadline and "HALF-WRITTEN" not in line:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
        assert "HALF-WRITTEN" in line, "writer never reached the middle of the shard"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    names = sorted(p.name for p in Path(url).iterdir())
    partial = [n for n in names if ".tmp-" in n]
    assert partial, f"expected the half-written temporary file to be left behind, got {names}"
    assert shard_name(1) not in names  # the shard name only ever holds a complete file
    assert pq.read_table(Path(url) / shard_name(0)).num_rows == 1  # the finished shard is intact
    assert not Artifact(url).is_complete()  # no manifest: the stage will run again
    with pytest.raises(pa.ArrowInvalid):
        pq.read_table(Path(url) / partial[0])  # the partial really is unreadable
    # the next run cleans the temporary file and keeps the finished shard of the same key
    w = ArtifactWriter(url, "demo", SCHEMA, "k")
    w.begin()
    assert not [p for p in Path(url).iterdir() if ".tmp-" in p.name]
    assert w.existing_shard(0) is not None and w.existing_shard(1) is None


# A writer of many shards whose file writes stop halfway for a moment (it prints "mid" then), so a
# kill can land while a shard's bytes are half on disk; it prints each shard's index once written.
KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import pyarrow as pa
    from fsspec.implementations.local import LocalFileOpener
    from storage import ArtifactWriter

    real_write = LocalFileOpener.write

    def halting_write(self, data):
        real_write(self, data[:len(data) // 2])
        self.flush()
        print("mid", flush=True)
        time.sleep(0.3)
        return real_write(self, data[len(data) // 2:])

    LocalFileOpener.write = halting_write
    schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64())])
    n = 150_000
    table = pa.table({"id": [str(j) for j in range(n)], "value": list(range(n))}, schema=schema)
    w = ArtifactWriter(sys.argv[1], "demo", schema, "k")
    w.begin()
    for i in range(1000):
        w.write_shard(i, table)
        print(i, flush=True)
    """
)


def _kill_writer(url: str, delay: float | None) -> None:
    """Start the writer, wait until shard 0 is written, then SIGKILL it ``delay`` seconds later, or
    (None) as soon as it has written half of shard 1's bytes."""
    proc = subprocess.Popen([sys.executable, "-c", KILLED_WRITER, url], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parent.parent)
    assert proc.stdout is not None
    assert [proc.stdout.readline().strip() for _ in range(2)] == ["mid", "0"]  # shard 0 is complete
    if delay is None:
        assert proc.stdout.readline().strip() == "mid"
    else:
        time.sleep(delay)
    proc.kill()
    proc.wait(timeout=10)


def test_sigkill_at_random_moments_never_exposes_partial_shards(tmp_path: Path) -> None:
    """Kill a writer of many shards at several moments, one of them certainly mid-write (a temporary
    file is left behind); every visible shard must be whole, and a rerun of the same key removes the
    temporary files and keeps every visible shard, byte for byte, as written."""
    left_mid_write = 0
    for delay in (None, 0.0, 0.13, 0.41):  # after the first shard is written: kills land at varying moments
        url = str(tmp_path / f"run-{delay}")
        _kill_writer(url, delay)
        visible = {p.name: p.read_bytes() for p in Path(url).glob("part-*.parquet")}
        assert "part-00000.parquet" in visible
        for name in visible:
            assert pq.read_table(Path(url, name)).num_rows == 150_000, name
        left_mid_write += bool(list(Path(url).glob("*.tmp-*")))
        rerun = ArtifactWriter(url, "demo", SCHEMA, "k")
        rerun.begin()
        assert not list(Path(url).glob("*.tmp-*"))
        assert {p.name: p.read_bytes() for p in Path(url).glob("part-*.parquet")} == visible
        assert all(rerun.existing_shard(i) is not None for i in range(len(visible)))
    assert left_mid_write >= 1, "no kill landed while a shard was being written: the test checked no partial write"


def test_a_few_images_of_a_shard_are_read_from_their_row_groups_only(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A table with image bytes is written in row groups of IMAGE_ROW_GROUP rows; read_matching
    reads the ids whole and the bytes only of the groups holding a wanted id (a caption task's
    hard negatives), and returns exactly those rows. A table without image bytes stays one group."""
    from storage.artifact import IMAGE_ROW_GROUP

    schema = pa.schema([pa.field("image_id", pa.string()), pa.field("image_bytes", pa.binary())])
    n = 2 * IMAGE_ROW_GROUP + 10
    table = pa.table({"image_id": [f"i{k}" for k in range(n)],
                      "image_bytes": [bytes([k % 256]) * 50 for k in range(n)]}, schema=schema)
    url = str(tmp_path / "accepted")
    writer = ArtifactWriter(url, "images", schema, "k")
    writer.begin()
    writer.finalize([writer.write_shard(0, table)], code_version="t", config={}, models={}, prompt_versions={},
                    upstream=(), stats={})
    assert pq.ParquetFile(f"{url}/{shard_name(0)}").num_row_groups == 3
    _write(str(tmp_path / "plain"), "k", [_table(0, n)])
    assert pq.ParquetFile(f"{tmp_path / 'plain'}/{shard_name(0)}").num_row_groups == 1
    reads: list[tuple[int, tuple[str, ...]]] = []
    real = pq.ParquetFile.read_row_group

    def counted(self, i, columns=None, **kwargs):
        reads.append((i, tuple(columns or ())))
        return real(self, i, columns=columns, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    wanted = {f"i{IMAGE_ROW_GROUP + 3}", f"i{n - 1}"}  # in the second and the third group
    got = Artifact(url).read_matching(0, "image_id", wanted, ["image_id", "image_bytes"])
    assert sorted(got.column("image_id").to_pylist()) == sorted(wanted)
    assert dict(zip(got.column("image_id").to_pylist(), got.column("image_bytes").to_pylist(), strict=True)) == {
        i: bytes([int(i[1:]) % 256]) * 50 for i in wanted}
    assert sorted(i for i, cols in reads if "image_bytes" in cols) == [1, 2]  # never the first group's bytes
    assert Artifact(url).read_matching(0, "image_id", {"nope"}, ["image_id", "image_bytes"]).num_rows == 0
