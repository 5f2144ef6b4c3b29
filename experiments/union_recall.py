"""Controlled measurement: does the MECF union miss fewer true matches than any single expert?

On the hand-labelled check set (data/check_set/queries.yaml: verified multi-match labels over the
demo pool's crops), for each expert and cut-off K: recall = |top-K ∩ relevant| / |relevant|,
averaged over queries. The union (Eq. 1) at K is compared with each single expert at K (same K,
the paper's setting) and at 2K (same candidate budget for two experts).

    .venv/bin/python experiments/union_recall.py
"""

from __future__ import annotations

import numpy as np

from models.backends.registry import ModelRegistry
from rde.common.expert_check import load_check_set
from rde.common.profiles import load_profile
from rde.common.topk import topk_exact


def main() -> None:
    check = load_check_set()
    ids = np.array(check.gallery_identities)
    relevant = [set(np.flatnonzero(np.isin(ids, list(rel))).tolist()) for rel in check.relevant]
    registry = ModelRegistry(load_profile("demo").models)
    ranked: dict[str, np.ndarray] = {}
    for spec in load_profile("demo").models.experts:
        expert = registry.expert(spec)
        idx, _ = topk_exact(expert.encode_text(check.queries), expert.encode_image(check.gallery_images),
                            len(check.gallery_images))
        ranked[spec.backend] = idx

    def recall(sets: list[set[int]]) -> float:
        return float(np.mean([len(s & rel) / len(rel) for s, rel in zip(sets, relevant, strict=True) if rel]))

    names = list(ranked)
    print(f"check set: {len(check.queries)} queries, {len(ids)} gallery crops, "
          f"{np.mean([len(r) for r in relevant]):.1f} relevant per query")
    header = "| K | " + " | ".join(f"{n} @K" for n in names) + " | union @K | " + \
        " | ".join(f"{n} @2K" for n in names) + " | union size (mean) |"
    print(header)
    print("|" + "---|" * (2 * len(names) + 3))
    for k in (5, 10, 25, 50, 100):
        singles = {n: [set(row[:k].tolist()) for row in ranked[n]] for n in names}
        doubled = {n: [set(row[: 2 * k].tolist()) for row in ranked[n]] for n in names}
        union = [set().union(*(singles[n][q] for n in names)) for q in range(len(check.queries))]
        cells = [f"{recall(singles[n]):.3f}" for n in names] + [f"**{recall(union):.3f}**"] + \
            [f"{recall(doubled[n]):.3f}" for n in names] + [f"{np.mean([len(u) for u in union]):.1f}"]
        print(f"| {k} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
