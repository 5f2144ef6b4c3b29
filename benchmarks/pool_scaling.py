"""Shard fan-out over 1, 2 and 3 gpu workers, back to back on this machine.

For each worker count N: a fresh local stack (``rde stack up``: server, ``gpu`` pool with N
workers each running one flow run at a time, ``gpu`` limit N), then build-largefine up to the Q&A
tiers on a slice of the demo pool with the qa-tiers stage fanned out (``prefect.fanout``) and an
OpenAI-compatible stub generator answering after a fixed delay (the stand-in for a GPU
generator's latency; tests/pool_checks.py). The parent flow runs in a process of its own against
the stack's API (not on a worker, so all N workers serve shard ranges). Printed per N: the
qa-tiers stage's seconds and images/s, the ratio to one worker, the whole run's seconds, and the
fan-out's own overhead — submission to the first shard-range run's start (worker poll + process
start), and the median start cost of a run once a worker is free (its start minus the later of
its creation and the previous run's end).

    .venv/bin/python benchmarks/pool_scaling.py [--workers 1 2 3] [--images 48] [--delay 2.0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime
from pathlib import Path

from models.backends.disk_memo import keep_nothing_on_disk

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))  # the stub generator and the stack's REST helpers


def _slice_pool(folder: Path, count: int) -> str:
    """Every 7th image of the demo pool (crops and filter exercises), ``count`` of them."""
    import pyarrow as pa

    from storage import Artifact, ArtifactWriter
    from storage.schemas import POOL

    rows = Artifact(str(ROOT / "data" / "demo_pool")).rows()[::7][:count]
    url = str(folder / "pool")
    writer = ArtifactWriter(url, "pool", POOL, "pool-scaling")
    writer.begin()
    shards = [writer.write_shard(i, pa.Table.from_pylist(rows[at:at + 16], schema=POOL))
              for i, at in enumerate(range(0, len(rows), 16))]
    writer.finalize(shards, code_version="bench")
    return url


def _parse(stamp: str | None) -> datetime | None:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")) if stamp else None


def _overheads(cfg) -> dict[str, float]:
    """Submission to the first shard-range run's start, and the median wait of a run for a worker:
    its start minus the later of its creation and the last end of a run before it (a worker's
    poll, then the flow-run process's start and imports)."""
    from stack_checks import api

    runs = api(cfg, "/flow_runs/filter", {"flows": {"name": {"any_": ["run-shards"]}}, "sort": "START_TIME_ASC"})
    spans = [(_parse(r["created"]), _parse(r["start_time"]), _parse(r["end_time"])) for r in runs if r["start_time"]]
    first_pickup = (min(s for _, s, _ in spans) - min(c for c, _, _ in spans)).total_seconds() if spans \
        else float("nan")
    waits = []
    for created, start, _ in spans:
        ended = [e for _, _, e in spans if e and e <= start]
        waits.append((start - max([created, *ended])).total_seconds())
    return {"runs": len(runs), "submission_to_first_run_start_s": round(first_pickup, 2),
            "run_start_after_a_free_worker_s": round(statistics.median(waits), 2) if waits else float("nan")}


def parent_flow(params_json: str) -> None:
    """The parent flow, in this process (``--parent``), printing its summary as JSON."""
    from flows.build_largefine import build_largefine

    params = json.loads(params_json)
    summary = build_largefine(profile="demo", **params)
    print("SUMMARY " + json.dumps(summary, default=str), flush=True)


def parent_summary(stdout: str) -> dict:
    """The summary :func:`parent_flow` printed, from its process's stdout."""
    return json.loads(stdout[stdout.rindex("SUMMARY ") + 8:].splitlines()[0])


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--images", type=int, default=48, help="images captioned (of a 96-image slice)")
    parser.add_argument("--shard-size", type=int, default=4)
    parser.add_argument("--per-run", type=int, default=2, help="shards per shard-range run")
    parser.add_argument("--delay", type=float, default=2.0, help="the stub generator's seconds per request")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--parent", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parent:
        parent_flow(args.parent)
        return

    from pool_checks import fanout_params, stub_server

    from entry.stack import StackConfig, down, free_port, up

    base = Path(tempfile.mkdtemp(prefix="rde-pool-scaling-"))
    pool = _slice_pool(base, 96)
    rows = []
    with stub_server(args.delay) as stub:
        for n in args.workers:
            cfg = StackConfig(port=free_port(), folder=base / f"stack-{n}", gpu_workers=n, gpu_worker_limit=1)
            up(cfg)
            try:
                params = fanout_params(base / f"out-{n}", pool, stub.base_url, images=args.images,
                                       shard_size=args.shard_size, per_run=args.per_run, stale_after_s=300)
                params.pop("output_root")
                done = subprocess.run([sys.executable, __file__, "--parent",
                                       json.dumps({**params, "output_root": str(base / f"out-{n}")})],
                                      env={**cfg.env(), "RDE_STATE_DIR": str(base / f"state-{n}")},
                                      capture_output=True, text=True, timeout=3600, cwd=ROOT)
                if done.returncode != 0:
                    raise SystemExit(f"the parent flow failed with {n} workers:\n{(done.stdout + done.stderr)[-3000:]}")
                summary = parent_summary(done.stdout)
                stages = {s["stage"]: s for s in summary["stages"]}
                tiers = stages["qa-tiers"]
                row = {"workers": n, "qa_tiers_s": tiers["seconds"],
                       "images_per_s": round(args.images / tiers["seconds"], 3),
                       "run_s": round(sum(s["seconds"] for s in summary["stages"]), 1),
                       "balanced": summary["balanced"], **_overheads(cfg)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            finally:
                down(cfg)
    one = next((r for r in rows if r["workers"] == 1), rows[0])
    print(f"\nqa-tiers fanned out: {args.images} images, shards of {args.shard_size}, {args.per_run} shards per run, "
          f"stub delay {args.delay} s per request (os.cpu_count() = {os.cpu_count()})\n")
    print("| gpu workers | qa-tiers (s) | images/s | speed-up vs 1 | shard-range runs "
          "| submission → first run start (s) | run start after a worker frees (median s) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['workers']} | {r['qa_tiers_s']:.1f} | {r['images_per_s']:.2f} | "
              f"{one['qa_tiers_s'] / r['qa_tiers_s']:.2f}× | {r['runs']} | {r['submission_to_first_run_start_s']} | "
              f"{r['run_start_after_a_free_worker_s']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
