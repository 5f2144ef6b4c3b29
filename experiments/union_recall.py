"""Controlled measurement: does the MECF union miss fewer true matches than any single expert?

On the hand-labelled check set (data/check_set/queries.yaml: verified multi-match labels over the
demo pool's crops), for each expert and cut-off K: recall = |top-K ∩ relevant| / |relevant|,
averaged over queries. The union (Eq. 1) at K is compared with each single expert at K (same K,
the paper's setting) and at 2K (same candidate budget for two experts). Then each expert's
mAP@10/20/30 with a 95 % bootstrap interval over queries, and the paired bootstrap interval of the
difference between the experts (the same resampled queries for both): where that interval holds 0,
the check set cannot tell the two apart.

    .venv/bin/python experiments/union_recall.py
"""

from __future__ import annotations

import numpy as np

from models.backends.registry import ModelRegistry
from rde.common.expert_check import expert_vectors, load_check_set, relevance_lists
from rde.common.metrics import ap_per_query, bootstrap_interval
from rde.common.topk import topk_exact
from rde.evaluation.check_sets import random_map
from rde.profile import load_profile


def main() -> None:
    check = load_check_set()
    ids = np.array(check.gallery_identities)
    relevant = [check.relevant_positions(q) for q in range(len(check.relevant))]
    profile = load_profile("demo")
    registry = ModelRegistry.of(profile)
    ranked: dict[str, np.ndarray] = {}
    for spec in profile.models.experts:
        expert = registry.expert(spec)
        idx, _ = topk_exact(*expert_vectors(expert, check, profile.domain_set), len(check.gallery_images))
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
    map_intervals(check, ranked)


def map_intervals(check, ranked: dict[str, np.ndarray]) -> None:
    """Each expert's mAP@K with its 95 % bootstrap interval over queries, and the paired interval of
    the first expert minus the second."""
    names = list(ranked)
    print(f"\nmAP@K with 95 % bootstrap intervals over {len(check.queries)} queries (10,000 resamples)\n")
    diff = f" | {names[0]} − {names[1]} (paired)" if len(names) == 2 else ""
    print("| K | random | " + " | ".join(names) + diff + " |")
    print("|" + "---|" * (len(names) + 2 + bool(diff)))
    for k in (10, 20, 30):
        aps = {n: ap_per_query(*relevance_lists(check, ranked[n][:, :k]), k=k) for n in names}
        cells = []
        for n in names:
            values = [a for a in aps[n] if a is not None]
            low, high = bootstrap_interval(values)
            cells.append(f"{np.mean(values):.3f} [{low:.3f}, {high:.3f}]")
        if diff:
            d = [a - b for a, b in zip(aps[names[0]], aps[names[1]], strict=True) if a is not None and b is not None]
            low, high = bootstrap_interval(d)
            cells.append(f"{np.mean(d):+.3f} [{low:+.3f}, {high:+.3f}]")
        print(f"| {k} | {random_map(check, k):.3f} | " + " | ".join(cells) + " |")
    for domain in sorted(set(check.query_domains or [])):
        picked = [q for q, d in enumerate(check.query_domains) if d == domain]
        cells = []
        for n in names:
            values = [a for q, a in enumerate(ap_per_query(*relevance_lists(check, ranked[n][:, :20]), k=20))
                      if q in picked and a is not None]
            low, high = bootstrap_interval(values)
            cells.append(f"{n} {np.mean(values):.3f} [{low:.3f}, {high:.3f}]")
        print(f"\n{domain} ({len(picked)} queries), mAP@20: " + "; ".join(cells))


if __name__ == "__main__":
    main()
