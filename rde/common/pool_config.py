"""The pool stages' profile sections: where the inputs come from (``input``), reading them
(``ingest``), video input (``video`` and its ``tracker``), what a crop's track says (``track_facts``) and
the filters that reject unusable images (``denoise``).

Their logic is in ``rde.common`` (ingest, video_input, video_tracks, track_context, expert_check,
denoise) because every flow starts from the same pool, so their parameters sit here beside it, below
every pipeline that reads them. ``rde.profile`` composes them with the pipelines' sections into a
``Profile``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from models.backends.track_facts import MotionOptions
from models.domains import SizeRule
from models.specs import Strict


class InputSpec(Strict):
    """Where the images come from: the bundled demo pool, a folder, a Parquet file of paths,
    sharded image datasets (WebDataset tars, image-bytes Parquet), locally or on object storage, or
    videos (a folder of recordings, or a Parquet file of their paths) that the ``videos`` stage
    detects, tracks and crops before ingest."""

    kind: Literal["pool", "folder", "paths", "video", "webdataset", "image_parquet"] = Field(
        "pool", description="What input.path is: a pool artifact, a folder of images, a Parquet file with a "
        "'path' column, (video) a folder of video files or a Parquet file of their paths, (webdataset) a "
        "WebDataset tar shard or a folder of them, or (image_parquet) a Parquet file with an image-bytes column "
        "(img2dataset's, Hugging Face datasets') or a folder of them.")
    path: str = Field("data/demo_pool", description="The pool, folder, Parquet file or shard(s): a path (relative "
                      "to the project root, or absolute) or, except for video, an fsspec URL such as "
                      "s3://bucket/prefix/.")
    default_domain: str | None = Field(None, description="The domain of an image whose subfolder or row names "
                                       "none (one of domains; default: the first).")
    # A folder input is confined to itself; real paths (after links and '..') outside are rejected as outside_root.
    roots: list[str] = Field(default_factory=list, description="Folders or URL prefixes (s3://bucket/prefix/) a "
                             "'paths' list may point into; empty: the list file's own folder (profile file only, "
                             "not a run parameter).")
    confine: bool = Field(True, description="Reject files whose real path leads outside the allowed roots; false "
                          "reads any path the worker can read, for trusted inputs only (profile file only).")


class IngestSpec(Strict):
    """Reading the inputs into shards of images, with limits on what one file may be."""

    shard_size: int = Field(256, ge=1, description="Images per ingest shard (one task each).")
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1, description="Larger files are rejected as "
                                "file_too_large (bytes; default 64 MiB).")
    max_pixels: int = Field(50_000_000, ge=1, description="Images with more pixels are rejected as "
                            "decompression_bomb (width × height).")
    read_attempts: int = Field(4, ge=1, description="Tries of one object-store read that fails for a reason "
                               "that may pass (dropped connection, timeout, throttling) before it is read_error.")
    retry_backoff_s: float = Field(0.5, ge=0.0, description="Wait before the second try of an object-store read; "
                                   "doubled before each further one (at most 8 s).")


class TrackerSpec(Strict):
    """ByteTrack's association thresholds (ultralytics' ``BYTETracker``; its defaults but the scores,
    which follow the detector's: the video stage detects down to ``low_score``)."""

    high_score: float = Field(0.5, gt=0.0, le=1.0, description="Detections scoring at least this are matched "
                              "first (ByteTrack's first association).")
    low_score: float = Field(0.2, gt=0.0, le=1.0, description="Detections between this and high_score only "
                             "extend existing tracks (second association); the detector runs at this threshold.")
    new_track_score: float = Field(0.6, gt=0.0, le=1.0, description="An unmatched detection starts a track only "
                                   "when it scores at least this.")
    match_threshold: float = Field(0.8, gt=0.0, le=1.0, description="Largest IoU distance (1 - IoU, fused with "
                                   "the score) of an accepted match.")
    lost_seconds: float = Field(2.0, gt=0.0, description="A track unseen for longer ends (ByteTrack's buffer, in "
                                "seconds of video rather than frames).")


_MOTION = MotionOptions()


class TrackFactsSpec(Strict):
    """What a crop's video track says about its subject (``models.backends.track_facts``): the
    thresholds of the motion, direction, distance and place facts captions and queries may state
    (defaults: ``MotionOptions``, where they were measured)."""

    window_s: float = Field(_MOTION.window_s, gt=0.0,
                            description="The velocity is fitted over the track's boxes within this many seconds "
                                        "of the crop's frame.")
    min_points: int = Field(_MOTION.min_points, ge=2, description="Fewer boxes in that window: no motion fact.")
    direction_ratio: float = Field(_MOTION.direction_ratio, ge=0.0,
                                   description="A direction is said when one axis of the velocity is at least this "
                                               "many times the other (0: never; for a camera at ground level, where "
                                               "down the image does not mean toward the camera).")
    direction_min_speed: float = Field(_MOTION.direction_min_speed, ge=0.0,
                                       description="No direction below this speed.")
    near_height: float = Field(_MOTION.near_height, ge=0.0, le=1.0,
                               description="A box at least this share of the frame's height is near the camera.")
    far_height: float = Field(_MOTION.far_height, ge=0.0, le=1.0,
                              description="A box at most this share is far from it.")
    side_share: float = Field(_MOTION.side_share, ge=0.0, le=0.5,
                              description="A box centred in the outer share of the frame's width is on its left or "
                                          "right side.")
    height_share: float = Field(_MOTION.height_share, ge=0.0, le=0.5,
                                description="A box whose bottom edge lies in the top or bottom share of the frame's "
                                            "height is in its upper or lower part.")


class VideoSpec(Strict):
    """The ``videos`` stage (input.kind: video): decode, sample, detect, track, crop."""

    sample_fps: float = Field(5.0, gt=0.0, description="Frames per second of video that are detected and "
                              "tracked (every n-th frame, n = round(video fps / sample_fps), at least 1).")
    segment_seconds: float = Field(600.0, gt=0.0, description="One shard per this much of a video; a track "
                                   "crossing a segment boundary counts as two tracks (two identities).")
    max_pixels: int = Field(3840 * 2160, ge=1, description="Videos whose frames have more pixels are rejected "
                            "as video_too_large before any frame is decoded.")
    crops_per_track: int = Field(4, ge=1, description="Crops kept per track, spread over its life.")
    crop_bin_seconds: float = Field(2.0, gt=0.0, description="A track's life is cut into bins this long; each "
                                    "keeps its best crop (quality = score × √area × sharpness factor).")
    min_track_detections: int = Field(3, ge=1, description="Tracks detected on fewer sampled frames give no "
                                      "crop (too_short).")
    crop_min_score: float = Field(0.5, ge=0.0, le=1.0, description="Crops are cut only from boxes scoring at "
                                  "least this (weaker boxes only continue tracks; a track without one: low_score).")
    confirm_crops: bool = Field(False, description="Re-detect each chosen crop (as stored: JPEG) and keep it only "
                                "when the detector finds exactly one target of its domain scoring at least "
                                "confirm_score on it (denoise's count, checked before a crop is spent; up to five "
                                "candidates per bin tried, best first).")
    confirm_score: float = Field(0.5, ge=0.0, le=1.0, description="The score a target needs on a crop for "
                                 "confirm_crops (set it to models.detector.score_threshold, which denoise uses).")
    crop_margin: tuple[float, float] = Field((0.1, 0.1), description="Context around a box: a fraction of its "
                                             "width and height on each side.")
    window_seconds: float = Field(2.0, ge=0.0, description="A crop's source_meta holds the track's boxes within "
                                  "this many seconds on either side of its frame (the motion window).")
    detect_batch: int = Field(8, ge=1, description="Sampled frames detected per batch (memory is bounded by it).")
    jpeg_quality: int = Field(92, ge=1, le=100, description="JPEG quality of the stored crops.")
    tracker: TrackerSpec = Field(TrackerSpec(), description="ByteTrack's thresholds.")
    camera: Literal["fixed", "moving"] = Field("fixed", description="Whether the camera moves (on a vehicle, "
                                               "panning). Crops from a moving camera carry it in source_meta and "
                                               "get no motion, direction or place facts (track_facts): in the "
                                               "frame, a parked car seen from a tram moves.")


class DenoiseSpec(Strict):
    """GTR+ denoising thresholds (paper Sec. 3.3): w<32 or h<64, Laplacian var <80, count≠1.

    ``min_width``/``min_height`` are the paper's rule for upright people and apply to every domain
    with no size rule of its own (``size_by_domain``, filled from each domain file's
    ``subject.size`` where the profile names none).
    """

    min_width: int = Field(32, ge=1, description="Narrower images are too_small, for domains without a "
                           "size_by_domain rule (pixels).")
    min_height: int = Field(64, ge=1, description="Lower images are too_small, for domains without a "
                            "size_by_domain rule (pixels).")
    size_by_domain: dict[str, SizeRule] = Field(default_factory=dict, description="A minimum width and height "
                                                "per domain name, replacing min_width/min_height for it.")
    min_laplacian_variance: float = Field(80.0, ge=0.0, description="Images whose Laplacian variance (a "
                                          "sharpness measure) is lower are rejected as blurry.")
    required_target_count: int | None = Field(1, ge=0, description="Targets of the domain the detector must "
                                              "find in an image (no_target, multiple_targets); null disables "
                                              "the count filter.")
    deduplicate: bool = Field(True, description="Reject an image whose bytes equal an earlier input's as "
                              "duplicate.")

    def size_rule(self, domain: str | None) -> SizeRule:
        """The size rule for images of ``domain`` (the default rule when it has none of its own)."""
        rule = self.size_by_domain.get(domain) if domain is not None else None
        return rule or SizeRule(min_width=self.min_width, min_height=self.min_height)
