"""Cached reranker cost on the CPU, measured side by side in one run (VEDJE Sec. 4.7 protocol).

1. Complete-query latency, one query per batch: stage-1 text encoding + search over the clip
   index, then fetch of the top-N_c caches (encoded bytes held in memory, decoded to FP32) and
   joint scoring of all N_c pairs in one forward. Three conditions alternate query by query:
   stage 1 alone, the reference complete query (per-item decode, the encoder's full forward under
   no_grad: the path before issue 17) and the optimised one (``rerank``'s path now: one vectorised
   decode, ``JointReranker.score_fast`` under inference mode), with their ratio to stage 1 and the
   largest score difference between the two. Median over ``--runs`` queries after ``--warmup``, for
   N_c = 20 / 100 and M = 4 / 1 (T = 8 frames); cache bytes read per query. Weights are the demo
   architecture at initialisation: latency does not depend on trained values.
2. The options tried, on the scoring step alone (M = 4, N_c = 20): inference mode, dynamic int8
   quantisation of the Linear layers, ``score_fast``, one thread; per-item vs vectorised decode.
3. Indexing throughput (items/s): frames → frozen backbone → compressor → encoded cache rows,
   against the bare backbone forward on the same frames, alternated ``--repeats`` times.

    .venv/bin/python benchmarks/vedje_latency.py [--runs 100] [--warmup 10] [--items 24] [--skip-indexing]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from models.backends.registry import ModelRegistry
from models.reranker.cache_codec import decode
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


def _stage1(stage1, emb: torch.Tensor, text: str, n_c: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Stage 1 as ``rerank`` runs it: text encoding + exhaustive cosine search, top-N_c."""
    q = torch.from_numpy(stage1.encode_text([text]))
    sims = (q @ emb.T)[0]
    top = torch.argsort(sims, descending=True, stable=True)[:n_c]
    return top, sims[top]


def _reference_fetch(index: CacheIndex, item_ids: list[str]) -> torch.Tensor:
    """The fetch before this change: every candidate's bytes decoded one by one, then stacked."""
    assert index.shape is not None
    return torch.from_numpy(np.stack([decode(index.encoded(i), index.shape, index.precision) for i in item_ids]))


def _query(path: str, model, stage1, emb, ids, index, text: str, n_c: int) -> tuple[float, float, float, np.ndarray]:
    """One complete query on ``path`` ('reference' | 'fast'): (total, fetch, scoring) seconds, scores."""
    t0 = time.perf_counter()
    top, rho = _stage1(stage1, emb, text, n_c)
    t1 = time.perf_counter()
    cand = [ids[int(i)] for i in top]
    caches = _reference_fetch(index, cand) if path == "reference" else index.fetch(cand)
    t2 = time.perf_counter()
    s = joint_scores(model, [text], [(0, j) for j in range(len(cand))], caches, rho, 256, path)
    t3 = time.perf_counter()
    return t3 - t0, t2 - t1, t3 - t2, s


def latency(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    """Stage 1 alone, the reference complete query and the optimised one, alternated per query."""
    queries = [data.items.query_texts[q] for q in range(len(data.items.query_texts))]
    emb = data.item_emb
    ids = data.items.item_ids
    print(f"\n## complete-query latency (CPU, {torch.get_num_threads()} threads; {len(ids)} indexed clips, T=8; "
          f"median of {args.runs} after {args.warmup} warm-up; the three conditions alternate per query)\n")
    print("reference = per-item decode + the encoder's full forward (no_grad); optimised = the `rerank` path now: "
          "one vectorised decode + `score_fast` under inference mode.\n")
    print("| M | N_c | stage 1 alone (ms) | reference: complete (ms) | ratio | fetch | scoring "
          "| optimised: complete (ms) | ratio | fetch | scoring | speed-up | max abs Δscore | cache bytes / query |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m in (4, 1):
        torch.manual_seed(0)
        model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8, emb.shape[1],
                            tokens_per_frame=m).eval()
        index = build_index(model, data, f"{tmp}/cache-m{m}")
        for n_c in (20, 100):
            first, nbytes, delta = [], [], 0.0
            runs: dict[str, list[tuple[float, float, float]]] = {"reference": [], "fast": []}
            for k in range(args.warmup + args.runs):
                text = queries[k % len(queries)]
                order = ("stage1", "reference", "fast") if k % 2 else ("fast", "reference", "stage1")
                scores = {}
                before = index.stats.bytes
                for cond in order:
                    if cond == "stage1":
                        t0 = time.perf_counter()
                        _stage1(stage1, emb, text, n_c)
                        took = time.perf_counter() - t0
                        if k >= args.warmup:
                            first.append(took)
                    else:
                        *times, scores[cond] = _query(cond, model, stage1, emb, ids, index, text, n_c)
                        if k >= args.warmup:
                            runs[cond].append(tuple(times))
                delta = max(delta, float(np.abs(scores["fast"] - scores["reference"]).max()))
                if k >= args.warmup:
                    nbytes.append(index.stats.bytes - before)
            f = statistics.median(first) * 1e3
            cells = []
            for cond in ("reference", "fast"):
                total, fetch, score = (statistics.median(t[j] for t in runs[cond]) * 1e3 for j in range(3))
                cells.append((total, f"{total:.2f} | {total / f:.2f} | {fetch:.2f} | {score:.2f}"))
            print(f"| {m} | {n_c} | {f:.2f} | {cells[0][1]} | {cells[1][1]} | {cells[0][0] / cells[1][0]:.2f}× | "
                  f"{delta:.1e} | {int(np.median(nbytes)):,} |")


def options(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    """The options tried, on the scoring step alone (M = 4, N_c = 20) and on the fetch (N_c = 100),
    alternated per repetition; Δ = max |score − reference score| and the share of queries whose
    candidate order is unchanged."""
    import copy
    import warnings

    torch.manual_seed(0)
    emb, ids = data.item_emb, data.items.item_ids
    model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8, emb.shape[1],
                        tokens_per_frame=4).eval()
    index = build_index(model, data, f"{tmp}/cache-options")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        int8 = copy.deepcopy(model)
        int8.reranker = torch.ao.quantization.quantize_dynamic(int8.reranker, {torch.nn.Linear}, dtype=torch.qint8)
    reranker = model.reranker
    queries = [data.items.query_texts[q] for q in range(0, len(data.items.query_texts), 7)][:args.runs]
    inputs = []
    for text in queries:
        top, rho = _stage1(stage1, emb, text, 20)
        inputs.append((reranker.tokenize([text]), index.fetch([ids[int(i)] for i in top]), rho))
    rows = torch.zeros(20, dtype=torch.long)

    def threads(n: int, fn):
        def run(t, c, r):
            old = torch.get_num_threads()
            torch.set_num_threads(n)
            try:
                return fn(t, c, r)
            finally:
                torch.set_num_threads(old)
        return run

    conds = {
        "reference forward, no_grad (before)": torch.no_grad()(lambda t, c, r: reranker.score(t, rows, c, r)),
        "reference forward, inference_mode": torch.inference_mode()(lambda t, c, r: reranker.score(t, rows, c, r)),
        "reference forward, dynamic int8 Linear": torch.inference_mode()(
            lambda t, c, r: int8.reranker.score(t, rows, c, r)),
        "score_fast, inference_mode (kept)": torch.inference_mode()(lambda t, c, r: reranker.score_fast(t, rows, c, r)),
        "score_fast, 1 thread": threads(1, torch.inference_mode()(lambda t, c, r: reranker.score_fast(t, rows, c, r))),
    }
    ref = [conds["reference forward, no_grad (before)"](*x) for x in inputs]
    times: dict[str, list[float]] = {k: [] for k in conds}
    delta = {k: 0.0 for k in conds}
    same_order = {k: 0 for k in conds}
    for rep in range(args.option_repeats):
        for name, fn in (conds.items() if rep % 2 else reversed(conds.items())):
            for qi, x in enumerate(inputs):
                t0 = time.perf_counter()
                s = fn(*x)
                if rep > 0:
                    times[name].append(time.perf_counter() - t0)
                if rep == 1:
                    delta[name] = max(delta[name], float((s - ref[qi]).abs().max()))
                    same_order[name] += int(torch.equal(torch.argsort(s), torch.argsort(ref[qi])))
    print(f"\n## options tried: joint scoring of N_c = 20 pairs, M = 4 ({len(inputs)} queries × "
          f"{args.option_repeats - 1} alternated repetitions, median)\n")
    spread = float(torch.stack(ref).std(dim=1).mean())
    print(f"reference scores: std within a query {spread:.3g} (weights at initialisation)\n")
    print("| option | scoring (ms) | vs before | max abs Δscore | same candidate order |\n|---|---|---|---|---|")
    base = statistics.median(times["reference forward, no_grad (before)"])
    for name in conds:
        t = statistics.median(times[name])
        print(f"| {name} | {t * 1e3:.2f} | {base / t:.2f}× | {delta[name]:.1e} | "
              f"{same_order[name]}/{len(inputs)} |")
    cand = [ids[i] for i in range(min(100, len(ids)))]
    dec: dict[str, list[float]] = {"per-item decode + stack (before)": [], "one vectorised decode (kept)": []}
    for rep in range(3 * args.option_repeats):
        for name in (dec if rep % 2 else reversed(dec)):
            t0 = time.perf_counter()
            _reference_fetch(index, cand) if name.startswith("per-item") else index.fetch(cand)
            dec[name].append(time.perf_counter() - t0)
    print(f"\n| cache fetch of {len(cand)} BF16 caches | ms |\n|---|---|")
    for name, t in dec.items():
        print(f"| {name} | {statistics.median(t) * 1e3:.2f} |")


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
    parser.add_argument("--option-repeats", type=int, default=4)
    parser.add_argument("--skip-indexing", action="store_true", help="only the latency tables")
    args = parser.parse_args()
    import tempfile

    torch.set_num_threads(2)
    profile = load_profile("demo")
    data = cached_tensors("clips", "semantic-bridge")
    reg = ModelRegistry(profile.models)
    with tempfile.TemporaryDirectory() as tmp:
        stage1 = reg.expert(profile.models.experts[0])
        latency(args, profile.vedje, data, stage1, tmp)
        options(args, profile.vedje, data, stage1, tmp)
    if not args.skip_indexing:
        indexing(args, profile.vedje, data, reg.image_embedder())


if __name__ == "__main__":
    main()
