"""How time and memory grow with the pool: ``build-secmm --until candidates`` on synthetic pools of
N images (``rde pool synth``), one CLI process per N, run back to back in one invocation.

For each N: seconds per stage (from the run's summary) and images per second of the per-shard
stages (ingest, measure) and of the whole-pool stages that touch every image (denoise, CGDS), and
the run's peak RSS (the CLI process and its children, sampled every 0.2 s with psutil). The
generator work (caption pool, DAP) does not grow with N — it captions a fixed sample per domain
and writes a fixed number of queries — so it runs with a small fixed budget
(``--caption-sample``, ``--rounds``) with the demo's real SmolLM2, and is reported, not judged.
Targets (issue 15): peak RSS at the largest N ≤ 1.5 × at the middle one; the per-image time of
every per-shard stage within ±25 % across N; the growth exponent of CGDS (embedding + k-means)
and MECF (whose gallery is bounded by the draw, so it should not grow).

    .venv/bin/python benchmarks/scale.py [--sizes 1000 10000 100000] [--workdir /tmp/rde-scale]

A size already measured in the workdir (``result-N.json``) is not run again; the table covers every
size measured there, so sizes can be added in later invocations on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
PER_IMAGE = ("ingest", "measure", "denoise", "cgds")


def peak_rss(proc: subprocess.Popen, stop: threading.Event, out: list[int]) -> None:
    """Largest summed RSS of ``proc`` and its children until ``stop``."""
    try:
        root = psutil.Process(proc.pid)
    except psutil.NoSuchProcess:
        return
    best = 0
    while not stop.is_set():
        try:
            total = root.memory_info().rss + sum(c.memory_info().rss for c in root.children(recursive=True))
            best = max(best, total)
        except psutil.Error:
            pass
        time.sleep(0.2)
    out.append(best)


def run_cli(args: list[str], log: Path) -> tuple[float, int, str]:
    """Run ``rde`` with ``args``; wall seconds, peak RSS and stdout (the JSON summary)."""
    stop, peak = threading.Event(), []
    start = time.perf_counter()
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "rde.entry.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
                                stderr=err, text=True)
        sampler = threading.Thread(target=peak_rss, args=(proc, stop, peak), daemon=True)
        sampler.start()
        out, _ = proc.communicate()
        stop.set()
        sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"rde {' '.join(args)} failed (exit {proc.returncode}); see {log}")
    return time.perf_counter() - start, peak[0] if peak else 0, out


def exponent(ns: list[int], ts: list[float]) -> float:
    """Least-squares slope of log t on log N (t ∝ N^b)."""
    xs, ys = [math.log(n) for n in ns], [math.log(max(t, 1e-6)) for t in ts]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000])
    parser.add_argument("--workdir", default="/tmp/rde-scale")
    parser.add_argument("--shard-size", type=int, default=256, help="ingest.shard_size (images per shard)")
    parser.add_argument("--caption-sample", type=int, default=16, help="queries.caption_sample_per_domain")
    parser.add_argument("--rounds", type=int, default=2, help="queries.max_rounds")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    for n in args.sizes:
        if (work / f"result-{n}.json").exists():
            print(f"N={n}: measured before in {work} (result-{n}.json); delete it and out-{n}/ to measure again")
            continue
        pool = work / f"pool-{n}"
        if not (pool / "_manifest.json").exists():
            synth_s, _, _ = run_cli(["pool", "synth", "--n", str(n), "--out", str(pool), "--shard-size",
                                     str(args.shard_size)], work / f"synth-{n}.log")
            print(f"synth pool of {n}: {synth_s:.0f} s", flush=True)
        out = work / f"out-{n}"
        wall, rss, text = run_cli(["build-secmm", "--input", str(pool), "--until", "candidates", "--output", str(out),
                                   "--json", "--set", f"ingest.shard_size={args.shard_size}",
                                   "--set", f"queries.caption_sample_per_domain={args.caption_sample}",
                                   "--set", f"queries.max_rounds={args.rounds}"], work / f"build-{n}.log")
        summary = json.loads(text)
        stages = {s["stage"]: s for s in summary["stages"]}
        result = {"n": n, "wall": wall, "rss": rss, "stages": stages, "accepted": summary["accepted"]}
        (work / f"result-{n}.json").write_text(json.dumps(result))
        print(f"N={n}: {wall:.0f} s, peak RSS {rss / 2**30:.2f} GiB, {summary['accepted']} accepted", flush=True)
    # every size measured in this workdir (so a large N can be added later to the same table)
    results = sorted((json.loads(p.read_text()) for p in work.glob("result-*.json")), key=lambda r: r["n"])
    names = list(results[0]["stages"])
    print("\n| stage | " + " | ".join(f"N={r['n']:,} s" for r in results) + " | "
          + " | ".join(f"N={r['n']:,} ms/image" for r in results) + " | growth exponent |")
    print("|---|" + "---|" * (2 * len(results) + 1))
    for name in names:
        secs = [r["stages"][name]["seconds"] for r in results]
        per = [1000 * s / r["n"] for s, r in zip(secs, results, strict=True)]
        cells = [f"{s:.1f}" for s in secs] + [f"{p:.2f}" if name in PER_IMAGE else "-" for p in per]
        grow = f"{exponent([r['n'] for r in results], secs):.2f}" if len(results) > 1 else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {grow} |")
    print("| **run (wall)** | " + " | ".join(f"{r['wall']:.0f}" for r in results) + " | "
          + " | ".join(f"{1000 * r['wall'] / r['n']:.1f}" for r in results) + " | "
          + (f"{exponent([r['n'] for r in results], [r['wall'] for r in results]):.2f}" if len(results) > 1 else "-")
          + " |")
    print("| **peak RSS (GiB)** | " + " | ".join(f"{r['rss'] / 2**30:.2f}" for r in results) + " | "
          + " | ".join("-" for _ in results) + " | "
          + (f"{exponent([r['n'] for r in results], [r['rss'] for r in results]):.2f}" if len(results) > 1 else "-")
          + " |")
    if len(results) > 1:
        spread = {name: [1000 * r["stages"][name]["seconds"] / r["n"] for r in results]
                  for name in ("ingest", "measure")}
        for name, per in spread.items():
            mid = sorted(per)[len(per) // 2]
            print(f"\n{name}: per-image time within {max(abs(p / mid - 1) for p in per):.0%} of its median across N "
                  "(target ±25 %)")
        print(f"peak RSS largest / previous N: {results[-1]['rss'] / max(results[-2]['rss'], 1):.2f} (target ≤ 1.5)")


if __name__ == "__main__":
    main()
