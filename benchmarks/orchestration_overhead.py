"""Orchestration overhead: the same flow through a deployment (server + worker) and run directly,
side by side in one run.

Starts a local stack (`entry.stack.up`) on a free port, then alternates: ``prefect deployment run
'build-secmm/demo' --watch`` (through the cpu worker) and ``rde build-secmm`` (ephemeral Prefect in
the calling process), each on a fresh output folder so neither skips work. Input: a slice of the
demo pool (``--images``), ``--until denoise``. Reports wall time of each path, their ratio, and
for the deployment the time from submission to the flow run starting (worker poll + process start).

    .venv/bin/python benchmarks/orchestration_overhead.py [--images 96] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx
import pyarrow as pa

from entry.stack import StackConfig, down, up
from models.backends.disk_memo import keep_nothing_on_disk
from storage import Artifact, ArtifactWriter
from storage.locations import project_root
from storage.schemas import POOL


def slice_pool(n: int, folder: Path) -> str:
    rows = Artifact(str(project_root() / "data" / "demo_pool")).rows()
    rows = rows[:: max(1, len(rows) // n)][:n]
    url = str(folder / "pool")
    writer = ArtifactWriter(url, "pool", POOL, f"slice-{n}")
    writer.begin()
    shards = [writer.write_shard(i, pa.Table.from_pylist(rows[i * 16:(i + 1) * 16], schema=POOL))
              for i in range(-(-len(rows) // 16))]
    writer.finalize(shards, code_version="benchmark")
    return url


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="rde-orch-"))
    pool = slice_pool(args.images, work)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = up(StackConfig(port=port, folder=work / "stack"))
    deployed, direct, pickup = [], [], []
    try:
        for i in range(args.repeats):
            overrides = {"input": {"kind": "pool", "path": pool}, "ingest": {"shard_size": 16}}
            params = {"until": "denoise", "output_root": str(work / f"dep-{i}"), "overrides": overrides}
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "build-secmm/demo", "--params",
                            json.dumps(params), "--watch"], env=cfg.env(), check=True, capture_output=True)
            deployed.append(time.monotonic() - start)
            [run] = httpx.post(f"{cfg.api_url}/flow_runs/filter", json={"sort": "START_TIME_DESC", "limit": 1}).json()
            created = datetime.fromisoformat(run["created"])
            started = datetime.fromisoformat(run["start_time"])
            pickup.append((started - created).total_seconds())
            start = time.monotonic()
            subprocess.run([sys.executable, "-m", "entry.cli", "build-secmm", "--until", "denoise", "--input", pool,
                            "--set", "ingest.shard_size=16", "--output", str(work / f"direct-{i}")],
                           check=True, capture_output=True, cwd=project_root())
            direct.append(time.monotonic() - start)
    finally:
        down(cfg)
    d, r = statistics.median(deployed), statistics.median(direct)
    print(f"build-secmm --until denoise on {args.images} images, {args.repeats} runs each (median):")
    print("\n| path | seconds | of which: submission → flow start |\n|---|---|---|")
    print(f"| deployment through the cpu worker | {d:.1f} | {statistics.median(pickup):.1f} |")
    print(f"| direct (`rde build-secmm`, ephemeral Prefect) | {r:.1f} | - |")
    print(f"\nratio deployment / direct: {d / r:.2f}")


if __name__ == "__main__":
    main()
