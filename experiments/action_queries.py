"""Controlled measurement: can the experts find what a person does, and what do the track slots add?

On the hand-labelled check set (``data/check_set/queries.yaml``), the queries about what a person
does or carries (relevant by crop: ``relevant_crops``, labelled by eye on the video frames) are
scored apart from the appearance queries. Each demo expert's mAP@10 with a 95 % bootstrap interval
over queries; the attribute expert twice, with the motion and direction slots compared with each
crop's video track (as MECF and the evaluation rank) and without (its image-side vectors alone),
with the paired interval of the difference. A random ranking's expected mAP@10 is the floor.

    .venv/bin/python experiments/action_queries.py
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from models.backends.registry import ModelRegistry
from rde.common.expert_check import expert_vectors, load_check_set, load_check_yaml, relevance_lists
from rde.common.metrics import ap_per_query, bootstrap_interval
from rde.common.topk import topk_exact
from rde.evaluation.check_sets import random_map
from rde.profile import load_profile

K = 10


def _interval(values: list[float]) -> str:
    low, high = bootstrap_interval(values)
    return f"{np.mean(values):.3f} [{low:.3f}, {high:.3f}]"


def main() -> None:
    check = load_check_set()
    data = load_check_yaml()
    by_crop = [bool(q.get("relevant_crops")) for q in data["queries"]]
    groups = {"action / direction / carried (by crop)": [q for q, c in enumerate(by_crop) if c],
              "appearance (by identity)": [q for q, c in enumerate(by_crop) if not c]}
    profile = load_profile("demo")
    registry = ModelRegistry.of(profile)
    aps: dict[str, list[float | None]] = {}
    for spec in profile.models.experts:
        expert = registry.expert(spec)
        images = expert.encode_image(check.gallery_images)
        ranked, _ = topk_exact(*expert_vectors(expert, check, profile.domain_set, images, profile.track_facts), K)
        aps[spec.backend] = ap_per_query(*relevance_lists(check, ranked), k=K)
        if getattr(expert, "track_slots", False):
            plain, _ = topk_exact(expert.encode_text(check.queries), images, K)
            aps[f"{spec.backend} without track slots"] = ap_per_query(*relevance_lists(check, plain), k=K)
    print(f"check set: {len(check.queries)} queries, {len(check.gallery_identities)} crops; mAP@{K}, 95 % "
          "bootstrap intervals over queries (10,000 resamples)\n")
    names = list(aps)
    print("| queries | n | random | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 3) + "|")
    for label, picked in groups.items():
        rnd = random_map(replace(check, queries=[check.queries[q] for q in picked],
                                 relevant=[check.relevant[q] for q in picked]), K)
        cells = [_interval([aps[n][q] for q in picked if aps[n][q] is not None]) for n in names]
        print(f"| {label} | {len(picked)} | {rnd:.3f} | " + " | ".join(cells) + " |")
    for without in [n for n in names if n.endswith(" without track slots")]:
        with_slots = without.removesuffix(" without track slots")
        for label, picked in groups.items():
            diff = [aps[with_slots][q] - aps[without][q] for q in picked
                    if aps[with_slots][q] is not None and aps[without][q] is not None]
            low, high = bootstrap_interval(diff)
            print(f"\n{label}: {with_slots} with − without track slots (paired) {np.mean(diff):+.3f} "
                  f"[{low:+.3f}, {high:+.3f}]")
    print("\nper query (action / direction / carried):")
    for q in groups["action / direction / carried (by crop)"]:
        print(f"  {data['queries'][q]['id']} {check.queries[q][:70]!r}: " +
              ", ".join(f"{n} {aps[n][q]:.2f}" for n in names if aps[n][q] is not None))


if __name__ == "__main__":
    main()
