"""``rde evaluate`` at 10k and 100k gallery images: its peak memory and its time against embedding the
gallery alone, measured side by side in one run.

The galleries are synthetic scale pools (``entry.synth_pool``: the demo crops moved, rescaled,
recoloured; each keeps its source's identity), written as benchmark dataset folders (``gallery/``,
``queries/``, ``qrels/`` Parquet files, shards of ``--shard-size``): ``--queries`` queries, each
relevant to up to 50 images of one identity of its domain. The model is a CLIP built from config and
saved to a folder (``transformers-clip:<folder>``: the real loading and encoding path; random weights,
as speed does not depend on them), of the size ``--clip`` gives. Each measurement runs in a process
of its own, against one Prefect server started for the benchmark (its start is not the evaluation's):

- ``embed``: the gallery alone: every shard read, decoded and encoded by the model, nothing kept;
- ``evaluate``: the whole ``evaluate`` flow (embed-gallery per shard, score with the streamed
  ranking, compare, the report files), in a fresh output folder.

Printed per size: each process's wall seconds and peak RSS, evaluate / embed (target ≤ 1.15), and
the 100k / 10k peak RSS of the evaluation (target ≤ 1.2).

    .venv/bin/python benchmarks/evaluate_scale.py [--sizes 10000 100000] [--queries 200] [--work DIR]
        [--clip WIDTH LAYERS IMAGE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, resource, sys, time
mode, bench, model, out = sys.argv[1:5]
start = time.perf_counter()
if mode == "embed":
    import pyarrow.parquet as pq
    from rde.common.image_decoding import decode_rgb
    from rde.profile import load_profile
    from rde.evaluation.retrievers import load_retriever, parse_retriever
    expert = load_retriever(parse_retriever(model), load_profile("demo"))
    count = 0
    for path in sorted((__import__("pathlib").Path(bench) / "gallery").glob("*.parquet")):
        column = pq.read_table(path, columns=["image_bytes"]).column("image_bytes")
        images = [decode_rgb(b) for b in column.to_pylist()]
        count += len(expert.encode_image(images))
        del images, column
else:
    from flows.evaluate import evaluate
    summary = evaluate(profile="demo", output_root=out, benchmark=bench, models=[model])
    count = next(s["input"] for s in summary["stages"] if s["stage"].startswith("embed-gallery"))
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "items": count,
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def write_benchmark(pool_url: str, folder: Path, queries: int, seed: int = 0) -> None:
    """A benchmark dataset folder over a pool artifact, one gallery file per pool shard (streamed)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from storage import Artifact

    if (folder / "qrels" / "part-00000.parquet").exists():
        return
    pool = Artifact(pool_url)
    members: dict[tuple[str, str], list[str]] = {}
    for name in ("gallery", "queries", "qrels"):
        (folder / name).mkdir(parents=True, exist_ok=True)
    for index, table in pool.iter_shards(["pool_id", "domain", "identity", "image_bytes"]):
        ids = [f"img{p.split(':')[1]}" for p in table.column("pool_id").to_pylist()]
        for item, domain, ident in zip(ids, table.column("domain").to_pylist(), table.column("identity").to_pylist(),
                                       strict=True):
            if ident and len(members.setdefault((domain, ident), [])) < 50:
                members[(domain, ident)].append(item)
        out = pa.table({"image_id": ids, "domain": table.column("domain"), "image_bytes": table.column("image_bytes")})
        pq.write_table(out, folder / "gallery" / f"part-{index:05d}.parquet")
    rng = np.random.default_rng(seed)
    groups = sorted(members)
    picked = [groups[i] for i in rng.choice(len(groups), size=queries, replace=len(groups) < queries)]
    words = ("black", "white", "red", "blue", "gray", "green")
    query_rows = [{"query_id": f"q{n:04d}", "domain": d, "text": f"a {words[n % len(words)]} {d} number {n}"}
                  for n, (d, _) in enumerate(picked)]
    qrel_rows = [{"query_id": f"q{n:04d}", "image_id": item, "relevant": True, "verified": True}
                 for n, key in enumerate(picked) for item in members[key]]
    pq.write_table(pa.Table.from_pylist(query_rows), folder / "queries" / "part-00000.parquet")
    pq.write_table(pa.Table.from_pylist(qrel_rows), folder / "qrels" / "part-00000.parquet")


def measure(mode: str, bench: Path, model: str, out: Path, env: dict[str, str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", CHILD, mode, str(bench), model, str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=7200)
    if done.returncode:
        raise SystemExit(f"{mode} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--shard-size", type=int, default=2000)
    parser.add_argument("--work", type=Path, default=None, help="Keep the pools and benchmarks here (reused).")
    parser.add_argument("--clip", type=int, nargs=3, default=[64, 2, 64], metavar=("WIDTH", "LAYERS", "IMAGE"),
                        help="The CLIP's vision width, layers and image size (patches of 16 pixels): its cost per "
                             "image, which sets how much of the evaluation the embedding is.")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from entry import temporary_server
    from entry.synth_pool import SynthParams, write_synth_pool
    from entry.tiny_models import build_tiny_clip

    work = args.work or Path(tempfile.mkdtemp(prefix="rde-evaluate-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    width, layers, image = args.clip
    clip = work / f"clip-{width}-{layers}-{image}"
    if not (clip / "config.json").exists():
        build_tiny_clip(clip, width=width, layers=layers, heads=2, image_size=image, patch_size=16)
    model = f"transformers-clip:{clip}"
    env = {**os.environ, "PREFECT_API_URL": temporary_server.start(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    results = {}
    for n in args.sizes:
        pool = work / f"pool-{n}"
        write_synth_pool(str(ROOT / "data" / "demo_pool"), str(pool), SynthParams(n=n, shard_size=args.shard_size))
        bench = work / f"bench-{n}" / "benchmark"
        write_benchmark(str(pool), bench, args.queries)
        embed = measure("embed", bench, model, work / "unused", env)
        out = work / f"out-{n}-{time.time_ns()}"
        whole = measure("evaluate", bench, model, out, env)
        results[n] = {"embed": embed, "evaluate": whole, "ratio": whole["seconds"] / embed["seconds"]}
        print(f"N={n}: embed {embed['seconds']:.1f} s ({embed['peak_rss_mb']:.0f} MB), evaluate "
              f"{whole['seconds']:.1f} s ({whole['peak_rss_mb']:.0f} MB): evaluate / embed = {results[n]['ratio']:.3f}",
              flush=True)
    temporary_server.stop()
    if len(args.sizes) >= 2:
        small, large = min(args.sizes), max(args.sizes)
        rss = results[large]["evaluate"]["peak_rss_mb"] / results[small]["evaluate"]["peak_rss_mb"]
        print(f"peak RSS of the evaluation, {large} / {small}: {rss:.3f} (target ≤ 1.2); evaluate / embed at {large}: "
              f"{results[large]['ratio']:.3f} (target ≤ 1.15)")
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
