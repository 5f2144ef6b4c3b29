"""Controlled measurement: are the GTR+ tiers' captions discriminative and diverse?

Input: a finished ``build-largefine`` run (default: the demo profile's artifacts). Person identities
come from the demo pool's tracks. Only images captioned in all three tiers take part, so every
condition ranks the same gallery with the same held-out queries:

- per identity with ≥ 2 such images, one image (seeded draw) is the held-out query image, the
  others stay in the gallery with every single-view image as distractors;
- text→image retrieval through captions: the query image's caption (MiniLM embedding) is compared
  with each gallery image's caption of the same condition; a hit is a gallery image of the query's
  identity. Conditions: base, inter, adv, and "all" (gallery image = mean of its three caption
  embeddings; each of the query image's three captions is a query);
- diversity per tier: distinct-1 / distinct-2 (unique n-grams / all n-grams) and the share of
  unique caption strings.

    .venv/bin/python experiments/tier_retrieval.py [--root .rde/artifacts/build-largefine/demo]
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

import numpy as np

from models.backends.interfaces import l2_normalize
from models.backends.registry import ModelRegistry
from rde.common.metrics import average_precision_at_k
from rde.profile import load_profile
from storage import Artifact
from storage.locations import resolve_location

TIERS = ("base", "inter", "adv")


def distinct_ngrams(texts: list[str], n: int) -> float:
    grams = [tuple(words[i:i + n]) for t in texts for words in [re.findall(r"[a-z0-9']+", t.lower())]
             for i in range(len(words) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


def rank_metrics(query_vecs: np.ndarray, query_ids: list[str], gallery_vecs: np.ndarray,
                 gallery_ids: list[str]) -> dict[str, float]:
    sims = query_vecs @ gallery_vecs.T
    order = np.argsort(-sims, axis=1, kind="stable")
    gallery = np.array(gallery_ids)
    r1, r5, aps, chance = [], [], [], []
    for row, identity in zip(order, query_ids, strict=True):
        hits = gallery[row] == identity
        r1.append(float(hits[0]))
        r5.append(float(hits[:5].any()))
        aps.append(average_precision_at_k(hits.tolist(), int(hits.sum()), len(row)))
        chance.append(hits.sum() / len(hits))
    return {"R@1": float(np.mean(r1)), "R@5": float(np.mean(r5)), "mAP": float(np.mean(aps)),
            "chance R@1": float(np.mean(chance)), "queries": len(query_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="build-largefine output folder")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = load_profile("demo")
    root = args.root or f"{resolve_location(profile.artifacts_root)}/build-largefine/demo"
    identity = {r["image_id"]: r["identity"] for _, t in Artifact(f"{root}/neighbours").iter_shards(
        ["image_id", "identity"]) for r in t.to_pylist()}
    captions: dict[str, dict[str, str]] = defaultdict(dict)
    for _, t in Artifact(f"{root}/largefine").iter_shards(["image_id", "tier", "text"]):
        for r in t.to_pylist():
            captions[r["image_id"]][r["tier"]] = r["text"]
    complete = sorted(i for i, c in captions.items() if len(c) == 3 and identity.get(i))
    by_identity: dict[str, list[str]] = defaultdict(list)
    for image_id in complete:
        by_identity[identity[image_id]].append(image_id)
    rng = np.random.default_rng(args.seed)
    queries = [views[int(rng.integers(len(views)))] for _, views in sorted(by_identity.items()) if len(views) >= 2]
    gallery = [i for i in complete if i not in set(queries)]
    encoder = ModelRegistry.of(profile).text_encoder()
    vec = {tier: dict(zip(complete, encoder.encode([captions[i][tier] for i in complete]), strict=True))
           for tier in TIERS}
    print(f"images with all three tiers: {len(complete)} of {len(captions)} captioned; "
          f"identities: {len(by_identity)}; held-out queries: {len(queries)}; gallery: {len(gallery)}")
    print("\n| captions | R@1 | R@5 | mAP | chance R@1 | queries |\n|---|---|---|---|---|---|")
    q_ids = [identity[q] for q in queries]
    g_ids = [identity[g] for g in gallery]
    for tier in TIERS:
        m = rank_metrics(np.stack([vec[tier][q] for q in queries]), q_ids,
                         np.stack([vec[tier][g] for g in gallery]), g_ids)
        print(f"| T_{tier} | {m['R@1']:.3f} | {m['R@5']:.3f} | {m['mAP']:.3f} | {m['chance R@1']:.3f} | "
              f"{m['queries']} |")
    mean_gallery = l2_normalize(np.stack([np.mean([vec[t][g] for t in TIERS], axis=0) for g in gallery]))
    m = rank_metrics(np.stack([vec[t][q] for t in TIERS for q in queries]), q_ids * 3, mean_gallery, g_ids)
    print(f"| all three | {m['R@1']:.3f} | {m['R@5']:.3f} | {m['mAP']:.3f} | {m['chance R@1']:.3f} | "
          f"{m['queries']} |")
    print("\n| tier | texts | distinct-1 | distinct-2 | unique texts | words/text |\n|---|---|---|---|---|---|")
    for tier in (*TIERS, "all"):
        texts = [captions[i][t] for i in complete for t in (TIERS if tier == "all" else (tier,))]
        words = np.mean([len(t.split()) for t in texts])
        print(f"| {tier} | {len(texts)} | {distinct_ngrams(texts, 1):.3f} | {distinct_ngrams(texts, 2):.3f} | "
              f"{len(set(texts)) / len(texts):.3f} | {words:.1f} |")


if __name__ == "__main__":
    main()
