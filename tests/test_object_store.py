"""Artifacts on an S3-compatible object store (moto's server on loopback): a real build writes,
resumes and skips there, and a reader never sees a half-written shard or manifest.

S3 has no rename. What keeps readers safe there (``storage.filesystem.atomic_write_bytes``): every
file is one PUT of the whole object, which becomes visible only complete; shards are PUT first,
the manifest last; a reader trusts only a manifest and the shards it lists (with their hashes).
A writer killed before its manifest leaves whole shards and no manifest: the stage is incomplete,
and the next run of the same key reuses those shards, of another key deletes them.
"""

from __future__ import annotations

import json
import select
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from s3_server import moto_s3

from storage import Artifact, ArtifactWriter
from storage.artifact import shard_name
from storage.hashing import sha256_bytes

pytestmark = pytest.mark.slow
SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64())])
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with one bucket; the environment a subprocess needs to reach
    it, and fsspec configured for it in this process."""
    with moto_s3(("rde-test",)) as env:
        yield env


def _objects(prefix: str) -> list[str]:
    import fsspec

    fs, path = fsspec.core.url_to_fs(prefix)
    fs.invalidate_cache()
    return sorted(fs.find(path))


def test_a_writer_stopped_before_its_manifest_leaves_whole_shards_that_a_rerun_reuses_or_removes(
        s3_env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    url = "s3://rde-test/store/a"
    w = ArtifactWriter(url, "demo", SCHEMA, "k1")

    def no_rename(*args, **kwargs):  # on S3 a "rename" is a copy and a delete: every file is one PUT
        raise AssertionError("an object store write went through mv")

    monkeypatch.setattr(type(w.fs), "mv", no_rename)
    w.begin()  # nothing there yet: an object store has no empty folder to list
    w.write_shard(0, pa.table({"id": ["a", "b"], "value": [1, 2]}, schema=SCHEMA))
    w.write_shard(1, pa.table({"id": ["c"], "value": [3]}, schema=SCHEMA))
    # stopped here (no manifest): incomplete, and no temporary object was ever written
    assert not Artifact(url).is_complete()
    names = [p.rsplit("/", 1)[-1] for p in _objects(url)]
    assert names == [shard_name(0), shard_name(1)] and not any(".tmp-" in n for n in names)
    again = ArtifactWriter(url, "demo", SCHEMA, "k1")
    again.begin()
    kept = [again.existing_shard(0), again.existing_shard(1)]
    assert all(kept) and kept[0].rows == 2
    again.finalize(kept, code_version="test")
    art = Artifact(url)
    assert art.is_complete("k1", verify_hashes=True) and art.count_rows() == 3
    assert sorted(art.to_pandas().id) == ["a", "b", "c"]
    other = ArtifactWriter(url, "demo", SCHEMA, "k2")
    other.begin()  # another key: the manifest goes first, then the other key's shards
    assert _objects(url) == [] and not Artifact(url).is_complete()


# A writer process: shard 0 (a few bytes, one PUT), then shard 1 (12 MiB of random bytes), then the
# manifest. Shards go up in 5 MiB parts (S3's smallest part; s3fs's default switches to a multipart
# upload only at 100 MiB), one part at a time. With "pause" it stops before sending part 2 of the
# multipart upload, prints "paused <upload id>", and waits to be killed; with "run" it completes.
# Its last line is JSON: the shards it found already written and reused.
KILLED_WRITER = """
import asyncio, json, sys
import numpy as np, pyarrow as pa, s3fs
from storage import ArtifactWriter

url, pause = sys.argv[1], sys.argv[2] == "pause"
PART = 5 * 2**20
schema = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("blob", pa.binary())])
rng = np.random.default_rng(7)
tables = [pa.table({"id": ["small"], "blob": [b"x"]}, schema=schema),
          pa.table({"id": ["b0", "b1", "b2"], "blob": [rng.bytes(4 * 2**20) for _ in range(3)]}, schema=schema)]
real_pipe, real_call = s3fs.S3FileSystem._pipe_file, s3fs.S3FileSystem._call_s3

async def in_parts(self, path, data, chunksize=PART, max_concurrency=1, **kwargs):
    return await real_pipe(self, path, data, chunksize=chunksize, max_concurrency=max_concurrency, **kwargs)

async def pausing(self, method, *args, **kwargs):
    if pause and method == "upload_part" and kwargs.get("PartNumber") == 2:
        print("paused", kwargs["UploadId"], flush=True)
        await asyncio.sleep(600)
    return await real_call(self, method, *args, **kwargs)

s3fs.S3FileSystem._pipe_file, s3fs.S3FileSystem._call_s3 = in_parts, pausing
writer = ArtifactWriter(url, "demo", schema, "k1")
writer.begin()
found = [writer.existing_shard(i) for i in range(len(tables))]
shards = [f or writer.write_shard(i, t) for i, (f, t) in enumerate(zip(found, tables))]
writer.finalize(shards, code_version="test")
print(json.dumps({"reused": [i for i, f in enumerate(found) if f]}), flush=True)
"""


def _first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The process's first line of output, or '' when it prints none within ``timeout`` seconds."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    return proc.stdout.readline().strip() if ready else ""


def _in_progress_uploads(bucket: str, prefix: str) -> dict[str, list[tuple[str, int]]]:
    """The bucket's multipart uploads under ``prefix`` that were started and neither completed nor
    aborted: upload id → [(key, size) of each stored part]."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(f"s3://{bucket}")
    uploads = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=prefix).get("Uploads", [])
    return {u["UploadId"]: [(u["Key"], p["Size"]) for p in fs.call_s3(
        "list_parts", Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get("Parts", [])] for u in uploads}


def _what_readers_see(url: str) -> tuple[list[str], set[int], bool]:
    """The artifact's object names (fresh listing), the shard indices a watcher counts, and whether
    it is complete."""
    names = [p.rsplit("/", 1)[-1] for p in _objects(url)]
    art = Artifact(url)
    return names, art.written_indices(), art.is_complete()


def test_a_writer_killed_mid_multipart_upload_leaves_no_visible_shard_and_a_rerun_completes(
        s3_env: dict[str, str]) -> None:
    """SIGKILL lands while a 12 MiB shard is half uploaded (seen on the server: its multipart upload
    holds part 1 and is not completed). The listing shows only the whole shard before it, the
    artifact is incomplete; the same writer run again reuses that shard, uploads the other whole,
    and completes."""
    url, prefix = "s3://rde-test/store/killed", "store/killed/"
    args = [sys.executable, "-c", KILLED_WRITER, url]
    proc = subprocess.Popen([*args, "pause"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=s3_env)
    try:
        line = _first_line(proc, timeout=120)
        assert line.startswith("paused "), (line, proc.poll())
        upload_id = line.split()[1]
        # the kill lands mid-upload: part 1 (5 MiB) of shard 1 is on the server, the upload is open
        assert _in_progress_uploads("rde-test", prefix) == {upload_id: [(f"{prefix}{shard_name(1)}", 5 * 2**20)]}
        only_shard_0 = ([shard_name(0)], {0}, False)
        assert _what_readers_see(url) == only_shard_0  # while the upload waits
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert upload_id in _in_progress_uploads("rde-test", prefix)  # killed: never completed, never aborted
    assert _what_readers_see(url) == only_shard_0  # the half-uploaded shard is nowhere, the artifact incomplete
    rerun = subprocess.run([*args, "run"], capture_output=True, text=True, cwd=ROOT, env=s3_env, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert json.loads(rerun.stdout.splitlines()[-1]) == {"reused": [0]}
    _objects(url)  # drop this process's cached listing
    done = Artifact(url)
    assert done.is_complete("k1", verify_hashes=True) and done.count_rows() == 4
    assert done.manifest().shards[1].bytes > 12 * 2**20


def test_build_secmm_until_denoise_on_s3_balances_resumes_and_skips(s3_env: dict[str, str], tiny_pool_url: str,
                                                                   tmp_path: Path,
                                                                   shared_server_env: dict[str, str]) -> None:
    """The CLI on an ``s3://`` output: the three pool stages run there, every manifest's shard
    hashes match the stored objects, a rerun skips all, and a deleted shard recomputes only its stage.
    The three runs report to the session's Prefect server (not an ephemeral server each)."""
    import json

    import fsspec

    s3_env = {**s3_env, "PREFECT_API_URL": shared_server_env["PREFECT_API_URL"]}

    out = "s3://rde-test/builds/one"
    args = [sys.executable, "-m", "entry.cli", "build-secmm", "--input", tiny_pool_url, "--until", "denoise",
            "--output", out, "--set", "ingest.shard_size=8", "--json"]
    first = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=s3_env, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    summary = json.loads(first.stdout)
    assert summary["balanced"] and summary["inputs"] == Artifact(tiny_pool_url).count_rows()
    assert [s["stage"] for s in summary["stages"]] == ["ingest", "measure", "denoise"]
    fs, _ = fsspec.core.url_to_fs(out)
    for name in ("images", "measurements", "accepted", "denoise_rejects"):
        art = Artifact(f"{out}/build-secmm/demo/{name}")
        assert art.is_complete(verify_hashes=True), name
        for shard in art.manifest().shards:  # what the manifest lists is what is stored, byte for byte
            assert sha256_bytes(fs.cat_file(f"{art.path}/{shard.file}")) == shard.sha256
    stored = _objects(out)
    assert stored and not [p for p in stored if ".tmp-" in p or p.endswith(".run.lock")]
    again = json.loads(subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=s3_env,
                                      timeout=600).stdout)
    assert all(s["skipped"] for s in again["stages"])
    fs.rm(f"{Artifact(f'{out}/build-secmm/demo/accepted').path}/{shard_name(0)}")
    third = json.loads(subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=s3_env,
                                      timeout=600).stdout)
    assert [s["stage"] for s in third["stages"] if not s["skipped"]] == ["denoise"]
    assert third["balanced"] and third["accepted"] == summary["accepted"]


def test_training_checkpoints_go_to_the_object_store_and_resume_from_there(s3_env: dict[str, str]) -> None:
    """A training run's step checkpoints written to s3:// (one PUT each); a rerun after the newest is
    lost resumes mid-epoch from the one before and ends where the whole run ends."""
    import fsspec
    import torch
    from test_retrieval_training import _model, _pairs

    from rde.training.retrieval_training import TrainConfig, train

    cfg = TrainConfig(objective="saft", epochs=1, batch_size=16, lr_start=1e-3, lr_peak=1e-2, seed=3,
                      checkpoint_every=2)
    url = "s3://rde-test/checkpoints/run-1"
    whole = _model()
    train(whole, _pairs(), cfg, checkpoint_dir=url)
    fs, _ = fsspec.core.url_to_fs(url)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(url.removeprefix("s3://"), detail=False))
    assert names == ["step-000000002.pt", "step-000000003.pt"]  # mid-epoch at step 2, the epoch's end at 3
    fs.rm_file(url.removeprefix("s3://") + "/step-000000003.pt")
    resumed = _model()
    result = train(resumed, _pairs(), cfg, checkpoint_dir=url)
    assert result.resumed_step == 2 and [s["step"] for s in result.step_losses] == [3]
    for x, y in zip(whole.state_dict().values(), resumed.state_dict().values(), strict=True):
        assert torch.allclose(x, y, atol=1e-6)
