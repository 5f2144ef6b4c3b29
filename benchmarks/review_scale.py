"""The review at the paper's scale: a 50k-image, 200-query benchmark whose queries have 4,000
candidates each (the union of four experts' top-1000), against a tenth of its queries.

The gallery is ``--images`` synthetic images (``entry.synth_pool``: the demo crops, transformed
and seeded); the candidates are drawn per query (distinct images, a random non-empty set of four
experts, a best rank in 1..1000) and written as MECF writes them, one shard grouped by query. Each
size builds its review (``rde.secmm.review_site.build_review``, the code the export stage runs, fed
by the same record-batch reads) in a fresh process, which reports its build time and peak RSS. The
table gives both sizes side by side, their ratio, and what the review weighs: its data files, the
largest query's file, the thumbnails, the Label Studio tasks and one page's download.

    .venv/bin/python benchmarks/review_scale.py [--images 50000] [--queries 200] [--per-query 4000]
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
EXPERTS = ("semantic-bridge", "attributes", "vlm-embed", "jina-v4")


def write_gallery(url: str, n: int) -> None:
    """``n`` synthetic gallery images (image_id, image_bytes), in shards of 1,000."""
    import pyarrow as pa

    from entry.synth_pool import SynthParams, load_sources, synth_row
    from storage import ArtifactWriter, content_key

    schema = pa.schema([pa.field("image_id", pa.string()), pa.field("image_bytes", pa.binary())])
    sources, params = load_sources(str(ROOT / "data" / "demo_pool")), SynthParams(n=n)
    writer = ArtifactWriter(url, "gallery", schema, content_key(kind="review-scale-gallery", n=n))
    writer.begin()
    shards = []
    for index, start in enumerate(range(0, n, 1000)):
        rows = [synth_row(sources, i, params) for i in range(start, min(n, start + 1000))]
        shards.append(writer.write_shard(index, pa.Table.from_pylist(
            [{"image_id": f"img{start + k:06d}", "image_bytes": r["image_bytes"]} for k, r in enumerate(rows)],
            schema=schema)))
    writer.finalize(shards, code_version="benchmark")


def write_candidates(url: str, images: int, queries: int, per_query: int) -> None:
    """One shard of ``queries × per_query`` candidates grouped by query, as MECF writes them."""
    import numpy as np
    import pyarrow as pa

    from storage import ArtifactWriter, content_key
    from storage.schemas import CANDIDATES

    rng = np.random.default_rng(0)
    columns: dict[str, list] = {name: [] for name in CANDIDATES.names}
    for q in range(queries):
        for item in rng.choice(images, size=per_query, replace=False):
            chosen = [e for e in EXPERTS if rng.random() < 0.4] or [EXPERTS[int(rng.integers(4))]]
            ranks = [int(r) for r in rng.integers(1, 1001, size=len(chosen))]
            columns["query_id"].append(f"q{q:04d}")
            columns["image_id"].append(f"img{item:06d}")
            columns["domain"].append("pedestrian")
            columns["experts"].append(chosen)
            columns["ranks"].append(ranks)
            columns["scores"].append([1.0 - r / 1000 for r in ranks])
            columns["best_rank"].append(min(ranks))
    writer = ArtifactWriter(url, "candidates", CANDIDATES,
                            content_key(kind="review-scale-candidates", q=queries, k=per_query, n=images))
    writer.begin()
    writer.finalize([writer.write_shard(0, pa.Table.from_pydict(columns, schema=CANDIDATES))],
                    code_version="benchmark")


def build(candidates_url: str, gallery_url: str, folder: str, queries: int) -> dict:
    """Build one review (in this process) and report its time, peak RSS and sizes."""
    from rde.secmm.review_site import ReviewFiles, build_review
    from storage import Artifact

    started = time.perf_counter()
    texts = {f"q{q:04d}": {"query_id": f"q{q:04d}", "text": f"query number {q} in words", "domain": "pedestrian"}
             for q in range(queries)}
    counts = build_review(
        ReviewFiles(Path(folder), "scale", "scale-key"),
        (r for b in Artifact(candidates_url).iter_batches(["query_id", "image_id", "experts", "best_rank"])
         for r in b.to_pylist()), texts,
        (r for b in Artifact(gallery_url).iter_batches(["image_id", "image_bytes"], 256) for r in b.to_pylist()), {})
    seconds = time.perf_counter() - started
    return {**counts, "seconds": seconds, "peak_rss_mb": peak_rss_mb()}


def peak_rss_mb() -> float:
    """This process's peak resident set (``VmHWM``). Not ``getrusage``'s ``ru_maxrss``: Linux keeps that
    across ``execve``, so a child would report its parent's peak at the fork."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--images", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--per-query", type=int, default=4000)
    parser.add_argument("--work", type=Path, default=None, help="keep the inputs here (default: a temp folder)")
    parser.add_argument("--build", nargs=4, metavar=("CANDIDATES", "GALLERY", "FOLDER", "QUERIES"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.build:
        print(json.dumps(build(*args.build[:3], int(args.build[3]))))
        return
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        from storage import Artifact

        gallery = str(work / "gallery")
        started = time.perf_counter()
        if not Artifact(gallery).is_complete():
            write_gallery(gallery, args.images)
        print(f"gallery: {args.images} synthetic images ({time.perf_counter() - started:.0f} s)", file=sys.stderr)
        results = {}
        for queries in (max(1, args.queries // 10), args.queries):
            cands = str(work / f"candidates-{queries}")
            if not Artifact(cands).is_complete():
                write_candidates(cands, args.images, queries, args.per_query)
            folder = work / f"review-{queries}"
            shutil.rmtree(folder, ignore_errors=True)  # a fresh build: thumbnails written too
            done = subprocess.run([sys.executable, __file__, "--build", cands, gallery, str(folder), str(queries)],
                                  capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            result.update(data_mb=_size(folder / "data") / 2**20, images_mb=_size(folder / "images") / 2**20,
                          tasks_mb=_size(folder / "label_studio_tasks.json") / 2**20,
                          page_kb=48 * _size(folder / "images") / max(1, result["images"]) / 1024)
            results[queries] = result
            print(f"{queries} queries built", file=sys.stderr)
        small, full = results.values()
        rows = [("queries", "queries", "{:.0f}"), ("candidates", "candidates", "{:.0f}"),
                ("label_studio_tasks", "Label Studio tasks", "{:.0f}"), ("seconds", "build time (s)", "{:.1f}"),
                ("peak_rss_mb", "peak RSS (MB)", "{:.0f}"), ("data_mb", "review data files (MB)", "{:.1f}"),
                ("largest_query_file_bytes", "largest query file (KB)", "{:.0f}"),
                ("images_mb", "thumbnails (MB)", "{:.0f}"), ("tasks_mb", "label_studio_tasks.json (MB)", "{:.1f}"),
                ("page_kb", "one page of 48 thumbnails (KB)", "{:.0f}")]
        print(f"| | {small['queries']} queries | {full['queries']} queries | ratio |")
        print("|---|---:|---:|---:|")
        for key, label, fmt in rows:
            a, b = small[key], full[key]
            if key == "largest_query_file_bytes":
                a, b = a / 1024, b / 1024
            print(f"| {label} | {fmt.format(a)} | {fmt.format(b)} | {b / a if a else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
