"""Video input: recordings decoded, sampled, detected, tracked (ByteTrack) and cropped by the
``videos`` stage, every listed video accepted or rejected with a reason, then ingested as images.

The real recordings are the demo's (``make videos``: vtest.avi and the street film, in
.rde/demo-videos); short clips of them are re-encoded here so the detector runs on a few dozen
sampled frames. The hostile files are made here too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import av
import numpy as np
import pytest
from conftest import DEMO_VIDEOS, needs_demo_videos

from flows.build_secmm import build_secmm
from models.backends.detectors import load_detector
from models.domains import load_domains
from rde.common.denoise import count_targets
from rde.common.input_listing import InputRef
from rde.common.pool_config import DenoiseSpec, InputSpec, VideoSpec
from rde.common.video_decoding import DecodeOutcome, probe, sampled_frames
from rde.common.video_input import Segment, detector_for_video, list_videos, plan_segments, process_segment, video_roots
from rde.common.video_tracks import Candidate, TrackBook, crop_quality, spread
from rde.profile import load_profile
from storage import Artifact

VTEST = DEMO_VIDEOS / "vtest.avi"
STREET = DEMO_VIDEOS / "street.mp4"
DOMAINS = list(load_domains(["pedestrian", "vehicle"]))
# a small frame rate: 2 sampled frames per second of the 10 fps recording
SPEC = VideoSpec(sample_fps=2.0, min_track_detections=2, crops_per_track=2)
needs_videos = needs_demo_videos


def write_video(path: Path, frames: list[np.ndarray], fps: int = 10, codec: str = "mpeg4", pix_fmt: str = "yuv420p",
                rotation: int = 0) -> Path:
    """Encode RGB frames into a video file (the container from the suffix), with a display rotation
    of ``rotation`` degrees counter-clockwise when not 0 (what a player turns the stored picture by)."""
    with av.open(str(path), "w") as out:
        stream = out.add_stream(codec, rate=fps)
        stream.height, stream.width = frames[0].shape[:2] if frames else (64, 64)
        stream.pix_fmt = pix_fmt
        if rotation:
            stream.set_display_rotation(rotation)
        out.start_encoding()  # the header even when no frame follows
        for rgb in frames:
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return path


def clip(source: Path, start: int, count: int) -> list[np.ndarray]:
    """Frames ``start .. start+count-1`` of a recording, as RGB."""
    frames = []
    with av.open(str(source)) as container:
        for k, frame in enumerate(container.decode(video=0)):
            if k >= start + count:
                break
            if k >= start:
                frames.append(frame.to_ndarray(format="rgb24"))
    return frames


@pytest.fixture(scope="module")
def vtest_frames() -> list[np.ndarray]:
    if not VTEST.exists() and not os.environ.get("CI"):
        pytest.skip("the demo videos are missing: run `make videos`")
    return clip(VTEST, 100, 60)


@pytest.fixture(scope="module")
def detector():
    return load_detector(detector_for_video(load_profile("demo").models.detector, SPEC))


def _run_folder(folder: Path, detector, spec: VideoSpec = SPEC, roots: list[str] | None = None):
    """Every segment of a folder input, processed: {video name: [SegmentResult per segment]}."""
    input_spec = InputSpec(kind="video", path=str(folder))
    refs, _ = list_videos(input_spec, folder, [d.name for d in DOMAINS])
    roots = video_roots(input_spec, folder) if roots is None else roots
    out: dict[str, list] = {}
    for segment in plan_segments(refs, spec, roots):
        name = Path(segment.ref.source).name
        out.setdefault(name, []).append(process_segment(segment, spec, DenoiseSpec(), DOMAINS, detector, roots, name))
    return out


@needs_videos
def test_hostile_videos_each_end_as_a_row_and_leave_the_others_crops_alone(tmp_path: Path, vtest_frames, detector
                                                                           ) -> None:
    alone = tmp_path / "alone"
    alone.mkdir()
    write_video(alone / "good.avi", vtest_frames)
    baseline = _run_folder(alone, detector)["good.avi"][0]
    assert baseline.reject is None and len(baseline.crops) > 0

    folder = tmp_path / "videos"
    folder.mkdir()
    write_video(folder / "good.avi", vtest_frames)
    (folder / "notes.mp4").write_text("this is a text file, not a video\n")
    (folder / "zero.mp4").write_bytes(b"")
    truncated = (alone / "good.avi").read_bytes()
    (folder / "truncated.avi").write_bytes(truncated[: len(truncated) // 2])
    write_video(folder / "one_frame.avi", vtest_frames[:1])
    write_video(folder / "huge.avi", [np.full((2304, 4096, 3), 90, np.uint8)])  # 9.4 MP > 3840x2160
    outside = tmp_path / "outside"
    outside.mkdir()
    write_video(outside / "elsewhere.avi", vtest_frames[:10])
    os.symlink(outside / "elsewhere.avi", folder / "link.avi")

    results = _run_folder(folder, detector)
    assert set(results) == {"good.avi", "notes.mp4", "zero.mp4", "truncated.avi", "one_frame.avi", "huge.avi",
                            "link.avi"}
    first = {name: parts[0] for name, parts in results.items()}
    rejected = {name: r.reject["reason"] for name, r in first.items() if r.reject}
    assert rejected == {"notes.mp4": "not_a_video", "zero.mp4": "empty_file", "huge.avi": "video_too_large",
                        "link.avi": "outside_root"}
    for name, r in first.items():  # one accounting row per video, from its first segment
        assert r.stats()["input_rows"] == 1 and r.stats()["accepted"] + sum(r.stats()["rejected"].values()) == 1
        assert (r.segment["status"] == "rejected") == (name in rejected)
    assert "4096x2304" in first["huge.avi"].reject["detail"]

    partial = first["truncated.avi"]  # decoding stopped partway: what came before stands, and says so
    assert partial.reject is None and partial.segment["decode_error"]
    assert 0 < partial.segment["frames_read"] < len(vtest_frames)
    assert partial.segment["declared_frames"] == len(vtest_frames)
    one = first["one_frame.avi"]
    assert one.reject is None and one.segment["frames_read"] == 1 and one.crops == []
    assert json.loads(one.segment["tracks_without_crop"]).get("too_short", 0) == one.segment["tracks"] > 0

    good = first["good.avi"]  # the neighbours change nothing about the good video's crops
    assert [c["image_bytes"] for c in good.crops] == [c["image_bytes"] for c in baseline.crops]
    assert [c["pool_id"] for c in good.crops] == [c["pool_id"] for c in baseline.crops]


def test_a_container_without_frames_and_a_file_without_video_are_rejected(tmp_path: Path, detector) -> None:
    empty = write_video(tmp_path / "empty.avi", [])
    with av.open(str(tmp_path / "audio.wav"), "w") as out:  # an audio-only file: no video stream
        stream = out.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    results = _run_folder(tmp_path, detector)
    reasons = {name: parts[0].reject["reason"] for name, parts in results.items()}
    assert reasons == {"empty.avi": "no_frames", "audio.wav": "not_a_video"}
    assert "no video stream" in results["audio.wav"][0].reject["detail"]
    assert empty.exists()


@needs_videos
def test_segments_decode_exactly_their_frames_and_a_crossing_track_counts_twice(tmp_path: Path, vtest_frames,
                                                                                 detector) -> None:
    path = write_video(tmp_path / "walk.avi", vtest_frames)  # 60 frames, 6 s
    spec = SPEC.model_copy(update={"segment_seconds": 3.0})
    info = probe(str(path), spec.max_pixels)
    whole = DecodeOutcome()
    every = {n: rgb for n, _, rgb in sampled_frames(str(path), info, 0, None, 5, whole)}
    second = DecodeOutcome()
    later = {n: rgb for n, _, rgb in sampled_frames(str(path), info, 30, None, 5, second)}
    assert sorted(later) == [n for n in sorted(every) if n >= 30]  # the seek lands on frame 30 exactly
    assert all(np.array_equal(later[n], every[n]) for n in later)
    assert (whole.frames_read, second.frames_read, whole.error, second.error) == (60, 30, None, None)

    results = _run_folder(tmp_path, detector, spec)["walk.avi"]
    assert [r.segment["start_frame"] for r in results] == [0, 30]
    step = round(info.fps / spec.sample_fps)  # the detections, counted apart: every target on every sampled frame
    sampled = [rgb for _, _, rgb in sampled_frames(str(path), info, 0, None, step, DecodeOutcome())]
    found = sum(len(count_targets(d, domain.target_classes)) for d in detector.detect(sampled) for domain in DOMAINS)
    assert sum(r.segment["detections"] for r in results) == found > 0
    assert [r.segment["frames_read"] for r in results] == [30, 30]
    assert [r.stats()["input_rows"] for r in results] == [1, 0]  # the video is counted once
    frames = [[json.loads(c["source_meta"])["frame"] for c in r.crops] for r in results]
    assert all(f < 30 for f in frames[0]) and all(30 <= f < 60 for f in frames[1])
    ids = [{c["identity"] for c in r.crops} for r in results]
    assert ids[0] and ids[1] and not ids[0] & ids[1]  # a person walking through the boundary: two identities
    assert all("-s000-" in i for i in ids[0]) and all("-s001-" in i for i in ids[1])
    meta = json.loads(results[0].crops[0]["source_meta"])
    assert {"video", "frame", "time", "box", "track", "track_window", "score"} <= set(meta)
    assert all(abs(w["time"] - meta["time"]) <= spec.window_seconds for w in meta["track_window"])
    assert meta["frame"] in [w["frame"] for w in meta["track_window"]]


def test_crop_quality_and_spread_by_hand() -> None:
    # q = score * sqrt(w*h) * min(1, L / (2 L_min)): 0.8 * sqrt(40*90) * (100 / 160)
    assert crop_quality(0.8, 40, 90, 100.0, 80.0) == pytest.approx(0.8 * 60.0 * 0.625, rel=1e-12)
    assert crop_quality(0.8, 40, 90, 500.0, 80.0) == pytest.approx(48.0, rel=1e-12)
    bins = {k: Candidate(1.0, k, float(k), [0, 0, 1, 1], 1.0, "person", np.zeros((1, 1, 3), np.uint8))
            for k in (0, 1, 2, 5, 9)}
    assert [c.frame for c in spread(bins, 3)] == [0, 2, 9]  # first, middle, last of the track's bins
    assert [c.frame for c in spread(bins, 9)] == [0, 1, 2, 5, 9]


def test_a_track_without_a_crop_says_why() -> None:
    spec = VideoSpec(min_track_detections=3, crop_margin=(0.0, 0.0), crop_bin_seconds=1.0)
    book = TrackBook(spec, DenoiseSpec(min_width=32, min_height=64, min_laplacian_variance=80.0), lost_steps=2)
    rng = np.random.default_rng(0)
    sharp = rng.integers(0, 255, (200, 200, 3), dtype=np.uint8)
    flat = np.full((200, 200, 3), 128, np.uint8)
    for step in range(3):
        book.observe(step, step, step * 0.5, sharp, "pedestrian", 1, np.array([0, 0, 40, 100]), 0.9, "person")
        book.observe(step, step, step * 0.5, sharp, "pedestrian", 2, np.array([0, 0, 20, 30]), 0.9, "person")
        book.observe(step, step, step * 0.5, flat, "pedestrian", 3, np.array([0, 0, 40, 100]), 0.9, "person")
    book.observe(0, 0, 0.0, sharp, "pedestrian", 4, np.array([0, 0, 40, 100]), 0.9, "person")
    book.observe(0, 0, 0.0, sharp, "pedestrian", 5, np.array([0, 0, 40, 100]), 0.3, "person")  # weak boxes only
    book.observe(1, 1, 0.5, sharp, "pedestrian", 5, np.array([0, 0, 40, 100]), 0.4, "person")
    book.observe(2, 2, 1.0, sharp, "pedestrian", 5, np.array([0, 0, 40, 100]), 0.2, "person")
    tracks = book.close()
    outcome = {t.track_id: book.choose(t) for t in tracks}
    assert outcome[1][1] is None and [c.frame for c in outcome[1][0]] == [0, 2]  # bins 0 and 1 (t = 0, 0.5, 1.0)
    assert (outcome[2][1], outcome[3][1], outcome[4][1], outcome[5][1]) == ("too_small", "blurry", "too_short",
                                                                            "low_score")
    track_one = next(t for t in tracks if t.track_id == 1)
    refused = book.choose(track_one, confirm=lambda candidate, domain: candidate.frame == 2)
    assert [c.frame for c in refused[0]] == [2] and refused[1] is None  # bin 0 has no confirmed candidate
    assert book.choose(track_one, confirm=lambda candidate, domain: False) == ([], "unconfirmed")


@needs_videos
def test_the_build_flow_takes_videos_and_accounts_for_each(tmp_path: Path, vtest_frames) -> None:
    folder = tmp_path / "recordings"
    (folder / "cam1").mkdir(parents=True)
    write_video(folder / "cam1" / "walk.avi", vtest_frames[:40])
    write_video(folder / "street.avi", clip(STREET, 300, 40), fps=15)
    (folder / "readme.mp4").write_text("not a video")
    out = str(tmp_path / "out")
    overrides = {"input": {"kind": "video", "path": str(folder)}, "video": {"sample_fps": 2.0,
                                                                            "min_track_detections": 2}}
    summary = build_secmm(profile="demo", output_root=out, until="denoise", overrides=overrides)
    stages = {s["stage"]: s for s in summary["stages"]}
    assert list(stages) == ["videos", "ingest", "measure", "denoise"]
    assert (stages["videos"]["input"], stages["videos"]["accepted"], stages["videos"]["rejected"]) == (3, 2, 1)
    assert summary["rejected"]["videos:not_a_video"] == 1
    urls = {name: entry["url"] for name, entry in summary["artifacts"].items()}
    crops = Artifact(urls["video_crops"]).rows(["pool_id", "identity", "source_meta"])
    assert summary["videos"]["crops"] == len(crops) == stages["ingest"]["input"] > 0
    assert summary["balanced"] and summary["imbalance"] == []
    names = {json.loads(c["source_meta"])["video"] for c in crops}
    assert names <= {"cam1/walk.avi", "street.avi"} and "cam1/walk.avi" in names
    images = Artifact(urls["images"]).rows(["source", "identity"])
    assert sorted(r["identity"] for r in images) == sorted(c["identity"] for c in crops)

    again = build_secmm(profile="demo", output_root=out, until="denoise", overrides=overrides)
    assert all(s["skipped"] for s in again["stages"])  # complete: nothing recomputed
    for name in ("video_segments", "video_crops", "video_rejects"):  # a killed run: one segment unwritten
        Path(urls[name], "_manifest.json").unlink()
        Path(urls[name], "part-00001.parquet").unlink()
    resumed = build_secmm(profile="demo", output_root=out, until="denoise", overrides=overrides)
    videos = {s["stage"]: s for s in resumed["stages"]}["videos"]
    assert (videos["shards"], videos["shards_reused"], videos["input"]) == (3, 2, 3)
    assert Artifact(urls["video_segments"]).count_rows() == 3
    assert Artifact(urls["video_crops"]).count_rows() == len(crops)


def test_a_video_profile_validates_and_an_image_profile_skips_the_stage() -> None:
    profile = load_profile("demo", {"input": {"kind": "video", "path": "recordings"}})
    assert profile.input.kind == "video" and profile.video.sample_fps == 5.0
    from tasks.pool.videos import Videos

    assert Videos().applies(profile) and not Videos().applies(load_profile("demo"))
    plan = plan_segments([InputRef("x", "/nonexistent.avi", "pedestrian")], VideoSpec(), None)
    assert plan == [Segment(InputRef("x", "/nonexistent.avi", "pedestrian"), 0, 0, None)]
