"""Videos the videos stage cannot take, each a rejected row with its reason before any frame is
decoded (so no detector is needed): a video stream whose codec FFmpeg cannot decode, and URLs in a
video path list (videos are local files). Other hostile videos: test_video_input.py."""

from __future__ import annotations

from pathlib import Path

import av
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rde.common.image_decoding import DecodeError
from rde.common.pool_config import DenoiseSpec, InputSpec, VideoSpec
from rde.common.video_decoding import probe
from rde.common.video_input import list_videos, plan_segments, process_segment, video_roots


def _undecodable_avi(path: Path) -> Path:
    """A one-frame MPEG-4 AVI whose stream FourCC (in its strh and strf) is patched to one FFmpeg
    has no codec for: the container and its video stream read, no decoder takes the stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with av.open(str(path), "w") as out:
        stream = out.add_stream("mpeg4", rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
        for packet in [*stream.encode(frame), *stream.encode()]:
            out.mux(packet)
    data = path.read_bytes()
    assert data.count(b"FMP4") == 2  # strh's handler and strf's compression
    path.write_bytes(data.replace(b"FMP4", b"ZZZZ"))
    return path


def test_an_undecodable_codec_and_urls_in_a_video_list_are_rejected_rows(tmp_path: Path) -> None:
    clip = _undecodable_avi(tmp_path / "clips" / "zzzz.avi")
    with pytest.raises(DecodeError) as err:
        probe(str(clip), 10**8)
    assert err.value.reason == "unsupported_codec" and "no decoder for its video stream" in err.value.detail
    urls = ["s3://bucket/clip.mp4", "https://example.com/clip.mp4"]
    pq.write_table(pa.table({"path": [*urls, "clips/zzzz.avi"]}), tmp_path / "videos.parquet")
    spec = InputSpec(kind="video", path=str(tmp_path / "videos.parquet"))
    refs, _ = list_videos(spec, tmp_path, ["pedestrian"])
    roots = video_roots(spec, tmp_path)
    got = {}
    for segment in plan_segments(refs, VideoSpec(), roots):  # no detector: each is rejected before one runs
        result = process_segment(segment, VideoSpec(), DenoiseSpec(), [], None, roots, Path(segment.ref.source).name)
        got[segment.ref.source] = (result.reject["reason"], result.reject["detail"])
    assert {source: reason for source, (reason, _) in got.items()} == {
        urls[0]: "unsupported_url", urls[1]: "unsupported_url", str(clip): "unsupported_codec"}
    for url in urls:
        assert f"is a {url.split('://')[0]}:// URL: video lists name local files" in got[url][1], got[url]
