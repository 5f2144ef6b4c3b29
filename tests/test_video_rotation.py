"""Recordings held sideways and stills in a video input.

A phone or body camera stores its picture turned and says so in the container (a display
matrix): the videos stage turns every frame upright before detection, so a sideways copy of a clip
gives the upright clip's crops. The copies here are lossless (PNG in a QuickTime container) so that
"the same crops" can mean byte-identical ones: both files decode to the same pixels, one turned.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image
from test_video_input import DOMAINS, SPEC, VTEST, _run_folder, clip, needs_videos, write_video

from models.backends.detectors import Detections, load_detector
from rde.common.pool_config import DenoiseSpec, InputSpec
from rde.common.video_decoding import probe, quarter_turns, upright
from rde.common.video_input import detector_for_video, list_videos, plan_segments, process_segment, video_roots
from rde.profile import load_profile


def write_lossless(path: Path, frames: list[np.ndarray], rotation: int = 0) -> Path:
    """RGB frames as PNG frames in a .mov (lossless), with a display rotation of ``rotation`` degrees."""
    return write_video(path, frames, codec="png", pix_fmt="rgb24", rotation=rotation)


def test_quarter_turns_and_upright_by_hand() -> None:
    assert [quarter_turns(d) for d in (None, 0.0, 90.0, -90.0, 180.0, -180.0, 89.6, 271.0)] == \
        [0, 0, 90, 270, 180, 180, 90, 270]
    stored = np.arange(6, dtype=np.uint8).reshape(2, 3, 1)  # [[0 1 2], [3 4 5]]
    assert upright(stored, 0) is stored
    # 90° counter-clockwise: the right column becomes the top row
    assert upright(stored, 90)[..., 0].tolist() == [[2, 5], [1, 4], [0, 3]]
    assert upright(stored, 270)[..., 0].tolist() == [[3, 0], [4, 1], [5, 2]]
    assert upright(stored, 180)[..., 0].tolist() == [[5, 4, 3], [2, 1, 0]]


@needs_videos
def test_a_sideways_recording_gives_the_upright_recordings_crops(tmp_path: Path) -> None:
    frames = clip(VTEST, 100, 30)
    detector = load_detector(detector_for_video(load_profile("demo").models.detector, SPEC))
    upright_dir, sideways_dir = tmp_path / "upright", tmp_path / "sideways"
    upright_dir.mkdir()
    sideways_dir.mkdir()
    write_lossless(upright_dir / "clip.mov", frames)
    # stored turned a quarter clockwise; the display matrix turns it back counter-clockwise
    write_lossless(sideways_dir / "clip.mov", [np.rot90(f, k=-1) for f in frames], rotation=90)

    info = probe(str(sideways_dir / "clip.mov"), SPEC.max_pixels)
    assert (info.width, info.height, info.rotation) == (frames[0].shape[1], frames[0].shape[0], 90)

    base = _run_folder(upright_dir, detector)["clip.mov"][0]
    turned = _run_folder(sideways_dir, detector)["clip.mov"][0]
    assert base.reject is None and len(base.crops) >= 2
    assert [c["image_bytes"] for c in turned.crops] == [c["image_bytes"] for c in base.crops]
    assert [c["pool_id"] for c in turned.crops] == [c["pool_id"] for c in base.crops]
    for a, b in zip(base.crops, turned.crops, strict=True):
        meta_a, meta_b = json.loads(a["source_meta"]), json.loads(b["source_meta"])
        assert meta_b.pop("rotation") == 90 and "rotation" not in meta_a
        assert meta_a.pop("video_id") != meta_b.pop("video_id")  # two files, two ids; all else equal:
        assert meta_a == meta_b  # boxes and frame size in the upright picture
    assert turned.segment["width"] == base.segment["width"] == frames[0].shape[1]


def test_a_still_image_in_a_video_folder_is_not_a_video(tmp_path: Path) -> None:
    folder = tmp_path / "videos"
    folder.mkdir()
    rgb = np.zeros((48, 64, 3), np.uint8)
    Image.fromarray(rgb).save(folder / "still.jpg")
    Image.fromarray(rgb).save(folder / "still.png")
    write_lossless(folder / "moving.mov", [rgb, rgb + 1])

    spec = InputSpec(kind="video", path=str(folder))
    refs, _ = list_videos(spec, folder, [d.name for d in DOMAINS])
    roots = video_roots(spec, folder)
    rows = {}
    for segment in plan_segments(refs, SPEC, roots):
        name = Path(segment.ref.source).name
        rows[name] = process_segment(segment, SPEC, DenoiseSpec(), DOMAINS, _NoDetector(), roots, name)
    assert {n: (r.reject or {}).get("reason") for n, r in rows.items()} == \
        {"still.jpg": "not_a_video", "still.png": "not_a_video", "moving.mov": None}
    assert "still image" in rows["still.jpg"].reject["detail"]
    assert rows["moving.mov"].segment["frames_read"] == 2


class _NoDetector:
    """A detector that sees nothing (the still-image test needs decoding, not detection)."""

    def detect(self, images: list[np.ndarray]) -> list[Detections]:
        return [Detections(np.zeros((0, 4), np.float32), [], np.zeros(0, np.float32)) for _ in images]
