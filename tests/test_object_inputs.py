"""Inputs on object storage and sharded image datasets, against moto's S3 server on loopback.

A prefix of a few thousand objects is listed page by page and ingested; a 403, an object deleted
between listing and reading, a row in another bucket and a ``..`` row are rejected rows with their
reasons; WebDataset tars and image Parquet (img2dataset's and Hugging Face ``datasets``' layouts)
become one image row or one rejected row per sample, locally and on S3.
"""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from fsspec.implementations.memory import MemoryFileSystem
from PIL import Image
from s3_server import deny_reads_under, moto_s3

from rde.common import url_inputs
from rde.common.image_decoding import DecodeError
from rde.common.ingest import ingest_container, ingest_shard
from rde.common.input_confinement import allowed_roots
from rde.common.input_listing import InputError, check_input, list_inputs, shard_refs
from rde.common.pool_config import IngestSpec, InputSpec
from rde.common.reasons import Reason

pytestmark = pytest.mark.slow
DOMAINS = ["pedestrian", "vehicle"]
BUCKET, OTHER = "rde-in", "rde-other"
MANY = 2100  # three listing pages of at most 1,000 keys


def jpeg(seed: int, size: int = 12) -> bytes:
    rng = np.random.default_rng(seed)
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(out, "JPEG")
    return out.getvalue()


@pytest.fixture(scope="module")
def store() -> Iterator[dict[str, str]]:
    """The server with two buckets: many small images under many/, a few under small/ (one of them
    under small/denied/, which the reading user may not GET), a WebDataset shard and an image
    Parquet under shards/; then authentication on, as that user."""
    with moto_s3((BUCKET, OTHER)) as env:
        fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
        blobs = {f"{BUCKET}/many/{i:05d}.jpg": jpeg(i) for i in range(MANY)}
        blobs.update({f"{BUCKET}/small/pedestrian/a.jpg": jpeg(1), f"{BUCKET}/small/vehicle/b.jpg": jpeg(2),
                      f"{BUCKET}/small/c.jpg": jpeg(3), f"{BUCKET}/small/gone.jpg": jpeg(4),
                      f"{BUCKET}/small/denied/d.jpg": jpeg(5), f"{BUCKET}/small/notes.txt": b"not an image",
                      f"{OTHER}/x.jpg": jpeg(6), f"{BUCKET}/outside/y.jpg": jpeg(7)})
        fs.pipe(blobs)
        yield {**env, **deny_reads_under(env["FSSPEC_S3_ENDPOINT_URL"], BUCKET, "small/denied/")}


def _ingest(spec: InputSpec, tmp_path: Path, ingest: IngestSpec | None = None) -> tuple[list, pa.Table, pa.Table]:
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, rejects = [], []
    for chunk in shard_refs(refs, 256):
        got = ingest_shard(chunk, ingest or IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
        images.append(got[0])
        rejects.append(got[1])
    return refs, pa.concat_tables(images), pa.concat_tables(rejects)


def test_a_prefix_of_thousands_is_listed_page_by_page_and_every_object_ingested(
        store: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pages = []
    real = url_inputs.sync

    def counting(loop, func, *args, **kwargs):  # every page the listing asks the server for
        page = real(loop, func, *args, **kwargs)
        if isinstance(page, dict) and "KeyCount" in page:
            pages.append(page["KeyCount"])
        return page

    monkeypatch.setattr(url_inputs, "sync", counting)
    spec = InputSpec(kind="folder", path=f"s3://{BUCKET}/many/")
    refs, fingerprint = list_inputs(spec, tmp_path, DOMAINS)
    # the input check asks for one key; the listing is streamed, never more than a page held at once
    assert pages == [1, 1000, 1000, 100]
    assert [r.source for r in refs] == [f"s3://{BUCKET}/many/{i:05d}.jpg" for i in range(MANY)]
    assert all(r.size == len(jpeg(i)) for i, r in enumerate(refs[:5]))
    assert list_inputs(spec, tmp_path, DOMAINS)[1] == fingerprint  # the same listing, the same key
    monkeypatch.setattr(url_inputs, "sync", real)
    _, images, rejects = _ingest(spec, tmp_path)
    assert images.num_rows == MANY and rejects.num_rows == 0
    assert images.column("image_bytes")[7].as_py() == jpeg(7)
    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
    fs.pipe_file(f"{BUCKET}/many/00003.jpg", jpeg(99))  # a changed object changes the listing's key
    fs.invalidate_cache()
    assert list_inputs(spec, tmp_path, DOMAINS)[1] != fingerprint


def test_denied_deleted_and_non_image_objects_are_rejected_rows(store: dict[str, str], tmp_path: Path) -> None:
    spec = InputSpec(kind="folder", path=f"s3://{BUCKET}/small")
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    assert {r.source.rsplit("/", 1)[-1]: r.domain for r in refs} == {
        "a.jpg": "pedestrian", "b.jpg": "vehicle", "c.jpg": "pedestrian", "gone.jpg": "pedestrian",
        "d.jpg": "pedestrian", "notes.txt": "pedestrian"}
    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
    if not fs.exists(f"{BUCKET}/small/gone.jpg"):  # the flow test may have deleted it
        fs.pipe_file(f"{BUCKET}/small/gone.jpg", jpeg(4))
        refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    fs.rm_file(f"{BUCKET}/small/gone.jpg")  # deleted between listing and reading
    images, rejects = ingest_shard(refs, IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert images.num_rows + rejects.num_rows == len(refs) == 6
    assert sorted(s.rsplit("/", 1)[-1] for s in images.column("source").to_pylist()) == ["a.jpg", "b.jpg", "c.jpg"]
    reasons = {r["source"].rsplit("/", 1)[-1]: (r["reason"], r["detail"]) for r in rejects.to_pylist()}
    assert reasons["gone.jpg"][0] == "missing_file"
    assert reasons["d.jpg"][0] == "access_denied" and "403" in reasons["d.jpg"][1]
    assert reasons["notes.txt"][0] == "not_an_image"


def test_a_path_list_of_urls_is_confined_to_its_roots(store: dict[str, str], tmp_path: Path) -> None:
    rows = [f"s3://{BUCKET}/small/c.jpg", f"s3://{BUCKET}/small/../outside/y.jpg", f"s3://{OTHER}/x.jpg",
            f"s3a://{BUCKET}/small/pedestrian/a.jpg", "s3://rde-in-small/c.jpg"]
    pq.write_table(pa.table({"path": rows}), tmp_path / "list.parquet")
    spec = InputSpec(kind="paths", path=str(tmp_path / "list.parquet"), roots=[f"s3://{BUCKET}/small/"])
    _, images, rejects = _ingest(spec, tmp_path)
    assert images.column("source").to_pylist() == [rows[0], rows[3]]
    assert {r["source"]: r["reason"] for r in rejects.to_pylist()} == {
        rows[1]: "outside_root", rows[2]: "outside_root", rows[4]: "outside_root"}
    # without roots, the list's own (local) folder is the root: no URL row is read
    _, images, rejects = _ingest(spec.model_copy(update={"roots": []}), tmp_path)
    assert images.num_rows == 0 and set(rejects.column("reason").to_pylist()) == {"outside_root"}
    # a list that is itself on the store: relative rows are under its prefix, and so is its root
    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
    with fs.open(f"{BUCKET}/small/list.parquet", "wb") as handle:
        pq.write_table(pa.table({"path": ["c.jpg", "vehicle/b.jpg", "../outside/y.jpg"],
                                 "domain": ["pedestrian", "vehicle", "pedestrian"]}), handle)
    remote = InputSpec(kind="paths", path=f"s3://{BUCKET}/small/list.parquet")
    _, images, rejects = _ingest(remote, tmp_path)
    assert images.column("domain").to_pylist() == ["pedestrian", "vehicle"]
    assert rejects.column("reason").to_pylist() == ["outside_root"]
    fs.rm_file(f"{BUCKET}/small/list.parquet")


def test_a_missing_bucket_or_empty_prefix_is_a_clear_input_error(store: dict[str, str], tmp_path: Path) -> None:
    with pytest.raises(InputError, match=r"no such bucket|holds no objects"):
        check_input(InputSpec(kind="folder", path="s3://no-such-bucket-here/x/"), tmp_path)
    with pytest.raises(InputError, match="holds no objects"):
        check_input(InputSpec(kind="folder", path=f"s3://{BUCKET}/nothing-here/"), tmp_path)
    with pytest.raises(InputError, match="videos are read from local files"):
        check_input(InputSpec(kind="video", path=f"s3://{BUCKET}/many/"), tmp_path)


class _Flaky(MemoryFileSystem):
    """A store whose first ``fails`` ranged reads of each path drop the connection."""

    protocol = "flaky"
    store: dict = {}  # noqa: RUF012 - its own objects, not memory://'s
    pseudo_dirs = [""]  # noqa: RUF012
    fails = 2
    seen: dict[str, int] = {}  # noqa: RUF012 - per-test state, reset by the test

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.replace("flaky://", "memory://", 1))

    def cat_file(self, path, start=None, end=None, **kwargs):
        self.seen[path] = self.seen.get(path, 0) + 1
        if self.seen[path] <= self.fails:
            raise ConnectionResetError("connection reset by peer")
        return super().cat_file(path, start, end, **kwargs)


def test_reads_that_may_pass_are_retried_with_a_doubling_bounded_backoff() -> None:
    fsspec.register_implementation("flaky", _Flaky, clobber=True)
    fs = _Flaky()
    fs.pipe({"flaky://b/ok.jpg": b"12345", "flaky://b/big.jpg": b"x" * 50})
    waits: list[float] = []
    _Flaky.seen = {}
    policy = url_inputs.ReadPolicy(max_bytes=10, attempts=4, backoff_s=0.5)
    got = url_inputs.read_objects(["flaky://b/ok.jpg", "flaky://b/none.jpg", "flaky://b/big.jpg"],
                                  [5, None, None], policy, sleep=waits.append)
    assert got[0] == b"12345" and waits == [0.5, 1.0]  # two failures, then the read
    assert isinstance(got[1], DecodeError) and got[1].reason == Reason.MISSING_FILE
    assert isinstance(got[2], DecodeError) and got[2].reason == Reason.FILE_TOO_LARGE  # larger than listed
    _Flaky.fails, _Flaky.seen, waits[:] = 99, {}, []
    got = url_inputs.read_objects(["flaky://b/ok.jpg"], [5], url_inputs.ReadPolicy(10, 6, 2.0), sleep=waits.append)
    assert isinstance(got[0], DecodeError) and got[0].reason == Reason.READ_ERROR
    assert "after 6 attempts" in got[0].detail and waits == [2.0, 4.0, 8.0, 8.0, 8.0]  # capped at 8 s
    _Flaky.fails = 2


def test_urls_are_compared_after_normalising_their_keys() -> None:
    roots = ["s3://b/in/"]
    assert url_inputs.url_inside("s3://b/in/x.jpg", roots) and url_inputs.url_inside("s3a://b/in/a/./x.jpg", roots)
    assert not url_inputs.url_inside("s3://b/in/../out/x.jpg", roots)
    assert not url_inputs.url_inside("s3://b/inbox/x.jpg", roots)  # a sibling prefix, not under in/
    assert not url_inputs.url_inside("s3://other/in/x.jpg", roots)
    assert not url_inputs.url_inside("gs://b/in/x.jpg", roots)
    assert not url_inputs.url_inside("s3://b/../../etc/x.jpg", ["s3://b/"])


# -- sharded datasets -------------------------------------------------------------------------------

def write_tar(path: Path | io.BytesIO, samples: list[dict[str, bytes]]) -> None:
    """A WebDataset shard written with the webdataset library's own writer."""
    import webdataset as wds

    with wds.TarWriter(path if isinstance(path, io.BytesIO) else str(path)) as sink:
        for sample in samples:
            sink.write(sample)


TAR_SAMPLES = [
    {"__key__": "s0", "jpg": jpeg(10), "json": json.dumps({"identity": "p7", "caption": "a man"}).encode()},
    {"__key__": "s1", "png": b"\x89PNG broken", "txt": b"a damaged image"},
    {"__key__": "s2", "json": json.dumps({"caption": "no image here"}).encode()},
    {"__key__": "s3", "jpg": jpeg(11), "json": json.dumps({"domain": "vehicle"}).encode()},
]


def test_webdataset_shards_give_one_row_per_sample_locally_and_on_s3(store: dict[str, str], tmp_path: Path) -> None:
    shards = tmp_path / "wds"
    shards.mkdir()
    write_tar(shards / "shard-000.tar", TAR_SAMPLES)
    buffer = io.BytesIO()
    write_tar(buffer, [{"__key__": f"t{i}", "jpg": jpeg(20 + i)} for i in range(3)])
    (shards / "shard-001.tar.gz").write_bytes(gzip.compress(buffer.getvalue()))
    spec = InputSpec(kind="webdataset", path=str(shards))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    assert [Path(r.source).name for r in refs] == ["shard-000.tar", "shard-001.tar.gz"]
    assert shard_refs(refs, 256) == [[refs[0]], [refs[1]]]  # one ingest shard per input shard
    gz_images, _, gz_counted = ingest_container(refs[1], IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert gz_counted == 3 == gz_images.num_rows
    images, rejects, counted = ingest_container(refs[0], IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert counted == 4 == images.num_rows + rejects.num_rows
    rows = {r["source"].rsplit("#", 1)[1]: r for r in images.to_pylist()}
    assert sorted(rows) == ["s0", "s3"]
    assert rows["s0"]["identity"] == "p7" and rows["s3"]["domain"] == "vehicle"
    assert json.loads(rows["s0"]["source_meta"]) == {"shard": refs[0].source, "key": "s0",
                                                    "json": {"identity": "p7", "caption": "a man"}}
    rejected = {r["source"].rsplit("#", 1)[1]: r for r in rejects.to_pylist()}
    assert rejected["s1"]["reason"] == "not_an_image" and "key s1" in rejected["s1"]["detail"]
    assert rejected["s2"]["reason"] == "missing_image"
    assert f"shard {refs[0].source}, key s2" in rejected["s2"]["detail"]
    # the same shard on S3, listed under its prefix
    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
    fs.put_file(str(shards / "shard-000.tar"), f"{BUCKET}/wds/shard-000.tar")
    remote = InputSpec(kind="webdataset", path=f"s3://{BUCKET}/wds/")
    remote_refs, _ = list_inputs(remote, tmp_path, DOMAINS)
    s3_images, s3_rejects, s3_counted = ingest_container(remote_refs[0], IngestSpec(), DOMAINS,
                                                         roots=allowed_roots(remote, tmp_path))
    assert s3_counted == 4 and s3_images.column("image_id").to_pylist() == images.column("image_id").to_pylist()
    assert s3_rejects.column("reason").to_pylist() == rejects.column("reason").to_pylist()


def test_a_key_split_by_another_is_two_samples_as_webdataset_reads_it(tmp_path: Path) -> None:
    """Members k1.jpg, k2.jpg, k1.json: webdataset groups runs of a key, so three samples; the count
    from the member names agrees, and the json-only run is missing_image."""
    path = tmp_path / "split.tar"
    with tarfile.open(path, "w") as tar:
        for name, data in (("k1.jpg", jpeg(60)), ("k2.jpg", jpeg(61)), ("k1.json", b'{"caption": "late"}')):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    spec = InputSpec(kind="webdataset", path=str(path))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, rejects, counted = ingest_container(refs[0], IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert counted == 3 == images.num_rows + rejects.num_rows
    assert images.num_rows == 2 and rejects.column("reason").to_pylist() == ["missing_image"]


def test_a_truncated_tar_keeps_the_samples_before_the_damage_and_rejects_the_rest(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    write_tar(buffer, [{"__key__": f"k{i}", "jpg": jpeg(30 + i, size=64)} for i in range(6)])
    data = buffer.getvalue()
    with tarfile.open(fileobj=io.BytesIO(data)) as whole:
        cut = whole.getmembers()[3].offset_data + 100  # inside the fourth member's bytes
    (tmp_path / "cut.tar").write_bytes(data[:cut])
    spec = InputSpec(kind="webdataset", path=str(tmp_path / "cut.tar"))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    images, rejects, counted = ingest_container(refs[0], IngestSpec(), DOMAINS, roots=allowed_roots(spec, tmp_path))
    assert images.num_rows == 3 and counted == images.num_rows + rejects.num_rows == 4
    (rest,) = rejects.to_pylist()
    assert rest["reason"] == "unreadable_shard" and rest["kind"] == "shard" and "after 3 samples" in rest["detail"]


def test_image_parquet_from_img2dataset_and_hugging_face_datasets(tmp_path: Path) -> None:
    import datasets

    folder = tmp_path / "parquet"
    folder.mkdir()
    pq.write_table(pa.table({"key": ["000000000", "000000001", "000000002"],
                             "jpg": [jpeg(40), None, b"not an image"],
                             "caption": ["a person walking", "lost", "junk"],
                             "url": ["http://x/0.jpg", "http://x/1.jpg", "http://x/2.jpg"],
                             "width": [12, None, None]}), folder / "00000.parquet")
    hf = datasets.Dataset.from_dict({"image": [Image.open(io.BytesIO(jpeg(41)))], "label": [3]})
    hf.to_parquet(str(folder / "00001.parquet"))
    spec = InputSpec(kind="image_parquet", path=str(folder))
    refs, _ = list_inputs(spec, tmp_path, DOMAINS)
    roots = allowed_roots(spec, tmp_path)
    images, rejects, counted = ingest_container(refs[0], IngestSpec(), DOMAINS, roots=roots)
    assert counted == 3 and images.num_rows == 1 and rejects.column("reason").to_pylist() == ["missing_image",
                                                                                             "not_an_image"]
    meta = json.loads(images.column("source_meta")[0].as_py())
    assert meta["caption"] == "a person walking" and meta["url"] == "http://x/0.jpg" and meta["key"] == "000000000"
    assert images.column("source")[0].as_py().endswith("00000.parquet#000000000")
    hf_images, hf_rejects, hf_counted = ingest_container(refs[1], IngestSpec(), DOMAINS, roots=roots)
    assert hf_counted == 1 and hf_images.num_rows == 1 and hf_rejects.num_rows == 0
    assert Image.open(io.BytesIO(hf_images.column("image_bytes")[0].as_py())).size == (12, 12)
    assert json.loads(hf_images.column("source_meta")[0].as_py())["label"] == 3


def test_build_secmm_ingests_an_s3_prefix_and_webdataset_shards_with_balanced_accounting(
        store: dict[str, str], tmp_path: Path) -> None:
    """The flow itself (Prefect, the runner's balance check): a prefix with a denied, a non-image
    and a deleted object, then a WebDataset folder; every listed object or sample is one row."""
    from flows.build_secmm import build_secmm

    fs, _ = fsspec.core.url_to_fs(f"s3://{BUCKET}")
    if fs.exists(f"{BUCKET}/small/gone.jpg"):  # whichever test runs first deletes it
        fs.rm_file(f"{BUCKET}/small/gone.jpg")
    summary = build_secmm(profile="demo", output_root=str(tmp_path / "s3-out"), until="ingest",
                          overrides={"input": {"kind": "folder", "path": f"s3://{BUCKET}/small/"}})
    (ingest,) = summary["stages"]
    assert summary["balanced"] and ingest["input"] == 5 and ingest["accepted"] == 3
    assert summary["rejected"] == {"ingest:access_denied": 1, "ingest:not_an_image": 1}
    shards = tmp_path / "wds"
    shards.mkdir()
    write_tar(shards / "a.tar", TAR_SAMPLES)
    write_tar(shards / "b.tar", [{"__key__": f"t{i}", "jpg": jpeg(50 + i)} for i in range(5)])
    summary = build_secmm(profile="demo", output_root=str(tmp_path / "wds-out"), until="ingest",
                          overrides={"input": {"kind": "webdataset", "path": str(shards)}})
    (ingest,) = summary["stages"]
    assert summary["balanced"] and ingest["input"] == 9 and ingest["accepted"] == 7 and ingest["shards"] == 2


def test_the_cli_guesses_sharded_kinds_from_the_input(tmp_path: Path) -> None:
    from entry.cli import _guess_kind

    pq.write_table(pa.table({"path": ["a.jpg"]}), tmp_path / "list.parquet")
    pq.write_table(pa.table({"key": ["0"], "jpg": [jpeg(1)]}), tmp_path / "images.parquet")
    write_tar(tmp_path / "s.tar", [{"__key__": "k", "jpg": jpeg(2)}])
    assert _guess_kind(str(tmp_path / "list.parquet")) == "paths"
    assert _guess_kind(str(tmp_path / "images.parquet")) == "image_parquet"
    assert _guess_kind(str(tmp_path / "s.tar")) == "webdataset" == _guess_kind("s3://b/shards/000.tar")
    assert _guess_kind("s3://b/crops/") == "folder"
