"""Cached reranker cost on the CPU, measured side by side in one run (VEDJE Sec. 4.7 protocol).

1. Complete-query latency, one query per batch: stage-1 text encoding + search over the clip
   index, then fetch of the top-N_c caches (encoded bytes held in memory, decoded to FP32) and
   joint scoring of all N_c pairs in one forward. Four conditions alternate query by query (their
   order rotated and reversed so none always follows another): stage 1 alone; the reference
   complete query (per-item decode, the encoder's full forward under no_grad: the former path);
   'fast' (one vectorised decode, ``JointReranker.score_fast`` in PyTorch under
   inference mode); 'onnx', the ``rerank`` path now (``vedje.score_path=onnx``: the same decode,
   ``score_fast``'s graph run by ONNX Runtime, ``models/reranker/onnx_scoring.py``). Each with its
   ratio to stage 1, the largest score difference to the reference and how many queries kept the
   reference's exact candidate order. Median over ``--runs`` queries after ``--warmup``, for
   N_c = 20 / 100 and M = 4 / 1 (T = 8 frames); cache bytes read per query; the one-off ONNX export
   is timed apart. Weights are the demo architecture at initialisation: latency does not depend on
   trained values.
2. The options tried, on the scoring step alone (M = 4, N_c = 20): inference mode, dynamic int8
   quantisation of the Linear layers, the reference forward exported to ONNX Runtime,
   ``score_fast`` in PyTorch (2 and 1 threads) and in ONNX Runtime (sleeping or spinning idle
   threads, 1 thread), ``--compile``: torch.compile; per-item vs vectorised decode.
3. ``--profile``: where a complete query's time goes by operator kind, PyTorch path and ONNX Runtime.
4. Indexing throughput (items/s): frames → frozen backbone → compressor → encoded cache rows,
   against the bare backbone forward on the same frames, alternated ``--repeats`` times.

    .venv/bin/python benchmarks/vedje_latency.py [--runs 100] [--warmup 10] [--items 24] [--skip-indexing]
        [--skip-options] [--profile] [--compile]
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
from models.reranker.onnx_scoring import score_onnx
from rde.profile import load_profile
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


PATHS = ("reference", "fast", "onnx")  # the three scoring paths of a complete query


def _query(path: str, model, stage1, emb, ids, index, text: str, n_c: int) -> tuple[float, float, float, np.ndarray]:
    """One complete query on ``path`` (``PATHS``): (total, fetch, scoring) seconds, scores. The
    reference fetch decodes item by item (the former path), the others in one call."""
    t0 = time.perf_counter()
    top, rho = _stage1(stage1, emb, text, n_c)
    t1 = time.perf_counter()
    cand = [ids[int(i)] for i in top]
    caches = _reference_fetch(index, cand) if path == "reference" else index.fetch(cand)
    t2 = time.perf_counter()
    s = joint_scores(model, [text], [(0, j) for j in range(len(cand))], caches, rho, 256, path)
    t3 = time.perf_counter()
    return t3 - t0, t2 - t1, t3 - t2, s


def _order_check(s: np.ndarray, ref: np.ndarray) -> tuple[bool, float]:
    """(candidate order identical to the reference's, the largest reference-score gap between two
    candidates the two orders put the other way round: 0 when none; a flip of candidates whose
    reference scores differ by less than the float rounding is a tie, not a ranking change)."""
    a, b = np.argsort(-ref, kind="stable"), np.argsort(-s, kind="stable")
    if np.array_equal(a, b):
        return True, 0.0
    rank = np.empty_like(b)
    rank[b] = np.arange(len(b))
    i, j = np.triu_indices(len(a), 1)  # a[i] ranked before a[j] by the reference
    flipped = rank[a[i]] > rank[a[j]]
    return False, float(np.max(np.abs(ref[a[i]] - ref[a[j]])[flipped]))


def latency(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    """Stage 1 alone and the complete query on each scoring path, alternated per query."""
    from models.reranker.onnx_scoring import scorer_for

    queries = [data.items.query_texts[q] for q in range(len(data.items.query_texts))]
    emb = data.item_emb
    ids = data.items.item_ids
    print(f"\n## complete-query latency (CPU, {torch.get_num_threads()} threads; {len(ids)} indexed clips, T=8; "
          f"median of {args.runs} after {args.warmup} warm-up; the four conditions alternate per query)\n")
    print("reference = per-item decode + the encoder's full forward (no_grad); fast = one vectorised decode + "
          "`score_fast` in PyTorch under inference mode; onnx = the `rerank` path now (`vedje.score_path=onnx`): "
          "one vectorised decode + `score_fast`'s graph in ONNX Runtime. ms; ratio = complete / stage 1 alone; "
          "Δ = max |score − reference score| over all queries; order = queries whose candidate order is the "
          "reference's (largest reference-score gap of a flipped pair).\n")
    print("| M | N_c | stage 1 alone | reference: complete | ratio | scoring | fast: complete | ratio | scoring "
          "| onnx: complete | ratio | fetch | scoring | onnx vs fast | Δ fast | Δ onnx | order fast | order onnx "
          "| cache bytes / query |\n|" + "---|" * 19)
    for m in (4, 1):
        torch.manual_seed(0)
        model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8, emb.shape[1],
                            tokens_per_frame=m).eval()
        index = build_index(model, data, f"{tmp}/cache-m{m}")
        t0 = time.perf_counter()
        scorer_for(model.reranker)
        export_s = time.perf_counter() - t0
        for n_c in (20, 100):
            first, nbytes = [], []
            delta = {p: 0.0 for p in PATHS[1:]}
            kept = {p: 0 for p in PATHS[1:]}
            gap = {p: 0.0 for p in PATHS[1:]}
            runs: dict[str, list[tuple[float, float, float]]] = {p: [] for p in PATHS}
            for k in range(args.warmup + args.runs):
                text = queries[k % len(queries)]
                order = ("stage1", *PATHS)
                order = order[k % len(order):] + order[:k % len(order)]  # rotate: each goes first in turn
                if k % 2:
                    order = order[::-1]
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
                if k >= args.warmup:
                    nbytes.append((index.stats.bytes - before) / 2)  # two paths read through the index
                    for p in PATHS[1:]:
                        delta[p] = max(delta[p], float(np.abs(scores[p] - scores["reference"]).max()))
                        same, g = _order_check(scores[p], scores["reference"])
                        kept[p] += same
                        gap[p] = max(gap[p], g)
            f = statistics.median(first) * 1e3
            med = {p: [statistics.median(t[j] for t in runs[p]) * 1e3 for j in range(3)] for p in PATHS}
            (rt, _, rs), (ft, _, fs), (ot, of, os_) = med["reference"], med["fast"], med["onnx"]
            print(f"| {m} | {n_c} | {f:.2f} | {rt:.2f} | {rt / f:.2f} | {rs:.2f} | {ft:.2f} | {ft / f:.2f} | {fs:.2f} "
                  f"| {ot:.2f} | **{ot / f:.2f}** | {of:.2f} | {os_:.2f} | {ft / ot:.2f}× | {delta['fast']:.1e} "
                  f"| {delta['onnx']:.1e} | {kept['fast']}/{args.runs} ({gap['fast']:.0e}) "
                  f"| {kept['onnx']}/{args.runs} ({gap['onnx']:.0e}) | {int(np.median(nbytes)):,} |")
        print(f"\n(M = {m}: ONNX export + session, once per loaded model: {export_s:.1f} s, not in the medians)\n")


def options(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    """The options tried, on the scoring step alone (M = 4, N_c = 20) and on the fetch (N_c = 100),
    alternated per repetition; Δ = max |score − reference score| and the share of queries whose
    candidate order is unchanged."""
    import copy
    import warnings

    from models.reranker.onnx_scoring import OnnxScorer, scorer_for

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

    def words(t):
        return reranker.bert.embeddings.word_embeddings(t.ids)

    scorer = scorer_for(reranker)
    spin = OnnxScorer(reranker, torch.get_num_threads(), config={"session.intra_op.allow_spinning": "1"})
    one = OnnxScorer(reranker, 1)
    full = OnnxScorer(reranker, torch.get_num_threads(), full_forward=True)
    conds = {
        "reference forward, no_grad (before)": torch.no_grad()(lambda t, c, r: reranker.score(t, rows, c, r)),
        "reference forward, inference_mode": torch.inference_mode()(lambda t, c, r: reranker.score(t, rows, c, r)),
        "reference forward, dynamic int8 Linear": torch.inference_mode()(
            lambda t, c, r: int8.reranker.score(t, rows, c, r)),
        "reference forward in ONNX Runtime": torch.inference_mode()(
            lambda t, c, r: full(words(t), t.mask, rows, c, r)),
        "score_fast (PyTorch)": torch.inference_mode()(lambda t, c, r: reranker.score_fast(t, rows, c, r)),
        "score_fast, 1 thread": threads(1, torch.inference_mode()(lambda t, c, r: reranker.score_fast(t, rows, c, r))),
        "score_fast graph in ONNX Runtime (kept)": torch.inference_mode()(
            lambda t, c, r: score_onnx(reranker, t, rows, c, r)),
        "ONNX Runtime, idle threads spinning (its default)": torch.inference_mode()(
            lambda t, c, r: spin(words(t), t.mask, rows, c, r)),
        "ONNX Runtime, 1 thread": torch.inference_mode()(lambda t, c, r: one(words(t), t.mask, rows, c, r)),
    }
    if args.compile:
        t0 = time.perf_counter()
        compiled = torch.compile(reranker.fast_scores, dynamic=True)
        with torch.inference_mode():
            for t, c, r in inputs[:2]:
                compiled(words(t), t.mask, rows, c, r)
        print(f"\ntorch.compile of score_fast (inductor, dynamic shapes): first two calls "
              f"{time.perf_counter() - t0:.0f} s (one-off compile, not in the medians)")
        conds["score_fast, torch.compile"] = torch.inference_mode()(
            lambda t, c, r: compiled(words(t), t.mask, rows, c, r))
    assert scorer is scorer_for(reranker)  # built once, above
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


def profile_split(args: argparse.Namespace, spec, data, stage1, tmp: str) -> None:
    """Where a complete query's time goes (M = 4, N_c = 20): the phases (stage 1, fetch, scoring),
    and within the scoring the operator kinds, under PyTorch's profiler for ``score_fast`` and
    ONNX Runtime's for the kept path; then the floor set by the Linear products alone (their FLOPs
    at the rate ONNX Runtime reaches on them). A profiler adds overhead: shares, not times, count."""
    import collections
    import json
    import os

    from torch.profiler import ProfilerActivity, profile, record_function

    from models.reranker.onnx_scoring import OnnxScorer

    torch.manual_seed(0)
    emb, ids = data.item_emb, data.items.item_ids
    model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], 8, emb.shape[1],
                        tokens_per_frame=4).eval()
    index = build_index(model, data, f"{tmp}/cache-profile")
    queries = [data.items.query_texts[q] for q in range(0, len(data.items.query_texts), 7)][:args.runs]
    reranker = model.reranker
    rows = torch.zeros(20, dtype=torch.long)
    phases = ("stage 1", "fetch", "scoring")

    def complete(text: str, score) -> None:
        with record_function("stage 1"):
            top, rho = _stage1(stage1, emb, text, 20)
        with record_function("fetch"):
            caches = index.fetch([ids[int(i)] for i in top])
        with record_function("scoring"), torch.inference_mode():
            score(reranker.tokenize([text]), caches, rho)

    def kind(name: str) -> str:
        name = name.lower()
        kinds = (("attention products", ("bmm", "einsum", "attention")),
                 ("matrix products (Linear)", ("addmm", "matmul", "gemm", "mm")), ("softmax", ("softmax",)),
                 ("layer norm", ("layer_norm", "layernorm")), ("GELU", ("gelu",)),
                 ("copies (cat, index, gather, split, transpose)",
                  ("cat", "index", "gather", "copy", "transpose", "split", "slice")),
                 ("elementwise (add, mul, where)", ("add", "mul", "where", "div", "sub")))
        return next((label for label, keys in kinds if any(key in name for key in keys)), "other")

    def table(split: collections.Counter, total: float, unit: float) -> None:
        print("| kind | ms per query | share |\n|---|---|---|")
        for k, v in split.most_common():
            print(f"| {k} | {v / unit / len(queries):.2f} | {100 * v / total:.1f} % |")

    fast = lambda t, c, r: reranker.score_fast(t, rows, c, r)  # noqa: E731
    for q in queries[:3]:
        complete(q, fast)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for q in queries:
            complete(q, fast)
    events = prof.events()
    phase_us: collections.Counter = collections.Counter()
    split: collections.Counter = collections.Counter()
    for ev in events:
        if ev.name in phases:
            phase_us[ev.name] += ev.cpu_time_total
        elif ev.name.startswith("aten::") and ev.self_cpu_time_total > 0:
            parent = ev.cpu_parent
            while parent is not None and parent.name not in phases:
                parent = parent.cpu_parent
            if parent is not None and parent.name == "scoring":
                split[kind(ev.name[6:])] += ev.self_cpu_time_total
    whole = sum(phase_us.values())
    print(f"\n## where the time goes (M = 4, N_c = 20, {len(queries)} complete queries under a profiler)\n")
    print(f"PyTorch `score_fast` path, {whole / 1e3 / len(queries):.1f} ms per complete query under the profiler "
          f"(stage 1 = {stage1.encode_text.__qualname__} + search):\n")
    print("| phase | ms per query | share |\n|---|---|---|")
    for ph in phases:
        print(f"| {ph} | {phase_us[ph] / 1e3 / len(queries):.2f} | {100 * phase_us[ph] / whole:.1f} % |")
    split["Python and dispatch (scoring time outside any aten kernel)"] = phase_us["scoring"] - sum(split.values())
    print("\nits scoring by operator kind (aten self time on the calling thread):\n")
    table(split, phase_us["scoring"], 1e3)

    scorer = OnnxScorer(reranker, torch.get_num_threads(), profile_prefix=os.path.join(tmp, "ort"))
    run = lambda t, c, r: scorer(reranker.bert.embeddings.word_embeddings(t.ids), t.mask, rows, c, r)  # noqa: E731
    for q in queries:
        complete(q, run)
    with open(scorer.session.end_profiling()) as fh:
        nodes = json.load(fh)
    split, runs = collections.Counter(), []
    linear_flop, linear_us = 0.0, 0.0
    for e in nodes:
        if e.get("name") == "model_run":
            runs.append(e["dur"])
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        op, shapes = e["args"]["op_name"], [next(iter(x.values())) for x in e["args"].get("input_type_shape", [])]
        label = kind(op)
        if op in ("MatMul", "FusedMatMul", "Gemm"):
            # the profile lists activations only (weights are pre-packed initialisers): one activation
            # input (a bias may follow) is a Linear layer, two are the attention's products
            if len(shapes) == 1 or len(shapes[1]) == 1:
                out = next(iter(e["args"]["output_type_shape"][0].values()))[-1]
                linear_flop += 2.0 * float(np.prod(shapes[0])) * out
                linear_us += e["dur"]
            else:
                label = "attention products"
        split[label] += e["dur"]
    kernels = sum(split.values())
    split["session overhead (run time outside kernels)"] = max(sum(runs) - kernels, 0.0)
    print(f"\nONNX Runtime graph (the kept path): {sum(runs) / 1e3 / len(queries):.1f} ms per scoring; by kind:\n")
    table(split, sum(runs), 1e3)
    gflop = linear_flop / len(queries) / 1e9
    rate = linear_flop / (linear_us * 1e-6) / 1e9
    st1 = []
    for q in queries:
        t0 = time.perf_counter()
        _stage1(stage1, emb, q, 20)
        st1.append((time.perf_counter() - t0) * 1e3)
    st1_ms, floor = statistics.median(st1), linear_us / 1e3 / len(queries)
    print(f"\nFloor: the Linear products are {gflop:.2f} GFLOP per query (FP32), {floor:.1f} ms at the "
          f"{rate:.0f} GFLOP/s ONNX Runtime reaches on them. With everything else free, a complete query would "
          f"take ≥ (stage 1 + {floor:.1f} ms) / stage 1 = {(st1_ms + floor) / st1_ms:.2f}× stage 1 "
          f"(stage 1 alone {st1_ms:.1f} ms, median, no profiler).")


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
    parser.add_argument("--skip-options", action="store_true", help="no table of the options tried")
    parser.add_argument("--profile", action="store_true", help="also the operator split of a complete query")
    parser.add_argument("--compile", action="store_true", help="also torch.compile among the options (slow compile)")
    args = parser.parse_args()
    import tempfile

    torch.set_num_threads(2)
    profile = load_profile("demo")
    data = cached_tensors(load_profile("demo", {"vedje": {"source": "clips"}}), "semantic-bridge")
    reg = ModelRegistry.of(profile)
    with tempfile.TemporaryDirectory() as tmp:
        stage1 = reg.expert(profile.models.experts[0])
        latency(args, profile.vedje, data, stage1, tmp)
        if not args.skip_options:
            options(args, profile.vedje, data, stage1, tmp)
        if args.profile:
            profile_split(args, profile.vedje, data, stage1, tmp)
    if not args.skip_indexing:
        indexing(args, profile.vedje, data, reg.image_embedder())


if __name__ == "__main__":
    main()
