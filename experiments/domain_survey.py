"""Which classes the offline recordings supply: per detector class, the tracks the videos stage
follows and the crops that pass denoise, on vtest.avi and the 1906 street film.

Every COCO class of the bundled detector becomes a survey domain of its own (its class alone), and
both recordings go through the videos stage's own work (``process_segment``: decode, sample,
detect, ByteTrack per domain, crops per track, each crop checked against the size and blur rules,
the street film's crops confirmed on the stored JPEG as the demo pool's are). A class's tracks
"supply" the domain when at least one of their crops passes. The size rule of the survey is the
person's area with the axes free: at least 32 pixels on each side and 32 × 64 pixels in all (a
bicycle or a tram is wide and low, a person tall and narrow); each crop's measured size is kept,
so a stricter rule can be applied to the printed table.

Run: ``python experiments/domain_survey.py [--videos .rde/demo-videos]`` (`make videos` fetches
both recordings). Prints a Markdown table per class, most supplied first.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from entry.demo_pool import POOL_VIDEO, STREET_VIDEO
from models.backends.detectors import LABELS_FILE, load_detector
from models.domains import Domain
from rde.common.image_decoding import decode_rgb
from rde.common.input_listing import InputRef
from rde.common.video_input import detector_for_video, plan_segments, process_segment
from rde.profile import load_profile

MIN_SIDE, MIN_AREA = 32, 32 * 64


def survey_domain(cls: str) -> Domain:
    """A domain of one detector class and nothing else (what the survey tracks)."""
    name = "c_" + "".join(ch if ch.isalnum() else "_" for ch in cls.lower())
    return Domain.model_validate({
        "name": name, "subject": {"classes": [cls], "noun": cls, "said_as": f"the {cls}", "nouns": [cls],
                                  "size": {"min_width": MIN_SIDE, "min_height": MIN_SIDE}},
        "queries": {"prompt": "dap_generic"}, "captions": {"request": f"Describe the {cls}."}})


def coco_classes() -> list[str]:
    lines = [line for line in LABELS_FILE.read_text().splitlines() if line.strip() and not line.startswith("#")]
    return [line.split("\t", 1)[1].strip() for line in lines]


def survey(video: Path, spec, domains: list[Domain], save: Path | None = None) -> dict[str, dict[str, int]]:
    """Per class: tracks with a passing crop and passing crops (each written to ``save``/<class>/
    when given, to be looked at)."""
    profile = load_profile("demo")
    denoise = profile.denoise.model_copy(update={"size_by_domain": {d.name: d.subject.size for d in domains}})
    detector = load_detector(detector_for_video(profile.models.detector, spec))
    ref = InputRef(f"survey:{video.name}", str(video), domains[0].name)
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"crops": 0, "tracks_with_crop": 0})
    by_name = {d.name: d.subject.classes[0] for d in domains}
    for segment in plan_segments([ref], spec, None):
        result = process_segment(segment, spec, denoise, domains, detector, None, video.name)
        tracks: dict[str, set[str]] = defaultdict(set)
        for crop in result.crops:
            h, w = decode_rgb(crop["image_bytes"]).shape[:2]
            if min(w, h) >= MIN_SIDE and w * h >= MIN_AREA:
                out[by_name[crop["domain"]]]["crops"] += 1
                tracks[crop["domain"]].add(crop["identity"])
                if save is not None:
                    folder = save / crop["domain"]
                    folder.mkdir(parents=True, exist_ok=True)
                    name = f"{video.stem}-{crop['identity'].rsplit('-', 1)[-1]}-{out[by_name[crop['domain']]]['crops']}"
                    (folder / f"{name}.jpg").write_bytes(crop["image_bytes"])
        for name, ids in tracks.items():
            out[by_name[name]]["tracks_with_crop"] += len(ids)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--videos", default=".rde/demo-videos")
    parser.add_argument("--save", default=None, help="Write each passing crop to SAVE/<domain>/ to look at.")
    args = parser.parse_args()
    save = Path(args.save) if args.save else None
    domains = [survey_domain(c) for c in coco_classes()]
    folder = Path(args.videos)
    found = {"vtest.avi": survey(folder / "vtest.avi", POOL_VIDEO, domains, save),
             "street.mp4": survey(folder / "street.mp4", STREET_VIDEO, domains, save)}
    classes = sorted({c for f in found.values() for c in f},
                     key=lambda c: -sum(f.get(c, {}).get("tracks_with_crop", 0) for f in found.values()))
    print("| class | vtest.avi tracks | vtest.avi crops | street film tracks | street film crops |")
    print("|---|---:|---:|---:|---:|")
    for c in classes:
        v, s = found["vtest.avi"].get(c, {}), found["street.mp4"].get(c, {})
        print(f"| {c} | {v.get('tracks_with_crop', 0)} | {v.get('crops', 0)} | {s.get('tracks_with_crop', 0)} | "
              f"{s.get('crops', 0)} |")


if __name__ == "__main__":
    main()
