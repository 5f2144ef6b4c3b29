"""Video files in: probe a recording, then stream its frames one at a time.

Decoding is PyAV's (FFmpeg's libraries bound to Python, wheels with their own FFmpeg): unlike
OpenCV's ``VideoCapture`` it says *why* a file does not open (no container, no video stream, no
decoder) and raises when decoding fails partway, so each case gets its own reason code. A frame is
converted to RGB only when it is sampled; nothing but the current frame is held.

A recording stored sideways (a phone or body camera held on its side) carries its display
rotation in the container (a ``rotate`` tag or a display matrix, which FFmpeg hands to each
decoded frame as side data): every frame is turned upright by it before anything sees it, so the
detector, the crops and the boxes all live in the upright picture, as a player shows it. Only
quarter turns exist in practice; another angle is rounded to the nearest quarter turn.

A still image in a video input (FFmpeg opens a JPEG or PNG as a one-frame "video" through its
image demuxers) is rejected as ``not_a_video``: images belong in an image input, where they are
verified, measured and denoised as images.

Frame numbers are counted from the stream's start: a frame's number is its presentation time ×
the stream's average frame rate, rounded (the count itself when a frame has no timestamp), so a
segment that seeks to its first frame numbers frames exactly as a decode from the start does.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import av
import numpy as np

from rde.common.image_decoding import DecodeError
from rde.common.reasons import Reason


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about its first video stream (nothing decoded yet)."""

    width: int
    height: int
    fps: float
    declared_frames: int  # 0: the container does not say
    codec: str
    rotation: int = 0  # quarter turns counter-clockwise (degrees) that bring a stored frame upright


STILL_IMAGE_DEMUXERS = ("image2", "image2pipe")  # and every "<codec>_pipe" single-image demuxer


def upright(rgb: np.ndarray, rotation: int) -> np.ndarray:
    """A decoded frame turned as its display matrix says: ``rotation`` degrees counter-clockwise
    (FFmpeg's ``av_display_rotation_get`` convention, which PyAV's ``VideoFrame.rotation`` reports)."""
    turns = (rotation // 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, k=turns)) if turns else rgb


def quarter_turns(degrees: float | None) -> int:
    """A display rotation as a multiple of 90 in [0, 360)."""
    return round((degrees or 0.0) / 90.0) % 4 * 90


@dataclass
class DecodeOutcome:
    """Filled while frames stream: how many were read, the last frame number, and why decoding
    stopped early (None: it reached the end of the segment or of the file as declared)."""

    frames_read: int = 0
    last_frame: int = -1
    error: str | None = None


def _open(path: str) -> av.container.InputContainer:
    try:
        return av.open(path, mode="r", metadata_errors="ignore")
    except av.error.FFmpegError as exc:
        raise DecodeError(Reason.NOT_A_VIDEO, f"{path}: FFmpeg reads no media container from it ({exc.strerror or exc})"
                          ) from None


def probe(path: str, max_pixels: int) -> VideoInfo:
    """Open the file's first video stream and check it before any frame is decoded: a container
    (``not_a_video``), a video stream in it (``not_a_video``), a decoder for its codec
    (``unsupported_codec``), frames within ``max_pixels`` (``video_too_large``)."""
    with _open(path) as container:
        return _stream_info(path, container, max_pixels)


def _stream_info(path: str, container: av.container.InputContainer, max_pixels: int) -> VideoInfo:
    if container.format.name in STILL_IMAGE_DEMUXERS or container.format.name.endswith("_pipe"):
        raise DecodeError(Reason.NOT_A_VIDEO, f"{path} is a still image ({container.format.name}), not a recording: "
                          "images go in an image input (input.kind: folder or paths)")
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["none"]
        raise DecodeError(Reason.NOT_A_VIDEO, f"{path} holds no video stream (streams: {', '.join(kinds)})")
    stream = container.streams.video[0]
    try:
        codec = stream.codec_context.name
    except Exception as exc:  # PyAV has no decoder for the stream's codec
        raise DecodeError(Reason.UNSUPPORTED_CODEC, f"{path}: no decoder for its video stream ({exc})") from None
    if not codec or codec == "none":
        raise DecodeError(Reason.UNSUPPORTED_CODEC, f"{path}: no decoder for its video stream's codec")
    width, height = int(stream.codec_context.width or 0), int(stream.codec_context.height or 0)
    if width * height > max_pixels:
        raise DecodeError(Reason.VIDEO_TOO_LARGE, f"{width}x{height} frames ({width * height} pixels) exceed "
                          f"video.max_pixels {max_pixels}")
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    if fps <= 0:
        fps = 25.0  # a stream without a rate: FFmpeg's own default
    rotation = _first_rotation(container, stream)
    if rotation in (90, 270):
        width, height = height, width
    return VideoInfo(width, height, fps, int(stream.frames or 0), codec, rotation)


def _first_rotation(container: av.container.InputContainer, stream: av.video.stream.VideoStream) -> int:
    """The display rotation the first decoded frame carries (0 when it decodes to nothing: the
    stream's own errors are reported where its frames are read)."""
    try:
        for frame in container.decode(stream):
            return quarter_turns(frame.rotation)
    except av.error.FFmpegError:
        return 0
    return 0


def sampled_frames(path: str, info: VideoInfo, start: int, stop: int | None, step: int,
                   outcome: DecodeOutcome) -> Iterator[tuple[int, float, np.ndarray]]:
    """(frame number, time in seconds, upright RGB frame) of every frame ``start ≤ n < stop`` with
    ``n % step == 0``. Seeks to the key frame before ``start`` (decoding from there), stops at
    ``stop`` (None: the end). A decode error partway ends the stream with ``outcome.error`` set;
    what was yielded before it stands. Reaching the file's end before the frames the container
    declares is reported the same way (a truncated file decodes without an error in FFmpeg)."""
    with _open(path) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        start_time = float(stream.start_time * stream.time_base) if stream.start_time is not None else 0.0
        if start > 0:
            target = start / info.fps + start_time
            container.seek(int(target / stream.time_base), stream=stream, backward=True, any_frame=False)
        count = None  # frame numbers from timestamps; counted when a frame has none
        frames = container.decode(stream)
        while True:
            try:
                frame = next(frames)
            except StopIteration:
                break
            except av.error.FFmpegError as exc:
                where = f"after frame {outcome.last_frame}" if outcome.last_frame >= 0 else "at its first frame"
                outcome.error = f"decoding failed {where}: {exc.strerror or exc}"
                return
            if frame.time is not None:
                number = round((float(frame.time) - start_time) * info.fps)
            else:
                number = 0 if count is None else count + 1
            count = number
            if number < start:
                continue
            if stop is not None and number >= stop:
                return
            outcome.frames_read += 1
            outcome.last_frame = number
            if number % step == 0:
                rgb = frame.to_ndarray(format="rgb24")
                yield number, number / info.fps, upright(rgb, quarter_turns(frame.rotation))
    expected = info.declared_frames if stop is None else min(info.declared_frames, stop)
    if info.declared_frames and outcome.last_frame + 1 < expected:
        outcome.error = (f"decoding ended after frame {outcome.last_frame}, before the {info.declared_frames} frames "
                         "the container declares (a truncated file?)")
