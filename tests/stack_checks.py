"""Shared by the stack tests (SQLite and PostgreSQL): REST calls, a deployment run of build-secmm
through the cpu worker, the summary's measure row and the bounded orchestration load."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from entry.stack import StackConfig, api_request

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage", "--window-size=1440,1000", "--virtual-time-budget=20000"]


def headless_chromium() -> str:
    """The Chromium binary for the Prefect UI checks. Missing, those checks are skipped with a
    message, and only they (the stack's own checks are tests of their own); under CI (``CI`` set) a
    missing browser fails instead, as for the review page's browser test: CI installs it."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium for the Prefect UI checks (make browser)")
        pytest.skip("no headless Chromium for the Prefect UI checks (make browser installs it)")
    return chromium


def engine_pids(flow_run_id: str) -> list[int]:
    """Pids of the flow-run process of ``flow_run_id`` (``python -m prefect.engine``, started by a
    worker with ``PREFECT__FLOW_RUN_ID`` in its environment); other runs' processes do not count."""
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"prefect.engine" in (proc / "cmdline").read_bytes() and marker in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def kill_with_its_worker(flow_run_pid: int) -> None:
    """SIGKILL a flow-run process and the worker that started it (its parent process, checked to
    be a ``prefect worker``): a lost machine, as far as that run and worker are concerned."""
    worker = int(Path(f"/proc/{flow_run_pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    assert b"worker" in Path(f"/proc/{worker}/cmdline").read_bytes(), "the run's parent process is not its worker"
    for pid in (flow_run_pid, worker):
        os.kill(pid, signal.SIGKILL)


def api(cfg: StackConfig, path: str, body: dict) -> list[dict]:
    """A POST of the stack's REST API through the process's one client (the tests poll with it)."""
    return api_request(cfg, "POST", path, body, timeout=30)


def run_build_secmm(cfg: StackConfig, out: Path, pool_url: str) -> tuple[dict, list[dict], float]:
    """``prefect deployment run 'build-secmm/demo'`` through the cpu worker up to denoise; the flow
    run, its artifacts (read back over the API) and the seconds it took."""
    params = {"until": "denoise", "output_root": str(out),
              "overrides": {"input": {"kind": "pool", "path": pool_url}, "ingest": {"shard_size": 16}}}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "build-secmm/demo",
                          "--params", json.dumps(params), "--watch",
                          "--watch-timeout", "600"], env=cfg.env(), capture_output=True, text=True, timeout=660)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [flow_run] = api(cfg, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    assert flow_run["state_type"] == "COMPLETED"
    assert (out / "build-secmm" / "demo" / "accepted" / "_manifest.json").exists()
    artifacts = api(cfg, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    keys = {a["key"] for a in artifacts if a.get("key")}
    assert {"build-secmm-ingest", "build-secmm-denoise", "build-secmm-summary"} <= keys
    summary = next(a for a in artifacts if a.get("key") == "build-secmm-summary")
    assert "balanced: **True**" in summary["data"]
    return flow_run, artifacts, elapsed


def measure_row(summary_markdown: str) -> list[str]:
    line = next(x for x in summary_markdown.splitlines() if x.startswith("| measure |"))
    return [c.strip() for c in line.strip("|").split("|")]


def probe_load(cfg: StackConfig, test_artifacts_dir: Path) -> dict:
    """The bounded version of benchmarks/orchestration_load.py: 6 concurrent runs of the probe
    deployment, 20 shard tasks each; every run and task completes. Its row is kept per database."""
    from entry.orchestration_load import submit_and_wait

    result = submit_and_wait(cfg, concurrent=6, shards=20, work_ms=10, timeout_s=600, label="ci-")
    row = result.row()
    assert result.completed == 6 and result.failed == 0, row
    assert result.task_runs_completed == 6 * 20, row
    assert result.server_peak_rss_mb > 0 and result.start_p95_s >= result.start_p50_s > 0
    (test_artifacts_dir / f"orchestration-load-{row['database']}.json").write_text(json.dumps(row, indent=1))
    return row
