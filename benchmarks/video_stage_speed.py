"""Speed of the videos stage against the bare loop it is built on, side by side in one run.

Both arms read the same recording (default: the demo's vtest.avi, 795 frames of 768×576 at 10 fps)
at the same sampling rate with the same detector (the demo profile's SSD-MobileNet, at ByteTrack's
low score, batches of ``video.detect_batch``):

* **bare**: PyAV decodes every frame, every n-th is converted to RGB, batches are detected, and one
  ultralytics ByteTrack per domain is updated; nothing else;
* **stage**: ``process_segment``, the videos stage's work on one shard: the same, plus the crops
  (size rule, Laplacian variance, best per bin), the motion windows, JPEG encoding and the rows.

The arms alternate (bare, stage, stage, bare, …) and the medians of ``--repeats`` are compared;
the target is stage ≤ 1.1 × bare. Sampled frames per second are printed for each.

    .venv/bin/python benchmarks/video_stage_speed.py [--video .rde/demo-videos/vtest.avi] [--sample-fps 5]
                                                     [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import av

from models.backends.detectors import load_detector
from models.backends.disk_memo import keep_nothing_on_disk
from rde.common.denoise import count_targets
from rde.common.input_listing import InputRef
from rde.common.video_decoding import probe
from rde.common.video_input import Segment, detector_for_video, lost_steps, process_segment
from rde.common.video_tracks import byte_tracker, link
from rde.profile import load_profile

ROOT = Path(__file__).resolve().parents[1]


def bare_loop(path: str, profile, detector) -> int:
    """Decode, sample, detect, track; returns the sampled frame count."""
    spec = profile.video
    info = probe(path, spec.max_pixels)
    step = max(1, round(info.fps / spec.sample_fps))
    trackers = {d.name: byte_tracker(spec.tracker, lost_steps(spec, info)) for d in profile.domains}
    batch, sampled = [], 0

    def flush() -> None:
        for dets in detector.detect(batch):
            for domain in profile.domains:
                link(trackers[domain.name], count_targets(dets, domain.target_classes))
        batch.clear()

    with av.open(path) as container:
        for number, frame in enumerate(container.decode(video=0)):
            if number % step:
                continue
            batch.append(frame.to_ndarray(format="rgb24"))
            sampled += 1
            if len(batch) == spec.detect_batch:
                flush()
    if batch:
        flush()
    return sampled


def stage(path: str, profile, detector) -> int:
    result = process_segment(Segment(InputRef("bench", path, "pedestrian"), 0, 0, None), profile.video,
                             profile.denoise, profile.domains, detector, None, Path(path).name)
    return int(result.segment["frames_sampled"])


def main() -> None:
    keep_nothing_on_disk()  # time the detector, not detections an earlier run kept
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--video", default=str(ROOT / ".rde" / "demo-videos" / "vtest.avi"))
    parser.add_argument("--sample-fps", type=float, default=5.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    profile = load_profile("demo", {"video": {"sample_fps": args.sample_fps}})
    detector = load_detector(detector_for_video(profile.models.detector, profile.video))
    arms = {"bare": bare_loop, "stage": stage}
    times: dict[str, list[float]] = {name: [] for name in arms}
    frames: dict[str, int] = {}
    stage(args.video, profile, detector)  # warm-up: the network's first forward, the decoder's libraries
    for repeat in range(args.repeats):
        for name in (["bare", "stage"] if repeat % 2 == 0 else ["stage", "bare"]):
            start = time.perf_counter()
            frames[name] = arms[name](args.video, profile, detector)
            times[name].append(time.perf_counter() - start)
    assert frames["bare"] == frames["stage"], frames
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(f"video: {args.video}; sampled frames: {frames['stage']} at {args.sample_fps:g} fps; "
          f"repeats: {args.repeats}")
    print("| arm | median s | sampled frames / s | runs (s) |")
    print("|---|---|---|---|")
    for name in arms:
        runs = ", ".join(f"{t:.2f}" for t in times[name])
        print(f"| {name} | {medians[name]:.2f} | {frames[name] / medians[name]:.1f} | {runs} |")
    print(f"stage / bare = {medians['stage'] / medians['bare']:.3f} (target ≤ 1.1)")


if __name__ == "__main__":
    main()
