"""The parent's own CPU seconds per image of a fanned-out build-largefine, at two pool sizes, on a local stack.

One stack (``rde stack up``: server, ``cpu`` pool with ``--cpu-workers`` workers, ``gpu`` pool with
``--gpu-workers`` workers each running one flow run at a time, ``gpu`` limit = gpu workers). For each
N: a synthetic pool of N images (``rde pool synth``), then build-largefine on it with every per-shard
stage fanned out (``prefect.fanout``: GPU stages on run-shards/gpu, CPU stages on run-shards/cpu),
the captions from ``benchmarks/scripted_captioner.py`` (a deterministic OpenAI-compatible server in
this process; no LLM). The parent flow runs in a process of its own against the stack's API (as the
cpu-pool worker would run it), and its CPU seconds (user + system, of that process alone: its
children are the stack's workers' processes, not its own) are read from ``getrusage`` when it ends.
Printed per N: the parent's CPU seconds, per pool image and per captioned image, by stage (the
runner's ``cpu_seconds``), and the run's wall seconds. The target: the parent's CPU seconds per
image flat in N (its work per shard, not per image), so the 1.2M projection can divide by workers
everything but a parent that does not grow with the pool.

With ``--compare`` the smallest N is also built in one process without the stack (no fan-out) and
the two builds' outputs are compared: the accepted image ids, the neighbours and hard negatives,
the captions and rejected texts, and the dataset card's numbers (Table 1, per-source counts,
generators).

    .venv/bin/python benchmarks/parent_cpu.py [--sizes 2000 10000] [--cpu-workers 3] [--gpu-workers 3] [--compare]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pool_scaling import parent_flow, parent_summary
from scripted_captioner import ScriptedServer

ROOT = Path(__file__).resolve().parent.parent
CPU_STAGES = ("ingest", "select-images", "hard-negatives", "export-largefine", "export-webdataset")


def _params(pool: Path, out: Path, spec: dict[str, Any], args: argparse.Namespace, fanout: bool) -> dict[str, Any]:
    return {"output_root": str(out),
            "overrides": {"input": {"kind": "pool", "path": str(pool)}, "ingest": {"shard_size": args.shard_size},
                          "models": {"generators": [spec], "template_generator": spec},
                          "largefine": {"shard_size": args.caption_shard_size, "tier_prompt": "gtr_tiers"},
                          "prefect": {"fanout": {"enabled": fanout, "cpu_deployment": "run-shards/cpu",
                                                 "shards_per_run": args.per_run, "poll_s": 2.0,
                                                 "stale_after_s": 300.0}}}}


def _run_parent(params: dict[str, Any], env: dict[str, str], log: Path) -> tuple[dict[str, Any], float, float]:
    """The parent flow in a child process; (its summary, its CPU seconds, wall seconds)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    with open(log, "w") as err:
        done = subprocess.run([sys.executable, __file__, "--parent", json.dumps(params)], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=err, text=True, timeout=4 * 3600)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise SystemExit(f"the parent flow failed (exit {done.returncode}); see {log}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    summary = parent_summary(done.stdout)
    return summary, cpu, wall


def _outputs(root: Path) -> dict[str, Any]:
    """What two builds of one pool must agree on, read from their artifacts."""
    from storage import Artifact

    def rows(name: str, columns: list[str]) -> list:
        return sorted(json.dumps([r[c] for c in columns]) for r in Artifact(str(root / name)).rows(columns))

    card = json.loads((root / "card.json").read_text())
    return {"accepted": rows("accepted", ["image_id"]),
            "neighbours": rows("neighbours", ["image_id", "neighbour_ids", "hard_negative_id"]),
            "captions": rows("largefine", ["image_id", "tier", "text"]),
            "caption_rejects": rows("caption_rejects", ["input_id", "reason"]),
            "card": {k: card.get(k) for k in ("table1", "per_source", "generators")}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000])
    parser.add_argument("--cpu-workers", type=int, default=3)
    parser.add_argument("--gpu-workers", type=int, default=3)
    parser.add_argument("--shard-size", type=int, default=256, help="ingest.shard_size (images per shard)")
    parser.add_argument("--caption-shard-size", type=int, default=64, help="largefine.shard_size")
    parser.add_argument("--per-run", type=int, default=4, help="prefect.fanout.shards_per_run")
    parser.add_argument("--compare", action="store_true", help="also build the smallest N in one process and "
                        "compare the outputs")
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--parent", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.parent:
        parent_flow(args.parent)
        return

    from entry.stack import StackConfig, down, free_port, up

    base = Path(args.workdir or tempfile.mkdtemp(prefix="rde-parent-cpu-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    with ScriptedServer() as server:
        spec = server.spec()
        cfg = StackConfig(port=free_port(), folder=base / "stack", gpu_workers=args.gpu_workers,
                          workers_per_pool=args.cpu_workers, gpu_worker_limit=1)
        up(cfg)
        try:
            for n in args.sizes:
                pool = base / f"pool-{n}"
                if not (pool / "_manifest.json").exists():
                    subprocess.run([sys.executable, "-m", "entry.cli", "pool", "synth", "--n", str(n), "--out",
                                    str(pool), "--shard-size", str(args.shard_size)], cwd=ROOT, check=True,
                                   capture_output=True)
                env = {**cfg.env(), "RDE_STATE_DIR": str(base / f"state-{n}")}
                summary, cpu, wall = _run_parent(_params(pool, base / f"fan-{n}", spec, args, True), env,
                                                 base / f"parent-{n}.log")
                stages = {s["stage"]: s for s in summary["stages"]}
                captioned = stages["select-images"]["accepted"]
                row = {"n": n, "captioned": captioned, "parent_cpu_s": round(cpu, 1), "wall_s": round(wall, 1),
                       "ms_per_image": round(1000 * cpu / n, 3), "ms_per_captioned": round(1000 * cpu / captioned, 3),
                       "stages_cpu_s": {s: v["cpu_seconds"] for s, v in stages.items()},
                       "balanced": summary["balanced"]}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            down(cfg)
        if args.compare:
            n = min(args.sizes)
            env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
            summary, cpu, wall = _run_parent(_params(base / f"pool-{n}", base / f"one-{n}", spec, args, False),
                                             {**env, "RDE_STATE_DIR": str(base / "state-one")}, base / "one.log")
            fanned = _outputs(base / f"fan-{n}" / "build-largefine" / "demo")
            alone = _outputs(base / f"one-{n}" / "build-largefine" / "demo")
            same = {k: fanned[k] == alone[k] for k in fanned}
            print(json.dumps({"n": n, "one_process_cpu_s": round(cpu, 1), "one_process_wall_s": round(wall, 1),
                              "identical": same, "counts": {k: len(v) for k, v in fanned.items() if k != "card"}}),
                  flush=True)
    print(f"\nbuild-largefine, every per-shard stage fanned out ({args.cpu_workers} cpu + {args.gpu_workers} gpu "
          f"workers, {args.per_run} shards per run; os.cpu_count() = {os.cpu_count()})\n")
    stage_names = list(rows[0]["stages_cpu_s"])
    print("| N | captioned | parent CPU (s) | per pool image (ms) | per captioned image (ms) | run wall (s) | "
          + " | ".join(stage_names) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(stage_names))
    for r in rows:
        print(f"| {r['n']:,} | {r['captioned']:,} | {r['parent_cpu_s']} | {r['ms_per_image']} | "
              f"{r['ms_per_captioned']} | {r['wall_s']} | "
              + " | ".join(f"{r['stages_cpu_s'].get(s, 0):.1f}" for s in stage_names) + " |")
    (base / "result.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
