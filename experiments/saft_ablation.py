"""Controlled measurement: does SAFT (ITC + SASS + ISD) beat plain ITC fine-tuning here?

Student: the CPU dual encoder (zero-shot = the semantic-bridge expert; the image projection
trains, the text tower stays frozen as SAFT prescribes). Teacher: the demo profile's attributes
expert (the strongest expert on the check set), its embeddings precomputed once. Training pairs:
the captions of a finished ``build-largefine`` demo run, minus every image whose identity is
relevant to a check-set query (so the test images' identities are never trained on). Test: the
hand-labelled check set (all demo crops as gallery), mAP@20 per domain. Conditions: zero-shot,
ITC, ITC+SASS, ITC+SASS+ISD (and CUSA), three seeds each, mean ± sd. Then, over all check-set
queries: each condition's mAP@20 (per query, the mean over seeds) with a 95 % percentile-bootstrap
interval over queries, and the paired interval of its difference from zero-shot and from ITC, so a
difference can be told from the spread of 24 queries.

    .venv/bin/python experiments/saft_ablation.py [--epochs 5] [--lr 1e-4]
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.backends.registry import ModelRegistry
from models.retrieval.dual_encoder import FeatureDualEncoder
from rde.common.expert_check import held_out_identities, load_check_set, load_check_yaml, relevance_lists
from rde.common.image_decoding import decode_rgb
from rde.common.metrics import ap_per_query, bootstrap_interval, mean_ap_at_k
from rde.profile import load_profile
from rde.training.retrieval_features import image_features
from rde.training.retrieval_training import TrainConfig, TrainingPairs, train
from storage import Artifact
from storage.locations import state_dir
from tasks.framework.context import RunContext

CONDITIONS = {"ITC": "itc", "ITC+SASS": "itc+sass", "ITC+SASS+ISD (SAFT)": "saft", "CUSA": "cusa"}


def largefine_root(output_root: str | None = None) -> str:
    """The demo build-largefine run's folder (under ``output_root`` when the run used ``--output``)."""
    return RunContext(load_profile("demo"), "build-largefine", output_root).root


def training_captions(root: str) -> list[dict]:
    """The demo build-largefine captions (with identity) whose identity no check-set query uses."""
    held_out = held_out_identities(load_check_yaml())
    ident = {r["image_id"]: r["identity"] for r in Artifact(f"{root}/neighbours").rows(["image_id", "identity"])}
    return [{**r, "identity": ident[r["image_id"]]} for r in Artifact(f"{root}/largefine").rows(
        ["image_id", "text", "q_txt"]) if ident[r["image_id"]] not in held_out]


def feature_cache(root: str) -> Path:
    """Where the features of the run in ``root`` are kept (one file per run folder)."""
    return state_dir() / "cache" / f"saft_features-{hashlib.sha256(root.encode()).hexdigest()[:12]}.npz"


def model_dims(f: dict[str, np.ndarray]) -> dict[str, int]:
    """FeatureDualEncoder sizes for the cached features (image input = bridge vector + CNN features)."""
    text = f["texts"].shape[1]
    return {"bridge_dim": text, "cnn_dim": f["images"].shape[2] - text, "text_dim": text}


def load_features(root: str, seed: int = 0) -> dict[str, np.ndarray]:
    """Training pairs' and check-set gallery's features of the run in ``root`` (computed once, kept
    in ``feature_cache(root)``)."""
    cache = feature_cache(root)
    if cache.exists():
        return dict(np.load(cache, allow_pickle=False))
    profile = load_profile("demo")
    registry = ModelRegistry.of(profile)
    bridge, teacher = (registry.expert(s) for s in profile.models.experts)
    embedder = registry.image_embedder()
    caps = training_captions(root)
    image_ids = sorted({c["image_id"] for c in caps})
    accepted = Artifact(f"{root}/accepted")
    images = {r["image_id"]: decode_rgb(r["image_bytes"]) for _, t in accepted.iter_shards(["image_id", "image_bytes"])
              for r in t.to_pylist() if r["image_id"] in set(image_ids)}
    feats = image_features([images[i] for i in image_ids], image_ids, bridge, embedder, teacher, views=3, seed=seed)
    check = load_check_set()
    gallery = image_features(check.gallery_images, [str(i) for i in range(len(check.gallery_images))], bridge,
                             embedder, None, views=1)
    index = {i: k for k, i in enumerate(image_ids)}
    out = {"images": feats.stacked(), "teacher_images": feats.teacher,
           "pair_image": np.array([index[c["image_id"]] for c in caps]),
           "texts": bridge.encode_text([c["text"] for c in caps]),
           "teacher_texts": teacher.encode_text([c["text"] for c in caps]),
           "q_txt": np.array([np.nan if c["q_txt"] is None else c["q_txt"] for c in caps], np.float32),
           "gallery": gallery.stacked()[0], "queries": bridge.encode_text(check.queries)}
    cache.parent.mkdir(parents=True, exist_ok=True)
    np.savez(cache, **out)
    return out


def evaluate(model: FeatureDualEncoder, f: dict[str, np.ndarray], k: int = 20) -> dict[str, Any]:
    """mAP@k per domain and every query's AP@k (``per_query``; None where a query has no relevant crop)."""
    check = load_check_set()
    with torch.no_grad():
        g = model.encode_image(torch.tensor(f["gallery"])).numpy()
        q = model.encode_text(torch.tensor(f["queries"])).numpy()
    ranked = np.argsort(-(q @ g.T), axis=1, kind="stable")[:, :k]
    rankings, counts = relevance_lists(check, ranked)
    domains = load_check_yaml()["queries"]
    out: dict[str, Any] = {"per_query": ap_per_query(rankings, counts, k)}
    for domain in ("pedestrian", "vehicle"):
        rows = [i for i, qd in enumerate(domains) if qd.get("domain", "pedestrian") == domain]
        out[domain] = mean_ap_at_k([rankings[i] for i in rows], [counts[i] for i in rows], k)
    return out


def interval_table(per_query: dict[str, np.ndarray], k: int = 20) -> str:
    """Markdown: each condition's mAP@k over all queries with its 95 % bootstrap interval, and the
    paired bootstrap interval of its difference from zero-shot and from ITC (``per_query``: per
    condition, the per-query AP averaged over seeds; same queries in every row)."""
    n = len(next(iter(per_query.values())))
    lines = [f"\nAll {n} queries, mAP@{k} (per query: mean over seeds) with 95 % bootstrap intervals over "
             "queries (10,000 resamples); differences paired\n",
             f"| condition | mAP@{k} | − zero-shot | − ITC |", "|---|---|---|---|"]

    def cell(values: np.ndarray) -> str:
        low, high = bootstrap_interval(values)
        return f"{values.mean():+.3f} [{low:+.3f}, {high:+.3f}]"

    for name, values in per_query.items():
        low, high = bootstrap_interval(values)
        diffs = [cell(values - per_query[base]) if base in per_query and base != name else "-"
                 for base in ("zero-shot (semantic bridge)", "ITC")]
        lines.append(f"| {name} | {values.mean():.3f} [{low:.3f}, {high:.3f}] | {diffs[0]} | {diffs[1]} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--output", default=None, help="the build-largefine run's --output (default: the profile's)")
    args = parser.parse_args()
    torch.set_num_threads(2)
    f = load_features(largefine_root(args.output))
    pairs = TrainingPairs(torch.tensor(f["images"]), torch.tensor(f["pair_image"]), torch.tensor(f["texts"]),
                          torch.tensor(f["teacher_images"]), torch.tensor(f["teacher_texts"]), torch.tensor(f["q_txt"]))
    dims = model_dims(f)
    print(f"{len(pairs)} training pairs over {f['images'].shape[1]} images ({f['images'].shape[0]} views); "
          f"check set: {len(f['queries'])} queries, {len(f['gallery'])} gallery crops; {args.epochs} epochs, "
          f"peak lr {args.lr}")
    zero = evaluate(FeatureDualEncoder(**dims), f)
    valid = np.array([a is not None for a in zero["per_query"]])
    per_query = {"zero-shot (semantic bridge)": np.array(zero["per_query"], dtype=float)[valid]}
    print("\n| condition | pedestrian mAP@20 | vehicle mAP@20 |\n|---|---|---|")
    print(f"| zero-shot (semantic bridge) | {zero['pedestrian']:.3f} | {zero['vehicle']:.3f} |")
    for name, objective in CONDITIONS.items():
        scores = []
        for seed in range(args.seeds):
            torch.manual_seed(seed)
            model = FeatureDualEncoder(**dims)
            cfg = TrainConfig(objective=objective, epochs=args.epochs, lr_start=args.lr / 10, lr_peak=args.lr,
                              seed=seed)
            train(model, pairs, cfg)
            scores.append(evaluate(model, f))
        ped = np.array([s["pedestrian"] for s in scores])
        veh = np.array([s["vehicle"] for s in scores])
        print(f"| {name} | {ped.mean():.3f} ± {ped.std(ddof=1):.3f} | {veh.mean():.3f} ± {veh.std(ddof=1):.3f} |",
              flush=True)
        per_query[name] = np.mean([np.array(s["per_query"], dtype=float)[valid] for s in scores], axis=0)
    print(interval_table(per_query))


if __name__ == "__main__":
    main()
