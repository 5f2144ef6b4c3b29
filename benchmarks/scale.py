"""How time and memory grow with the pool: ``build-secmm --until candidates`` and ``build-largefine``
(all stages) on synthetic pools of N images (``rde pool synth``), one CLI process per flow and N,
run back to back in one invocation.

For each flow and N: seconds per stage (from the run's summary), milliseconds per image and images
per second of the stages that touch every image (per-shard: ingest, measure, denoise, embed-images,
hard-negatives, qa-tiers, adv-tier, export; whole-pool: CGDS, select-images), the run's peak RSS
(the CLI process and its children, sampled every 0.2 s with psutil) and the load average before and after the run (the
machine may be shared). build-secmm's generator work (caption pool, DAP) does not grow with N — it
captions a fixed sample per domain and writes a fixed number of queries — so it runs with a small
fixed budget (``--caption-sample``, ``--rounds``) with the demo's real SmolLM2, and is reported,
not judged. build-largefine captions with ``benchmarks/scripted_captioner.py``: a deterministic
OpenAI-compatible server in this process (no LLM; the generator is not what is measured) reached
through the product's ``openai-http`` backend, for the tiers and the template gallery alike; the
captioning stages' time is then the pipeline's own (decoding, requests, gates, writes). Its
captioning stages are per captioned image (the pool's pedestrians after denoise), the pool stages
per pool image. Targets: peak RSS at the largest N ≤ 1.5 × at the previous one; the
per-image time of every per-shard stage within ±25 % across N; the growth exponent of CGDS
(embedding + k-means), of the hard negatives (exact kNN; their embedding is the per-shard
embed-images stage) and of MECF (whose gallery is
bounded by the draw, so it should not grow).

The time outside the stages is reported too; for build-largefine it includes the dataset card
(after the export stage; it adds up the tier shards' Table 1 counts, which the tier stages take
with spaCy as they write), timed from the run's log.

    .venv/bin/python benchmarks/scale.py [--sizes 500 1000 2000] [--flows secmm largefine]
                                         [--workdir /tmp/rde-scale] [--project]

``--largefine-from-secmm`` starts each build-largefine from the build-secmm run of the same N in the
workdir: its ingest, measure and denoise outputs are hard-linked into build-largefine's output folder
(the runner skips them only when their content keys match, i.e. same pool, code and config), so the
detector is not run twice; those stages read "reused" in the table and their time and memory are the
build-secmm run's. build-largefine's embed-images does not use the embedding cache, so it embeds as it
would alone.

A (flow, size) already measured in the workdir (``result-<flow>-N.json``) is not run again; the
tables cover every size measured there, so sizes can be added in later invocations. ``--project``
adds the projection of a 1.2M-image three-tier build on 1, 8 and 32 GPU workers from the largest
build-largefine measured: measured CPU costs plus GPU figures that are assumptions (each named at
the constants below, with its source). ``--parent-cpu`` takes ``benchmarks/parent_cpu.py``'s result
(the parent's CPU seconds of a build with every per-shard stage fanned out, on a local stack) and
projects with the parent at that cost and the per-shard CPU stages, the hard negatives' exact search
among them (its rate measured here, now), on cpu workers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from scripted_captioner import ScriptedServer

from models.backends.disk_memo import keep_nothing_on_disk
from storage.artifact import IMAGE_ROW_GROUP

ROOT = Path(__file__).resolve().parent.parent
# stages timed per image: per pool image, or per captioned image (build-largefine's chosen pedestrians)
PER_POOL_IMAGE = ("ingest", "measure", "denoise", "cgds")
PER_CAPTIONED_IMAGE = ("embed-images", "select-images", "hard-negatives", "qa-tiers", "adv-tier", "export-largefine")
FLOWS = ("secmm", "largefine")


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
        proc = subprocess.Popen([sys.executable, "-m", "entry.cli", *args], cwd=ROOT, stdout=subprocess.PIPE,
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


def load() -> str:
    return " / ".join(f"{x:.2f}" for x in os.getloadavg())


def card_seconds(log: Path) -> float | None:
    """Seconds from the export stage's last log line to the flow run's end: the dataset card, which
    the stage's own seconds do not include."""
    stamps = {}
    for line in log.read_text(errors="replace").splitlines():
        found = re.match(r"(\d\d):(\d\d):(\d\d\.\d+) \| INFO .*?"
                         r"(export-largefine: .* accepted|Flow run .* - Finished in)", line)
        if found:
            h, m, sec = int(found.group(1)), int(found.group(2)), float(found.group(3))
            stamps["export" if found.group(4).startswith("export") else "end"] = 3600 * h + 60 * m + sec
    if {"export", "end"} <= set(stamps):
        return round((stamps["end"] - stamps["export"]) % 86400, 1)
    return None


def flow_args(flow: str, pool: Path, out: Path, args: argparse.Namespace, generator: dict | None) -> list[str]:
    common = ["--input", str(pool), "--output", str(out), "--json", "--set", f"ingest.shard_size={args.shard_size}"]
    if flow == "secmm":
        return ["build-secmm", *common, "--until", "candidates",
                "--set", f"queries.caption_sample_per_domain={args.caption_sample}",
                "--set", f"queries.max_rounds={args.rounds}"]
    spec = json.dumps(generator)
    return ["build-largefine", *common, "--set", f"models.generators=[{spec}]",
            "--set", f"models.template_generator={spec}", "--set", "largefine.tier_prompt=gtr_tiers",
            "--set", f"largefine.shard_size={args.caption_shard_size}"]


POOL_STAGE_ARTIFACTS = ("images", "ingest_rejects", "measurements", "accepted", "denoise_rejects")


def seed_from_secmm(work: Path, n: int, profile: str = "demo") -> list[str]:
    """Hard-link build-secmm's ingest, measure and denoise outputs at ``n`` into build-largefine's
    output folder at ``n`` (an artifact already there is left as it is); returns their names. The
    runner checks each stage's content key, so a stale or foreign artifact is recomputed."""
    source = work / f"out-secmm-{n}" / "build-secmm" / profile
    target = work / f"out-largefine-{n}" / "build-largefine" / profile
    missing = [a for a in POOL_STAGE_ARTIFACTS if not (source / a / "_manifest.json").exists()]
    if missing:
        raise SystemExit(f"--largefine-from-secmm: {source} lacks {', '.join(missing)}; run build-secmm at "
                         f"N={n} in this workdir first (--flows secmm largefine)")
    target.mkdir(parents=True, exist_ok=True)
    for name in POOL_STAGE_ARTIFACTS:
        if (target / name).exists():
            continue
        for path in sorted((source / name).rglob("*")):
            dest = target / name / path.relative_to(source / name)
            if path.is_dir():
                dest.mkdir(parents=True, exist_ok=True)
            else:
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.link(path, dest)
    return list(POOL_STAGE_ARTIFACTS)


def measure_one(flow: str, n: int, work: Path, args: argparse.Namespace, server: ScriptedServer | None) -> None:
    pool = work / f"pool-{n}"
    if not (pool / "_manifest.json").exists():
        synth_s, _, _ = run_cli(["pool", "synth", "--n", str(n), "--out", str(pool), "--shard-size",
                                 str(args.shard_size)], work / f"synth-{n}.log")
        print(f"synth pool of {n}: {synth_s:.0f} s", flush=True)
    if flow == "largefine" and args.largefine_from_secmm:
        seed_from_secmm(work, n)
    before = load()
    counts_before = dict(server.counts) if server else {}
    wall, rss, text = run_cli(flow_args(flow, pool, work / f"out-{flow}-{n}", args,
                                        server.spec() if server else None), work / f"build-{flow}-{n}.log")
    after = load()
    summary = json.loads(text)
    stages = {s["stage"]: s for s in summary["stages"]}
    result = {"flow": flow, "n": n, "wall": wall, "rss": rss, "stages": stages, "accepted": summary["accepted"],
              "rejected": summary["rejected"], "load_before": before, "load_after": after,
              "captioned": stages["hard-negatives"]["accepted"] if "hard-negatives" in stages else None,
              "captioning": summary.get("captioning"),
              "requests": {k: v - counts_before.get(k, 0) for k, v in (server.counts if server else {}).items()
                           if v - counts_before.get(k, 0)}}
    result["reused"] = [name for name, s in stages.items() if s.get("skipped")]
    result["card_s"] = card_seconds(work / f"build-{flow}-{n}.log") if flow == "largefine" else None
    (work / f"result-{flow}-{n}.json").write_text(json.dumps(result))
    print(f"{flow} N={n}: {wall:.0f} s, peak RSS {rss / 2**30:.2f} GiB, {summary['accepted']} accepted by denoise, "
          f"load {before} -> {after}", flush=True)


def per_image_cell(stage: str, seconds: float, result: dict) -> str:
    images = result["n"] if stage in PER_POOL_IMAGE else result["captioned"] if stage in PER_CAPTIONED_IMAGE else None
    if not images or seconds <= 0:
        return "-"
    return f"{1000 * seconds / images:.2f} ({images / seconds:.1f})"


def reused_stages(results: list[dict]) -> set[str]:
    """Stages skipped (their outputs reused) in any of ``results``: timed elsewhere, never judged here."""
    return {name for r in results for name in r.get("reused", [])}


def print_table(flow: str, results: list[dict]) -> None:
    ns = [r["n"] for r in results]
    grows = len(results) > 1
    print(f"\n### build-{flow}\n")
    print("| stage | " + " | ".join(f"N={n:,} s" for n in ns) + " | "
          + " | ".join(f"N={n:,} ms/image (images/s)" for n in ns) + " | growth exponent |")
    print("|---|" + "---|" * (2 * len(results) + 1))
    reused = reused_stages(results)
    for name in results[0]["stages"]:
        secs = [r["stages"][name]["seconds"] for r in results]
        if name in reused:  # skipped in some run: its time is the run it came from (--largefine-from-secmm)
            print(f"| {name} | " + " | ".join("reused" for _ in range(2 * len(results))) + " | - |")
            continue
        cells = [f"{s:.1f}" for s in secs] + [per_image_cell(name, s, r) for s, r in zip(secs, results, strict=True)]
        grow = f"{exponent(ns, secs):.2f}" if grows else "-"
        print(f"| {name} | " + " | ".join(cells) + f" | {grow} |")
    outside = [r["wall"] - sum(st["seconds"] for st in r["stages"].values()) for r in results]
    print("| *outside the stages (process start, Prefect, summary" + (", dataset card" if flow == "largefine" else "")
          + ")* | " + " | ".join(f"{o:.1f}" for o in outside) + " | " + " | ".join("-" for _ in results) + " | "
          + (f"{exponent(ns, outside):.2f}" if grows else "-") + " |")
    if flow == "largefine" and all(r.get("card_s") is not None for r in results):
        cards = [r["card_s"] for r in results]
        print("| *of which the dataset card (after the export stage)* | " + " | ".join(f"{c:.1f}" for c in cards)
              + " | " + " | ".join(f"{1000 * c / (3 * r['captioned']):.2f} per caption" for c, r in
                                   zip(cards, results, strict=True)) + " | "
              + (f"{exponent(ns, cards):.2f}" if grows else "-") + " |")
    print("| **run (wall)** | " + " | ".join(f"{r['wall']:.0f}" for r in results) + " | "
          + " | ".join(f"{1000 * r['wall'] / r['n']:.1f}" for r in results) + " | "
          + (f"{exponent(ns, [r['wall'] for r in results]):.2f}" if grows else "-") + " |")
    print("| **peak RSS (GiB)** | " + " | ".join(f"{r['rss'] / 2**30:.2f}" for r in results) + " | "
          + " | ".join("-" for _ in results) + " | "
          + (f"{exponent(ns, [r['rss'] for r in results]):.2f}" if grows else "-") + " |")
    print()
    for r in results:
        extra = ""
        if r["captioned"] is not None:
            caps = {row["stage"]: row for row in r["captioning"] or []}
            extra = (f"; {r['captioned']} images captioned; captioning stages accepted/input "
                     + ", ".join(f"{k} {v['accepted']}/{v['input']} (generator {v['generator_seconds']:.0f} s "
                                 f"summed over shards)" for k, v in caps.items())
                     + f"; scripted requests {r['requests']}")
        print(f"- N={r['n']:,}: load average (1/5/15 min) {r['load_before']} before, {r['load_after']} after; "
              f"rejected {r['rejected']}{extra}")
    if grows:
        for name in ("ingest", "measure", "embed-images", "qa-tiers", "adv-tier"):
            if name not in results[0]["stages"] or name in reused:
                continue
            per = [r["stages"][name]["seconds"] / (r["n"] if name in PER_POOL_IMAGE else r["captioned"])
                   for r in results]
            mid = sorted(per)[len(per) // 2]
            print(f"- {name}: per-image time within {max(abs(p / mid - 1) for p in per):.0%} of its median "
                  "across N (target ±25 %)")
        print(f"- peak RSS largest / previous N: {results[-1]['rss'] / max(results[-2]['rss'], 1):.2f} "
              "(target ≤ 1.5)")


# -- projection: a 1.2M-image, three-tier build on N GPU workers -----------------------------------------
# Measured here: the per-image CPU cost of every stage (largest N, fixed costs included). ASSUMED (no GPU
# was available): everything below marked so, with its source.
PROJECT_IMAGES = 1_200_000  # images captioned; assumed: the pool stages see the same images (all pass)
WORKERS = (1, 8, 32)
FANOUT_EFFICIENCY = 2.50 / 3  # measured by benchmarks/pool_scaling.py at 3 gpu workers; ASSUMED to hold at 8, 32
# Caption requests per image, as scripts/gpu_check.py assumes them (rde/largefine/tiered_captions.py):
# (requests, images per request, generated tokens) for base (Q&A + summary), inter (target + hard negative), adv.
TIERS = {"base": (2, 1, 180), "inter": (2, 2, 200), "adv": (1, 1, 60)}
PROMPT_TEXT_TOKENS = 128  # per request, scripts/gpu_check.py's default
IMAGE_PATCHES, IMAGE_TOKENS = 256, 64  # 224 px, patch 14, 2x2 merge (Qwen2-VL), scripts/gpu_check.py
LLM_PARAMS, VIT_PARAMS = 7.0e9, 0.675e9  # production generator Qwen2-VL-7B (profiles/production.yaml)
KV_BYTES_PER_TOKEN = 28 * 2 * 4 * 128 * 2  # Qwen2-7B: 28 layers, K and V, 4 KV heads x 128, bf16
GPU_BF16_FLOPS, GPU_HBM_BYTES_S = 989e12, 3.35e12  # NVIDIA H100 SXM datasheet (dense BF16, HBM3)
MFU_PREFILL, HBM_EFFICIENCY = 0.40, 0.50  # ASSUMED (no source): share of peak reached in prefill / decode
DECODE_BATCH, MEAN_CONTEXT = 64, 400  # production profile's batch_size; ASSUMED mean tokens in context
DETECTOR_GPU_S = 2 * 3.53e-3  # YOLOv8x 640 px: 3.53 ms/image on A100 TensorRT (docs.ultralytics.com/models/yolov8),
#                               doubled: the product runs it through PyTorch, not TensorRT (ASSUMED factor)
# hard-negative kNN above 100k images is faiss IVF (largefine.neighbour_index_above):
# docs/results/scale.md, "Top-K search"
# measured 23.4-26.4 s for 20k queries over 100k 768-d vectors (build + search, nprobe 32) on these 2 cores;
# ASSUMED to grow as queries x sqrt(N) x dim (nlist = 4 sqrt N, so a query scans nprobe/nlist of N)
KNN_MEASURED_S, KNN_Q, KNN_N, KNN_DIM, PROJECT_DIM = 26.4, 20_000, 100_000, 768, 1024  # DINOv2-L: 1024-d
# the stages whose shards a fanned-out parent only waits for: its CPU there is its polling of their runs
# (every prefect.fanout.poll_s), concurrent with the workers' work, so not added to the serial time
WAITED_ON = ("measure", "embed-images", "qa-tiers", "adv-tier")
PARENT_CORES = 32  # ASSUMED: the CPU cores of a GPU node that runs the parent (a DGX H100 node has 112)
# qa-tiers reads, per captioning shard, the row groups (of IMAGE_ROW_GROUP rows) that hold one of its
# images or hard negatives (tasks/largefine.py `_images`, Artifact.read_matching); on the synthetic pool
# every captioning shard read from every accepted shard. Production shard sizes (profiles/production.yaml
# ingest 4096; largefine.shard_size default 64);
# ASSUMED worst case at 1.2M: the 64 negatives of a captioning shard lie in 64 other accepted shards.
PROD_INGEST_SHARD, CAPTION_SHARD = 4096, 64


READ_PROBE = """
import sys, time
from storage import Artifact
art = Artifact(sys.argv[1])
shards = range(len(art.manifest().shards))
for index in shards:  # once to warm the page cache: the figure is a lower bound of a read
    art.read_shard(index, ["image_id", "image_bytes"])
start, rows = time.perf_counter(), 0
for index in shards:
    rows += art.read_shard(index, ["image_id", "image_bytes"]).num_rows
print((time.perf_counter() - start) / max(rows, 1), flush=True)
"""


def image_read_seconds(accepted: Path) -> float | None:
    """Seconds to read one image's bytes from an accepted shard (timed over whole shards; the tiers read
    row groups of ``IMAGE_ROW_GROUP`` images, so the projection counts that many reads per group).
    In a child process: an interpreter that has read Parquet through ``storage`` sometimes aborts at exit
    here ("terminate called without an active exception"), which must not end the benchmark."""
    if not (accepted / "_manifest.json").exists():
        return None
    done = subprocess.run([sys.executable, "-c", READ_PROBE, str(accepted)], cwd=ROOT, capture_output=True, text=True)
    try:
        return float(done.stdout.split()[0])
    except (IndexError, ValueError):
        return None


def generator_seconds_per_image() -> tuple[float, float]:
    """ASSUMED GPU seconds per image of the three tiers (prefill, decode) from a roofline of the
    production generator on one H100: prefill compute-bound, decode bandwidth-bound."""
    prompt_tokens = sum(r * (PROMPT_TEXT_TOKENS + IMAGE_TOKENS * i) for r, i, _ in TIERS.values())
    image_encodes = sum(r * i for r, i, _ in TIERS.values())
    prefill_flops = 2 * LLM_PARAMS * prompt_tokens + 2 * VIT_PARAMS * IMAGE_PATCHES * image_encodes
    prefill = prefill_flops / (MFU_PREFILL * GPU_BF16_FLOPS)
    step_bytes = 2 * LLM_PARAMS + DECODE_BATCH * MEAN_CONTEXT * KV_BYTES_PER_TOKEN
    step = step_bytes / (HBM_EFFICIENCY * GPU_HBM_BYTES_S)
    decode_tokens = sum(t - r for r, _, t in TIERS.values())  # each request's first token comes with its prefill
    return prefill, decode_tokens * step / DECODE_BATCH


def exact_search_rate(queries: int = 2048, gallery: int = 16384, dim: int = PROJECT_DIM) -> float:
    """Multiply-adds per second of the hard negatives' exact search on this machine (the fixed-point
    float64 products of ``rde.common.topk``, streamed in blocks as the stage does), measured now."""
    import numpy as np

    from rde.common.topk import topk_exact_blocks

    rng = np.random.default_rng(0)
    x = rng.normal(size=(gallery, dim)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    start = time.perf_counter()
    topk_exact_blocks(x[:queries], iter([x[at:at + 4096] for at in range(0, gallery, 4096)]), 11)
    return queries * gallery * dim / (time.perf_counter() - start)


def print_projection(r: dict, work: Path, parent_cpu: list[dict] | None = None) -> None:
    """Hours of a PROJECT_IMAGES build: the parent's work (one process, does not scale with workers)
    plus the fanned-out stages divided over N workers at FANOUT_EFFICIENCY. Without ``parent_cpu``
    the layout where every CPU stage runs in the parent; with it (``benchmarks/parent_cpu.py``'s
    result: the parent's CPU seconds of a build whose every per-shard stage fanned out) the parent is
    the line through that measurement at its smallest and largest N (fixed + per captioned image),
    and the per-shard CPU stages run on as many cpu workers as there are gpu workers, the kNN among
    them as exact search."""
    st, n, cap = r["stages"], r["n"], r["captioned"]
    knn = KNN_MEASURED_S * (PROJECT_IMAGES / KNN_Q) * math.sqrt(PROJECT_IMAGES / KNN_N) * PROJECT_DIM / KNN_DIM
    prefill, decode = generator_seconds_per_image()
    # (part, where, seconds per image, source)
    pool_cpu = (st["ingest"]["seconds"] + st["denoise"]["seconds"]) / n
    cpu_rows: list[tuple[str, float, str]] = []
    if parent_cpu is None:
        select = st.get("select-images", {"seconds": 0.0})["seconds"] + st["hard-negatives"]["seconds"]
        parent = [("ingest + denoise", pool_cpu, "measured"),
                  ("select-images + hard-negatives: select, read the vectors, write", select / cap,
                   "measured (includes the exact kNN, trivial at this N)"),
                  ("hard-negatives: kNN at 1.2M (faiss IVF)", knn / PROJECT_IMAGES, "extrapolated from ann_recall"),
                  ("template gallery", st["template-gallery"]["seconds"] / PROJECT_IMAGES, "measured (fixed)"),
                  ("export", st["export-largefine"]["seconds"] / cap, "measured"),
                  ("dataset card (after the export stage)", (r.get("card_s") or 0.0) / cap, "measured")]
    else:
        small, big = min(parent_cpu, key=lambda p: p["n"]), max(parent_cpu, key=lambda p: p["n"])
        rate = exact_search_rate()

        def serial(p: dict) -> float:  # the parent's CPU less what it spent waiting on the GPU stages
            return p["parent_cpu_s"] - sum(p["stages_cpu_s"].get(name, 0.0) for name in WAITED_ON)

        # the parent's serial CPU as fixed + slope x captioned images, through its smallest and largest N
        slope = ((serial(big) - serial(small)) / (big["captioned"] - small["captioned"])
                 if big is not small else serial(big) / big["captioned"])
        fixed = serial(big) - slope * big["captioned"]
        parent = [("the parent process: per captioned image (selection, planning, manifests, card)",
                   max(slope, 0.0), f"measured: slope of its CPU between N={small['n']:,} and {big['n']:,}, every "
                                    "per-shard stage fanned out"),
                  (f"the parent process: fixed ({fixed:.1f} s: start, template gallery, summary)",
                   max(fixed, 0.0) / PROJECT_IMAGES, "measured: intercept of the same line")]
        waiting = (big["parent_cpu_s"] - serial(big)) / big["captioned"]
        cpu_rows = [("ingest + denoise", pool_cpu, "measured (one process)"),
                    ("hard-negatives: exact kNN at 1.2M", PROJECT_IMAGES * PROJECT_DIM / rate,
                     f"{rate / 1e9:.1f} G multiply-adds/s measured on this machine's 2 cores; ASSUMED per cpu "
                     "worker"),
                    ("export", st["export-largefine"]["seconds"] / cap, "measured (one process)")]
    fanned = [("measure: detector on GPU (YOLOv8x)", DETECTOR_GPU_S, "ASSUMED (Ultralytics A100 TRT x2)"),
              ("embed-images: decode, embed, write", st["embed-images"]["seconds"] / cap,
               "measured with EfficientNet-Lite0 on this CPU; ASSUMED no faster with DINOv2-L on a GPU"),
              ("captioning pipeline (decode, requests, gates, Table 1 counts, writes)",
               (st["qa-tiers"]["seconds"] + st["adv-tier"]["seconds"]) / cap, "measured (scripted generator)"),
              ("generation: prefill (7 image encodes, 5 prompts)", prefill, "ASSUMED (roofline, H100)"),
              ("generation: decode (435 tokens at batch 64)", decode, "ASSUMED (roofline, H100)")]
    read = image_read_seconds(work / f"out-largefine-{n}" / "build-largefine" / "demo" / "accepted")
    if read is not None:
        # a shard's images are read by row group (storage.artifact.IMAGE_ROW_GROUP rows), not whole
        per = (min(CAPTION_SHARD, math.ceil(PROJECT_IMAGES / PROD_INGEST_SHARD)) + 1) * IMAGE_ROW_GROUP \
            / CAPTION_SHARD * read
        worst = ("qa-tiers: row groups read for hard negatives", per,
                 f"extrapolated worst case ({1e6 * read:.0f} us per image read, measured, warm cache)")
    else:
        worst = None
    print(f"\n### Projection: {PROJECT_IMAGES:,} images, three tiers (from N={n:,})\n")
    print("| part | runs on | ms/image | source | " + " | ".join(f"{w} worker{'s' * (w > 1)} (h)" for w in WORKERS)
          + " |")
    print("|---|---|---|---|" + "---|" * len(WORKERS))

    def hours(per: float, where: str) -> dict[int, float]:
        return {w: per * PROJECT_IMAGES / 3600 / (1 if where.startswith("parent") else
                                                  w * (FANOUT_EFFICIENCY if w > 1 else 1.0)) for w in WORKERS}

    totals = dict.fromkeys(WORKERS, 0.0)
    for where, rows in (("parent (1 process)", parent), ("cpu workers", cpu_rows), ("gpu workers", fanned)):
        for name, per, source in rows:
            h = hours(per, where)
            totals = {w: totals[w] + h[w] for w in WORKERS}
            print(f"| {name} | {where} | {1000 * per:.2f} | {source} | " + " | ".join(f"{h[w]:.2f}" for w in WORKERS)
                  + " |")
    print("| **total** | | | | " + " | ".join(f"**{totals[w]:.1f}**" for w in WORKERS) + " |")
    parent_h = sum(per for _, per, _ in parent) * PROJECT_IMAGES / 3600
    print("| parent share of the total | | | | " + " | ".join(f"{100 * parent_h / totals[w]:.0f} %" for w in WORKERS)
          + " |")
    print("| speed-up over 1 worker | | | | " + " | ".join(f"{totals[WORKERS[0]] / totals[w]:.1f}×" for w in WORKERS)
          + " |")
    if parent_cpu is not None:
        print(f"| *not added: the parent polling the GPU stages' runs while they compute* | parent | "
              f"{1000 * waiting:.2f} | measured at N={big['n']:,} (its CPU in {', '.join(WAITED_ON)}) | "
              + " | ".join("-" for _ in WORKERS) + " |")
    if parent_cpu is None:
        # the kNN is faiss's search, parallel over queries: ASSUMED to scale with cores, on a parent of
        # PARENT_CORES cores against this 2-core machine
        many = parent_h - knn / 3600 * (1 - 2 / PARENT_CORES)
        print(f"| parent share with the kNN on a {PARENT_CORES}-core parent (ASSUMED linear in cores) | | | | "
              + " | ".join(f"{100 * many / (totals[w] - parent_h + many):.0f} %" for w in WORKERS) + " |")
    if worst is not None:
        h = hours(worst[1], "gpu workers")
        print(f"| {worst[0]} | gpu workers | {1000 * worst[1]:.2f} | {worst[2]} | "
              + " | ".join(f"{h[w]:.2f}" for w in WORKERS) + " |")
        print("| **total with that worst case** | | | | " + " | ".join(f"**{totals[w] + h[w]:.1f}**" for w in WORKERS)
              + " |")


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[500, 1000, 2000])
    parser.add_argument("--flows", nargs="+", choices=FLOWS, default=list(FLOWS))
    parser.add_argument("--workdir", default="/tmp/rde-scale")
    parser.add_argument("--shard-size", type=int, default=256, help="ingest.shard_size (images per shard)")
    parser.add_argument("--caption-shard-size", type=int, default=64, help="largefine.shard_size")
    parser.add_argument("--caption-sample", type=int, default=16, help="queries.caption_sample_per_domain")
    parser.add_argument("--rounds", type=int, default=2, help="queries.max_rounds")
    parser.add_argument("--largefine-from-secmm", action="store_true",
                        help="start build-largefine from build-secmm's ingest/measure/denoise outputs at the same N")
    parser.add_argument("--project", action="store_true",
                        help="also print the 1.2M-image projection from the largest build-largefine measured")
    parser.add_argument("--parent-cpu", type=Path, default=None,
                        help="benchmarks/parent_cpu.py's result.json: project with the parent's measured CPU and the "
                             "per-shard CPU stages on cpu workers")
    args = parser.parse_args()
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    with ScriptedServer() as server:
        for n in args.sizes:
            for flow in args.flows:
                if (work / f"result-{flow}-{n}.json").exists():
                    print(f"{flow} N={n}: measured before in {work} (result-{flow}-{n}.json); delete it and "
                          f"out-{flow}-{n}/ to measure again")
                    continue
                measure_one(flow, n, work, args, server if flow == "largefine" else None)
    # every size measured in this workdir (so a large N can be added later to the same table)
    for flow in FLOWS:
        results = sorted((json.loads(p.read_text()) for p in work.glob(f"result-{flow}-*.json")),
                         key=lambda r: r["n"])
        for r in results:  # results written before the card was timed: from the log
            log = work / f"build-{flow}-{r['n']}.log"
            if flow == "largefine" and r.get("card_s") is None and log.exists():
                r["card_s"] = card_seconds(log)
        if results:
            print_table(flow, results)
        if flow == "largefine" and results and args.project:
            print_projection(results[-1], work,
                             json.loads(args.parent_cpu.read_text()) if args.parent_cpu else None)


if __name__ == "__main__":
    main()
