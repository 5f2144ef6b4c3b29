"""Controlled measurements for the cached joint reranker (VEDJE), on the CPU.

1. Rerank vs stage 1: R@1/5/10 of the stage-1 expert and of VEDJE over its top-N_c, ``--seeds``
   seeds, on the demo build-largefine person images (T = 1; test identities never trained on;
   stage 1 = the attributes expert, VTM candidates from its top-20 as in the paper) and on the
   bundled vtest.avi clips (T = 8; test clips later in time than every training clip; stage 1 =
   the semantic-bridge expert, which is near chance on clip captions, so VTM candidates come from
   the whole training gallery).
2. Clips, cache structure at a matched budget (T·M = 32 tokens): separate frame groups vs
   mean-pooled vs attention-pooled frames (no delta loss), and the delta loss on/off at M = 4
   and M = 1; ``--ablation-seeds`` seeds.
3. Cache precision: the main clip models' caches stored as BF16, FP8-E4M3 and FP4-E2M1.

CPU scale (the paper's values in brackets): joint encoder = the first ``--layers`` blocks of
all-MiniLM-L6-v2 [MiniLM-L12], ``--epochs`` [4], ``--batch`` queries [64] × ``--candidates``
VTM candidates per step, warmup 20 steps [400], peak lr ``--lr`` [3e-4].

    .venv/bin/python experiments/vedje_rerank.py [--seeds 3] [--ablation-seeds 2] [--only clips|images]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from rde.profile import load_profile
from rde.vedje.features import cached_tensors
from rde.vedje.training import VedjeTensors, build_model, evaluate_rerank, stored_caches, train_config, train_vedje
from storage.locations import state_dir

SOURCES = {"images": {"source": "largefine", "stage1": "attributes", "negatives_from": 20},
           "clips": {"source": "clips", "stage1": "semantic-bridge", "negatives_from": 100}}
VARIANTS = {"frames, M=4, no delta": {"delta": False},
            "mean-pooled, 32 tokens, no delta": {"structure": "mean", "delta": False},
            "attention-pooled, 32 tokens, no delta": {"structure": "attention", "delta": False},
            "frames, M=1, delta": {"tokens_per_frame": 1},
            "frames, M=1, no delta": {"tokens_per_frame": 1, "delta": False}}


def run(data: VedjeTensors, args: argparse.Namespace, seed: int, n_c: list[int], negatives_from: int,
        precisions: tuple[str, ...] = ("bf16",), **shape: Any) -> dict[str, Any]:
    """Train one model and evaluate it; returns recall rows per precision and the training facts."""
    spec = load_profile("demo").vedje
    torch.manual_seed(seed)
    model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1], data.item_frames.shape[1],
                        data.item_emb.shape[1], layers=args.layers, **shape)
    cfg = train_config(spec, epochs=args.epochs, batch_size=args.batch, train_candidates=args.candidates,
                       negatives_from=negatives_from, warmup_steps=20, lr_peak=args.lr, seed=seed)
    result = train_vedje(model, data, cfg)
    out: dict[str, Any] = {p: evaluate_rerank(model, data, stored_caches(model, data, p), n_c, batch=256)
                           for p in precisions}
    out["train"] = {"seconds": round(result.seconds, 1), "vtm_share": round(result.vtm_share, 3),
                    "epoch_loss": [round(v, 4) for v in result.epoch_loss]}
    return out


def value(rows: list[dict], ranking: str, n: int, metric: str) -> float:
    return next(r["value"] for r in rows
                if r["ranking"] == ranking and r["n_candidates"] == n and r["metric"] == metric)


def fmt(xs: list[float]) -> str:
    """mean ± population sd, one decimal, minimum displayed sd 0.1 (the paper's convention)."""
    a = np.asarray(xs)
    return f"{a.mean():.1f} ± {max(a.std(), 0.1):.1f}"


def row(name: str, runs: list[dict], ranking: str, n: int, precision: str = "bf16") -> str:
    return f"| {name} | " + " | ".join(fmt([value(r[precision], ranking, n, f"R@{k}") for r in runs])
                                       for k in (1, 5, 10)) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--ablation-seeds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--candidates", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--only", choices=sorted(SOURCES), default=None)
    parser.add_argument("--no-ablation", action="store_true", help="only the rerank-vs-stage-1 tables")
    args = parser.parse_args()
    torch.set_num_threads(2)
    report: dict[str, Any] = {"args": vars(args)}
    out = state_dir() / "experiments" / "vedje_rerank.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for name, src in SOURCES.items():
        if args.only and args.only != name:
            continue
        data = cached_tensors(load_profile("demo", {"vedje": {"source": src["source"]}}), src["stage1"])
        gallery = len(data.rows("test")[0])
        n_c = sorted({min(n, gallery) for n in (20, 50, 100)})
        print(f"\n## {name}: {len(data.items.item_ids)} items (T={data.item_frames.shape[1]}), stage 1 = "
              f"{src['stage1']}; test gallery {gallery}, {len(data.rows('test')[1])} test queries, "
              f"{len(data.rows('train')[1])} training queries", flush=True)
        precisions = ("bf16", "fp8", "fp4") if name == "clips" else ("bf16",)
        runs = [run(data, args, s, n_c, src["negatives_from"], precisions) for s in range(args.seeds)]
        report[f"{name}/main"] = runs
        out.write_text(json.dumps(report, indent=1))
        print(f"training: {[r['train'] for r in runs]}")
        print("\n| ranking | R@1 | R@5 | R@10 |\n|---|---|---|---|")
        print(row("stage 1", runs, "stage-1", 0))
        for n in n_c:
            print(row(f"VEDJE rerank, N_c={n}", runs, "rerank", n))
        print(f"({time.perf_counter() - start:.0f}s)", flush=True)
        if name != "clips":
            continue
        print(f"\n| cache precision (N_c={n_c[0]}) | R@1 | R@5 | R@10 |\n|---|---|---|---|")
        for precision in precisions:
            print(row(precision, runs, "rerank", n_c[0], precision))
        if args.no_ablation:
            continue
        print(f"\n| cache (N_c={n_c[0]}, {args.ablation_seeds} seeds) | R@1 | R@5 | R@10 |\n|---|---|---|---|")
        print(row("frames, M=4, delta (VEDJE)", runs[:args.ablation_seeds], "rerank", n_c[0]), flush=True)
        for variant, shape in VARIANTS.items():
            runs_v = [run(data, args, s, n_c[:1], src["negatives_from"], **shape) for s in range(args.ablation_seeds)]
            report[f"clips/{variant}"] = runs_v
            out.write_text(json.dumps(report, indent=1))
            print(row(variant, runs_v, "rerank", n_c[0]), flush=True)
    print(f"\n{time.perf_counter() - start:.0f}s; raw results in {out}")


if __name__ == "__main__":
    main()
