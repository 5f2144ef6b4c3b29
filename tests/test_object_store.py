"""Artifacts on an S3-compatible object store (moto's server on loopback): a real build writes,
resumes and skips there, and a reader never sees a half-written shard or manifest.

S3 has no rename. What keeps readers safe there (``storage.filesystem.atomic_write_bytes``): every
file is one PUT of the whole object, which becomes visible only complete; shards are PUT first,
the manifest last; a reader trusts only a manifest and the shards it lists (with their hashes).
A writer killed before its manifest leaves whole shards and no manifest: the stage is incomplete,
and the next run of the same key reuses those shards, of another key deletes them.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from storage import Artifact, ArtifactWriter
from storage.artifact import shard_name
from storage.hashing import sha256_bytes

pytestmark = pytest.mark.slow
SCHEMA = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("value", pa.int64())])
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def s3_env() -> Iterator[dict[str, str]]:
    """A moto S3 server on loopback with one bucket; the environment a subprocess needs to reach
    it, and fsspec configured for it in this process (its env vars are read when fsspec loads)."""
    import fsspec

    moto = Path(sys.executable).with_name("moto_server")
    port = _free_port()
    proc = subprocess.Popen([str(moto), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3_ENDPOINT_URL": endpoint}
    saved_env = {k: os.environ.get(k) for k in env}
    saved_conf = fsspec.config.conf.get("s3")
    os.environ.update(env)
    fsspec.config.conf["s3"] = {"endpoint_url": endpoint}
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        fs, _ = fsspec.core.url_to_fs("s3://rde-test")
        fs.mkdir("rde-test")
        yield {**os.environ, **env}
    finally:
        proc.terminate()
        proc.wait(timeout=20)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf


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
    args = [sys.executable, "-m", "rde.entry.cli", "build-secmm", "--input", tiny_pool_url, "--until", "denoise",
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
