"""Faults that must leave nothing lost: a killed run, failing generators, a full disk, two runs
on one output. Each asserts accounting (accepted + rejected = input) and manifest integrity."""

from __future__ import annotations

import errno
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from openai_stub import StubServer, _completion

from rde.common.run_lock import RunLockedError, output_lock
from storage import Artifact, ArtifactWriter
from storage.filesystem import StorageWriteError

ROOT = Path(__file__).resolve().parent.parent


def assert_artifacts_intact(root: Path) -> None:
    """Every complete artifact under ``root``: shards listed = shards on disk, hashes match, no
    temporary files, rows add up."""
    manifests = list(root.rglob("_manifest.json"))
    assert manifests, f"no artifacts under {root}"
    for manifest_path in manifests:
        art = Artifact(str(manifest_path.parent))
        manifest = art.manifest()
        assert art.missing_shards(manifest, verify_hashes=True) == [], manifest_path
        on_disk = sorted(p.name for p in manifest_path.parent.glob("part-*.parquet"))
        assert on_disk == sorted(s.file for s in manifest.shards), manifest_path
        assert not list(manifest_path.parent.glob("*.tmp-*"))
        # rows counted in the Parquet files themselves, not from the manifest that claims them
        on_disk_rows = sum(pq.ParquetFile(manifest_path.parent / s.file).metadata.num_rows for s in manifest.shards)
        assert manifest.total_rows == on_disk_rows, manifest_path


# -- disk full / permission denied -------------------------------------------------------------------

def test_disk_full_names_the_path_and_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    from fsspec.implementations.local import LocalFileOpener

    url = str(tmp_path / "art")
    schema = pa.schema([pa.field("x", pa.int64())])
    writer = ArtifactWriter(url, "demo", schema, "key")
    writer.begin()
    writer.write_shard(0, pa.table({"x": [1, 2]}))

    def full(self: object, data: bytes) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(LocalFileOpener, "write", full)
    with pytest.raises(StorageWriteError, match=r"part-00001\.parquet: the disk is full"):
        writer.write_shard(1, pa.table({"x": [3]}))
    monkeypatch.undo()
    names = sorted(p.name for p in (tmp_path / "art").iterdir())
    assert names == ["part-00000.parquet"]  # no temp file, no half shard, no manifest
    assert not Artifact(url).is_complete()


@pytest.mark.slow
def test_a_file_where_the_output_folder_should_be_is_a_clear_cli_error(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from entry.cli import app

    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the artifacts folder should be")
    before = sorted(p.name for p in tmp_path.iterdir())
    result = CliRunner().invoke(app, ["build-secmm", "--until", "denoise", "--output", str(blocker / "out")])
    assert result.exit_code == 2, result.output
    assert "error:" in result.output and str(blocker) in result.output.replace("\n", "")
    assert "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing was created beside it
    assert blocker.read_text() == "a file where the artifacts folder should be"


# -- two runs on one output --------------------------------------------------------------------------

def test_second_run_on_the_same_output_fails_clearly_and_a_killed_holder_frees_it(tmp_path: Path) -> None:
    code = (f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from rde.common.run_lock import output_lock\n"
            f"with output_lock({str(tmp_path)!r}, 'build-secmm'):\n    print('locked', flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    pattern = rf"another run is writing {tmp_path} .*build-secmm.*\"pid\": {proc.pid}"
    with pytest.raises(RunLockedError, match=pattern), output_lock(str(tmp_path), "build-secmm"):
        pass
    proc.send_signal(signal.SIGKILL)  # the OS drops the flock with the process: no stale lock
    proc.wait(10)
    with output_lock(str(tmp_path), "build-secmm"), output_lock(str(tmp_path), "build-secmm"):
        pass  # free again, and re-entrant within one process (the CLI holds it around the flow)


# -- generator failures --------------------------------------------------------------------------------

class FaultyGenerator:
    """Stub behaviour: 5xx, timeouts and malformed bodies on a seeded share of calls; otherwise
    Q&A pairs for Q&A prompts and a description for the others. A prompt starting with
    ``always_down`` gets an HTTP 500 on every attempt, so its requests exhaust every retry."""

    DOWN_BODY = b'{"error": "this prompt is always down"}'

    def __init__(self, seed: int = 0, always_down: str | None = None) -> None:
        self.rng = random.Random(seed)
        self.always_down = always_down
        self.faults: dict[str, int] = {"503": 0, "timeout": 0, "malformed": 0}

    def __call__(self, text: str) -> tuple[int, bytes, float]:
        if self.always_down is not None and text.startswith(self.always_down):
            return 500, self.DOWN_BODY, 0.0
        roll = self.rng.random()
        if roll < 0.2:
            self.faults["503"] += 1
            return 503, b'{"error": "overloaded"}', 0.0
        if roll < 0.3:
            self.faults["timeout"] += 1
            return 200, json.dumps(_completion("late")).encode(), 1.5
        if roll < 0.4:
            self.faults["malformed"] += 1
            return 200, b"{not json", 0.0
        if "<question>" in text:  # the Q&A instruction (the summaries quote Q1: lines too)
            answer = "Q1: What is on the top? A1: A dark jacket.\nQ2: What is on the bottom? A2: Grey trousers."
        else:
            answer = "The person wears a dark jacket and grey trousers, and walks along the path with a bag."
        return 200, json.dumps(_completion(answer)).encode(), 0.0


def _prompt_text(body: dict) -> str:
    """The text of a chat-completions body's last message (its images come before the text)."""
    content = body["messages"][-1]["content"]
    return content if isinstance(content, str) else content[-1]["text"]


@pytest.mark.slow
def test_failing_generator_calls_are_retried_then_recorded(tmp_path: Path, small_pool_url: str) -> None:
    """Transient failures are asked again by the HTTP client and again by the tier's retry rounds;
    a request failing on every attempt is sent exactly (client tries × rounds) times, then recorded."""
    from flows.build_largefine import build_largefine
    from models.prompt_files import load_prompt

    tiers = load_prompt("gtr_tiers")  # the intermediate summary's first line, for the demo's people
    down_prompt = tiers.render("inter_sum", **tiers.extras["wording"], qa="", answers="").splitlines()[0]
    faulty = FaultyGenerator(always_down=down_prompt)
    client_tries, rounds = 2, 2  # max_retries + 1 HTTP calls per round, max_attempts rounds
    with StubServer(script=faulty) as server:
        spec = {"backend": "openai-http", "model_id": "stub", "batch_size": 4,
                "options": {"base_url": server.base_url, "timeout_s": 1.0, "max_retries": client_tries - 1,
                            "backoff_s": 0.01}}
        overrides = {"models": {"generators": [spec], "template_generator": spec},
                     "input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16},
                     "largefine": {"max_images": 6, "shard_size": 3, "tier_prompt": "gtr_tiers",
                                   "retries": {"max_attempts": rounds, "backoff_s": 0.01},
                                   "templates": {"sample_captions": 2, "rounds": 1}}}
        summary = build_largefine(profile="demo", output_root=str(tmp_path), overrides=overrides)
    root = tmp_path / "build-largefine" / "demo"
    captions = Artifact(str(root / "largefine")).count_rows()
    rejects = Artifact(str(root / "caption_rejects")).rows()
    assert summary["balanced"] and captions + len(rejects) == 3 * 6
    assert sum(faulty.faults.values()) > 0 and captions > 0
    assert {r["reason"] for r in rejects} <= {"timeout", "generation_failed", "malformed_output",
                                              "missing_tier_input", "malformed_qa"}
    # every logical request carries its own seed, so a body the stub saw twice is a retry
    sent = Counter(json.dumps(body, sort_keys=True) for body in server.state.bodies)
    calls, requests = sum(sent.values()), len(sent)
    assert calls > requests, f"{calls} calls for {requests} requests: none was retried"
    assert max(sent.values()) <= client_tries * rounds, "a request was sent more often than the retries allow"
    # the always-down prompt: each of its requests used every attempt, then became one rejected row
    down_sent = [n for key, n in sent.items() if _prompt_text(json.loads(key)).startswith(down_prompt)]
    assert down_sent and set(down_sent) == {client_tries * rounds}, f"calls per always-failing request: {down_sent}"
    down = [r for r in rejects if "always down" in (r["detail"] or "")]
    assert len(down) == len(down_sent) and {(r["stage"], r["reason"]) for r in down} == {
        ("tier-inter", "generation_failed")}
    assert all(f"gave up after {client_tries} attempts" in r["detail"] for r in down)
    missing = {r["image_id"] for r in rejects if (r["stage"], r["reason"]) == ("tier-adv", "missing_tier_input")}
    assert {r["image_id"] for r in down} <= missing
    assert_artifacts_intact(root)


# -- a killed run ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_sigkill_mid_stage_then_rerun_completes_without_duplicates(tmp_path: Path, small_pool_url: str,
                                                                   shared_server_env: dict[str, str]) -> None:
    env = {**shared_server_env, "RDE_STATE_DIR": str(tmp_path / "state")}
    out = tmp_path / "out"
    cmd = [str(ROOT / ".venv" / "bin" / "rde") if (ROOT / ".venv" / "bin" / "rde").exists() else "rde",
           "build-secmm", "--until", "denoise", "--output", str(out), "--json", "--input", small_pool_url,
           "--set", "ingest.shard_size=8"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    measurements = out / "build-secmm" / "demo" / "measurements"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and len(list(measurements.glob("part-*.parquet"))) < 2:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)
    written = len(list(measurements.glob("part-*.parquet")))
    assert written >= 2 and not (measurements / "_manifest.json").exists()
    again = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout[again.stdout.index("{"):])
    stages = {s["stage"]: s for s in summary["stages"]}
    assert stages["measure"]["shards_reused"] >= written - 1  # a shard being renamed at the kill may be redone
    assert summary["balanced"] and summary["inputs"] == 96
    assert_artifacts_intact(out / "build-secmm" / "demo")
    demo = out / "build-secmm" / "demo"
    # no duplicates: every artifact's ids are unique, and the measurements hold each input once
    for name, column in (("images", "input_id"), ("ingest_rejects", "input_id"), ("measurements", "input_id"),
                         ("accepted", "input_id"), ("denoise_rejects", "input_id")):
        ids = Artifact(str(demo / name)).to_pandas()[column]
        assert ids.is_unique, f"{name} holds a row twice after the resumed run"
    images = Artifact(str(demo / "images")).to_pandas()
    assert len(images) + len(Artifact(str(demo / "ingest_rejects")).to_pandas()) == 96
    assert len(Artifact(str(demo / "measurements")).to_pandas()) == len(images) == 96  # the slice reads whole
