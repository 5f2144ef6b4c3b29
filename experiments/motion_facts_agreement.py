"""Controlled measurement: how often is a motion or direction the engine states from a crop's
video track what a person sees?

The reference: every non-junk pedestrian crop of the demo pool labelled by eye on the video frames
1 s before and after it (``data/check_set/motion_labels.csv``, made without reading the measuring
code). For each crop the engine's ``motion_facts`` (the demo profile's ``track_facts``) either states
a motion (and a direction) or says nothing; this prints, for what it states, how often the eye
agrees (a direction agrees with a diagonal label that contains it: "left" with
"diagonal-left-away"), and how much of what the eye saw clearly the engine states.

    .venv/bin/python experiments/motion_facts_agreement.py [--labels PATH] [--set track_facts.still_speed=0.1]
"""

from __future__ import annotations

import argparse
import csv
from collections import Counter
from pathlib import Path

from models.backends.track_facts import motion_facts
from rde.common.track_context import motion_options
from rde.profile import load_profile
from storage import Artifact

ROOT = Path(__file__).resolve().parents[1]


def agreement(labels: list[dict[str, str]], metas: dict[str, str], options) -> dict[str, object]:
    """Counts of stated facts, agreeing facts and the confusion of motion (measured, by eye)."""
    confusion: Counter[tuple[str, str]] = Counter()
    motion_stated = motion_agree = direction_stated = direction_agree = 0
    clear = clear_stated = 0
    for label in labels:
        facts = motion_facts(metas[label["pool_id"]], "pedestrian", options)
        motion = (facts.get("motion") or ["(nothing)"])[0]
        direction = (facts.get("direction") or [None])[0]
        confusion[(motion, label["motion"])] += 1
        if motion != "(nothing)":
            motion_stated += 1
            motion_agree += motion == label["motion"]
        if direction:
            direction_stated += 1
            direction_agree += label["direction"] == direction or (
                label["direction"].startswith("diagonal") and direction in label["direction"].split("-"))
        if label["direction"] in {"left", "right", "toward", "away"}:
            clear += 1
            clear_stated += direction is not None
    return {"crops": len(labels), "motion_stated": motion_stated, "motion_agree": motion_agree,
            "direction_stated": direction_stated, "direction_agree": direction_agree,
            "clear_directions": clear, "clear_directions_stated": clear_stated, "confusion": confusion}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--labels", default=str(ROOT / "data" / "check_set" / "motion_labels.csv"))
    parser.add_argument("--set", action="append", default=[],
                        help="a track_facts key, e.g. track_facts.still_speed=0.1")
    args = parser.parse_args()
    overrides: dict[str, dict[str, float]] = {"track_facts": {}}
    for item in args.set:
        key, value = item.split("=", 1)
        overrides["track_facts"][key.removeprefix("track_facts.")] = float(value)
    options = motion_options(load_profile("demo", overrides).track_facts)
    with open(args.labels, encoding="utf-8") as handle:
        labels = list(csv.DictReader(handle))
    metas = {r["pool_id"]: r["source_meta"] for r in
             Artifact(str(ROOT / "data" / "demo_pool")).read_shard(0, ["pool_id", "source_meta"]).to_pylist()}
    got = agreement(labels, metas, options)
    print(f"{got['crops']} crops labelled by eye")
    print("| fact | stated for | the eye agrees | share |\n|---|---|---|---|")
    for name in ("motion", "direction"):
        stated, agree = got[f"{name}_stated"], got[f"{name}_agree"]
        print(f"| {name} | {stated} | {agree} | {agree / max(stated, 1):.1%} |")
    print(f"\ndirections the eye saw clearly: {got['clear_directions']}, stated by the engine: "
          f"{got['clear_directions_stated']} ({got['clear_directions_stated'] / max(got['clear_directions'], 1):.1%})")
    print("\n| measured \\ by eye | " + " | ".join(sorted({e for _, e in got["confusion"]})) + " |")
    print("|---" * (1 + len({e for _, e in got["confusion"]})) + "|")
    for measured in sorted({m for m, _ in got["confusion"]}):
        print(f"| {measured} | " + " | ".join(str(got["confusion"][(measured, e)])
                                            for e in sorted({e for _, e in got["confusion"]})) + " |")


if __name__ == "__main__":
    main()
