"""Cached reranker cost on the CPU, measured side by side in one run (VEDJE Sec. 4.7 protocol).

1. Complete-query latency, one query per batch: stage-1 text encoding + search over the clip
   index, then fetch of the top-N_c caches (encoded bytes held in memory, decoded to FP32) and
   joint scoring of all N_c pairs in one forward. Median over ``--runs`` queries after
   ``--warmup`` warm-up queries, for N_c = 20 / 100 and M = 4 / 1 (T = 8 frames), next to stage 1
   alone in the same loop; cache bytes read per query. Weights are the demo architecture at
   initialisation: latency does not depend on trained values.
2. Indexing throughput (items/s): frames → frozen backbone → compressor → encoded cache rows,
   against the bare backbone forward on the same frames, alternated ``--repeats`` times.

    .venv/bin/python benchmarks/vedje_latency.py [--runs 100] [--warmup 10] [--items 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from models.backends.registry import ModelRegistry
from models.reranker.cache_store import CacheIndex, cache_rows
from rde.common.profiles import load_profile
from rde.vedje.features import cached_tensors
from rde.vedje.training import build_model, joint_scores
from storage import ArtifactWriter


def build_index(model, data, folder: str) -> CacheIndex:
    """Caches of every clip written as an artifact and read back like ``rerank`` does."""
    rows = list(range(len(data.items.item_ids)))
    z = np.concatenate([model.index(data.features(torch.tensor(rows[s:s + 32]))).numpy()
                        for s in range(0, len(rows), 32)])
    table = cache_rows(data.items.item_ids, z, model.shape.frames, model.shape.tokens_per_frame, "bf16")
    writer = ArtifactWriter(folder, "vedje_cache", table.schema, "bench")
    writer.begin()
    writer.finalize([writer.write_shard(0, table)], code_version="bench")
    return CacheIndex(folder)


def latency(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    queries = [data.items.query_texts[q] for q in range(len(data.items.query_texts))]
    emb = data.item_emb
    ids = data.items.item_ids
    print(f"\n## complete-query latency (CPU, {torch.get_num_threads()} threads; {len(ids)} indexed clips, T=8; "
          f"median of {args.runs} after {args.warmup} warm-up)\n")
    print("| M | N_c | stage 1 alone (ms) | complete query (ms) | ratio | cache fetch (ms) | joint scoring (ms) "
          "| cache bytes / query |\n|---|---|---|---|---|---|---|---|")
    for m in (4, 1):
        torch.manual_seed(0)
        model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8, emb.shape[1],
                            tokens_per_frame=m).eval()
        index = build_index(model, data, f"{tmp}/cache-m{m}")
        for n_c in (20, 100):
            first, full, fetch, score, nbytes = [], [], [], [], []
            for k in range(args.warmup + args.runs):
                text = queries[k % len(queries)]
                t0 = time.perf_counter()
                q = torch.from_numpy(stage1.encode_text([text]))
                top = torch.argsort((q @ emb.T)[0], descending=True)[:n_c]
                t1 = time.perf_counter()
                before = index.stats.bytes
                caches = index.fetch([ids[int(i)] for i in top])
                t2 = time.perf_counter()
                joint_scores(model, [text], [(0, j) for j in range(len(top))], caches, (q @ emb[top].T)[0], n_c)
                t3 = time.perf_counter()
                # stage 1 alone, measured in the same loop on the next query
                t4 = time.perf_counter()
                q2 = torch.from_numpy(stage1.encode_text([queries[(k + 1) % len(queries)]]))
                torch.argsort((q2 @ emb.T)[0], descending=True)[:n_c]
                t5 = time.perf_counter()
                if k >= args.warmup:
                    full.append(t3 - t0)
                    fetch.append(t2 - t1)
                    score.append(t3 - t2)
                    first.append(t5 - t4)
                    nbytes.append(index.stats.bytes - before)
            f, c = statistics.median(first) * 1e3, statistics.median(full) * 1e3
            print(f"| {m} | {n_c} | {f:.2f} | {c:.2f} | {c / f:.2f} | {statistics.median(fetch) * 1e3:.2f} | "
                  f"{statistics.median(score) * 1e3:.2f} | {int(np.median(nbytes)):,} |")


def indexing(args: argparse.Namespace, spec, data, backbone) -> None:
    torch.manual_seed(0)
    model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8,
                        data.item_emb.shape[1]).eval()
    rows = list(range(min(args.items, len(data.items.item_ids))))
    keys = sorted({k for r in rows for k in data.items.frames[r]})
    images = data.items.load_frames(keys)
    per_item = [[images[k] for k in data.items.frames[r]] for r in rows]
    bare, full = [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        for frames in per_item:
            backbone.feature_maps(frames)
        t1 = time.perf_counter()
        for r, frames in zip(rows, per_item, strict=True):
            x = torch.from_numpy(backbone.feature_maps(frames))[None]
            cache_rows([data.items.item_ids[r]], model.index(x).numpy(), 8, model.shape.tokens_per_frame, "bf16")
        t2 = time.perf_counter()
        bare.append(len(rows) / (t1 - t0))
        full.append(len(rows) / (t2 - t1))
    b, f = statistics.median(bare), statistics.median(full)
    print(f"\n## indexing throughput ({len(rows)} clips × 8 frames, median of {args.repeats})\n")
    print("| path | items/s | frames/s |\n|---|---|---|")
    print(f"| bare backbone forward | {b:.2f} | {8 * b:.1f} |")
    print(f"| index-cache path (backbone + compressor + BF16 rows) | {f:.2f} | {8 * f:.1f} |")
    print(f"\nratio index / bare: {f / b:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--items", type=int, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    import tempfile

    torch.set_num_threads(2)
    profile = load_profile("demo")
    data = cached_tensors("clips", "semantic-bridge")
    reg = ModelRegistry(profile.models)
    with tempfile.TemporaryDirectory() as tmp:
        latency(args, profile.vedje, data, reg.expert(profile.models.experts[0]), tmp)
    indexing(args, profile.vedje, data, reg.image_embedder())


if __name__ == "__main__":
    main()
