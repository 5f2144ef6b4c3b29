"""The synthetic scale pool: deterministic, distinct, faithful to its sources' domains,
identities and failing variants, resumable, and written one shard at a time."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from conftest import PERSON_A

from entry import synth_pool
from entry.synth_pool import SynthParams, write_synth_pool
from storage import Artifact

N = 240  # about 5 % of the demo pool's rows fail a denoise rule: every kind shows up in 240


def _rows(folder: Path) -> list[dict]:
    return Artifact(str(folder)).rows()


@pytest.fixture(scope="module")
def synth(tmp_path_factory: pytest.TempPathFactory, demo_pool_url: str) -> tuple[Path, list[dict], dict]:
    out = tmp_path_factory.mktemp("synth") / "pool"
    stats = write_synth_pool(demo_pool_url, str(out), SynthParams(n=N, seed=3, shard_size=64, duplicate_share=0.03))
    return out, _rows(out), stats


def test_the_same_seed_writes_the_same_bytes_and_another_seed_does_not(synth: tuple, tmp_path: Path,
                                                                       demo_pool_url: str) -> None:
    _, rows, _ = synth
    again = tmp_path / "again"
    write_synth_pool(demo_pool_url, str(again), SynthParams(n=N, seed=3, shard_size=40, duplicate_share=0.03))
    digest = [hashlib.sha256(r["image_bytes"]).hexdigest() for r in rows]
    # image i depends on (seed, i) only: another shard size gives the same images in the same order
    assert [hashlib.sha256(r["image_bytes"]).hexdigest() for r in _rows(again)] == digest
    other = tmp_path / "other"
    write_synth_pool(demo_pool_url, str(other), SynthParams(n=20, seed=4, shard_size=64))
    assert not {hashlib.sha256(r["image_bytes"]).hexdigest() for r in _rows(other)} & set(digest)


def test_images_are_distinct_except_the_deliberate_duplicates(synth: tuple) -> None:
    _, rows, stats = synth
    assert len(rows) == N and stats["rows"] == N
    by_id = {r["pool_id"]: r for r in rows}
    seen: set[bytes] = set()
    for r in rows:
        if r["variant"] == "duplicate":  # the exact bytes of an earlier image, named in its meta
            earlier = by_id[json.loads(r["source_meta"])["duplicate_of"]]
            assert earlier["image_bytes"] == r["image_bytes"] and earlier["pool_id"] < r["pool_id"]
        else:
            assert r["image_bytes"] not in seen, f"{r['pool_id']} repeats an earlier image"
            seen.add(r["image_bytes"])
    duplicates = sum(r["variant"] == "duplicate" for r in rows)
    assert 0 < duplicates < 0.1 * N and len(seen) == N - duplicates


def test_domain_identity_and_variant_follow_the_source(synth: tuple, demo_pool_url: str) -> None:
    _, rows, stats = synth
    sources = {r["pool_id"]: r for r in Artifact(demo_pool_url).rows(["pool_id", "domain", "identity", "variant"])}
    for r in rows:
        src = sources[json.loads(r["source_meta"])["source"]]
        assert (r["domain"], r["identity"]) == (src["domain"], src["identity"])
        assert r["variant"] in (src["variant"], "duplicate")
    variants = {r["variant"] for r in rows}
    assert {"crop", "tiny", "blurred", "duplicate"} <= variants and {"pedestrian", "vehicle"} <= {
        r["domain"] for r in rows}
    assert sum(stats["counts"].values()) == N


def test_failing_variants_keep_failing_and_usable_crops_stay_usable(synth: tuple, demo_pool_url: str) -> None:
    """A tiny source is only shrunk, a blurred one blurred harder; a usable crop is never shrunk."""
    from rde.common.image_decoding import decode_rgb

    _, rows, _ = synth
    sources = {r["pool_id"]: decode_rgb(r["image_bytes"]).shape
               for r in Artifact(demo_pool_url).rows(["pool_id", "image_bytes"])}
    for r in rows:
        meta = json.loads(r["source_meta"])
        h, w = decode_rgb(r["image_bytes"]).shape[:2]
        sh, sw = sources[meta["source"]][:2]
        if r["variant"] == "tiny":
            assert h <= sh and w <= sw
        elif r["variant"] == "blurred":
            assert meta["ops"]["blur"] >= 2.0
        elif r["variant"] == "crop":
            assert h >= round(0.88 * sh) - 1 and meta["ops"]["blur"] <= 0.5


def test_a_lost_shard_is_rewritten_alone_with_the_same_bytes(tmp_path: Path, demo_pool_url: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "pool"
    params = SynthParams(n=30, seed=1, shard_size=10)
    write_synth_pool(demo_pool_url, str(out), params)
    before = _rows(out)
    (out / "part-00001.parquet").unlink()
    made: list[int] = []
    real = synth_pool.synth_row
    monkeypatch.setattr(synth_pool, "synth_row", lambda s, i, p: made.append(i) or real(s, i, p))
    stats = write_synth_pool(demo_pool_url, str(out), params)
    assert stats["shards_reused"] == 2 and sorted(made) == list(range(10, 20))
    assert _rows(out) == before


def _one_source_pool(folder: Path, row: dict) -> str:
    """A pool artifact of one source image: every synthetic image is a variation of it, so every shard
    weighs about the same and two pools' memory peaks compare like with like (the demo pool's largest
    crops make one image's transient pixels outweigh a whole shard of small ones)."""
    import pyarrow as pa

    from storage import ArtifactWriter
    from storage.schemas import POOL

    writer = ArtifactWriter(str(folder), "pool", POOL, "one-source")
    writer.begin()
    writer.finalize([writer.write_shard(0, pa.Table.from_pylist([row], schema=POOL))], code_version="test")
    return str(folder)


def _memory_peaks(source: str, out: Path, params: SynthParams) -> tuple[int, int]:
    """Peak bytes while ``write_synth_pool`` runs: Python's heap (tracemalloc: rows, JPEG bytes, numpy
    pixels) and Arrow's (a proxy of its memory pool: tables, Parquet buffers), which tracemalloc
    does not see."""
    import tracemalloc

    import pyarrow as pa

    default = pa.default_memory_pool()
    arrow = pa.proxy_memory_pool(default)
    pa.set_memory_pool(arrow)
    tracemalloc.start()
    try:
        write_synth_pool(source, str(out), params)
        python_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        pa.set_memory_pool(default)
    return python_peak, arrow.max_memory()


def test_memory_holds_one_shard_of_images(tmp_path: Path, pool_rows: dict[str, dict],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The rows alive at once never exceed one shard (counted by a wrapping writer), and the memory
    peak does not grow with N: writing 4N images (eight 25-image shards) peaks, on Python's heap and
    in Arrow's pool each, within half a shard's image bytes of writing N (two shards). Keeping every
    row, or every table, would add about three shards' worth to one of them."""
    source = _one_source_pool(tmp_path / "source", pool_rows[PERSON_A])
    alive: list[int] = []
    real = synth_pool.ArtifactWriter.write_shard

    def counting(self, index, table, stats=None):  # type: ignore[no-untyped-def]
        alive.append(table.num_rows)
        return real(self, index, table, stats)

    monkeypatch.setattr(synth_pool.ArtifactWriter, "write_shard", counting)
    _memory_peaks(source, tmp_path / "warm", SynthParams(n=25, shard_size=25))  # one-time allocations
    peaks = {}
    for n in (50, 200):
        alive.clear()
        peaks[n] = _memory_peaks(source, tmp_path / f"n{n}", SynthParams(n=n, shard_size=25))
        assert max(alive) == 25 and len(alive) == n // 25
    shard_bytes = sum(len(r["image_bytes"]) for r in Artifact(str(tmp_path / "n50")).read_shard(0).to_pylist())
    tolerance = shard_bytes // 2
    for measure, small, large in zip(("python heap", "arrow pool"), peaks[50], peaks[200], strict=True):
        assert large <= small + tolerance, f"{measure}: peak {large} B at N=200, {small} B at N=50 " \
                                           f"(tolerance {tolerance} B: half a shard's image bytes)"


def test_bad_parameters_are_clear_errors(tmp_path: Path, demo_pool_url: str) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        write_synth_pool(demo_pool_url, str(tmp_path / "p"), SynthParams(n=0))
    with pytest.raises(ValueError, match="not a complete pool artifact"):
        write_synth_pool(str(tmp_path / "nothing"), str(tmp_path / "p"), SynthParams(n=5))
