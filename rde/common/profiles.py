"""Profiles: YAML files validated by pydantic. A profile is data, never code.

Unknown keys and wrong types are rejected with a message naming the key and the file.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from models.backends.detectors import known_classes
from models.backends.track_facts import MotionOptions
from models.domains import Domain, DomainError, DomainSet, SizeRule, load_domain
from models.specs import BUNDLED_LLM, ModelSpec, ModelsSection, Strict
from storage.hashing import sha256_json

PROFILE_DIR = Path(__file__).resolve().parents[2] / "profiles"


class ProfileError(ValueError):
    """A profile could not be loaded; the message is meant for the user as it is."""


# The text LLM a GPU profile names for DAP's queries and the template gallery (profiles/production.yaml's;
# tests/test_profiles.py keeps the two equal): suggested by the error below.
GPU_TEXT_LLM: dict[str, Any] = {"backend": "vllm", "model_id": "Qwen/Qwen3-4B-Instruct-2507", "batch_size": 64,
                                "device": "cuda", "dtype": "bfloat16", "options": {"limit_mm_per_prompt": {}}}
# The bundled CPU model an unset text-LLM role falls back to, written out: a GPU profile that means
# to use it says so.
BUNDLED_TEXT_LLM: dict[str, Any] = BUNDLED_LLM
TEXT_LLM_ROLES = {"query_generator": "DAP's queries", "template_generator": "the template gallery"}


def _flow_yaml(value: Any) -> str:
    """``value`` as one line of YAML flow style (what a profile would hold)."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip()


def gpu_evidence(profile: Profile) -> str | None:
    """The first key that puts the profile on a GPU (a ``cuda`` device, or in-process vLLM, which
    needs one), as ``key: value``; None for a profile that runs on the CPU (``auto`` decides at
    run time, so it does not count)."""
    models = profile.models
    specs: list[tuple[str, Any]] = [("models.detector", models.detector)]
    specs += [(f"models.{role}", getattr(models, role)) for role in ("image_embedder", "text_encoder", "teacher")]
    specs += [(f"models.{role}[{i}]", spec) for role in ("experts", "generators")
              for i, spec in enumerate(getattr(models, role))]
    specs += [("training.model", profile.training.model), ("vedje.backbone", profile.vedje.backbone),
              ("vedje.first_stage", profile.vedje.first_stage), ("vedje.joint_encoder", profile.vedje.joint_encoder)]
    for key, spec in specs:
        if spec is None:
            continue
        if str(spec.device).startswith("cuda"):
            return f"{key}.device: {spec.device}"
        if spec.backend == "vllm":
            return f"{key}.backend: vllm"
    return None


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
    """GTR+ denoising thresholds (paper Sec. 5.1): w<32 or h<64, Laplacian var <80, count≠1.

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


class NearDuplicateSpec(Strict):
    """The near-duplicate filter of the denoised pool (SemDeDup-style, ``rde/secmm/near_duplicates.py``):
    within each domain, an image whose image-embedding cosine to a sharper kept image of its cluster
    is above ``threshold`` is rejected as ``near_duplicate``, naming that kept image."""

    threshold: float = Field(0.95, gt=0.0, le=1.0, description="Cosine (of L2-normalised image embeddings) "
                             "above which an image is a near duplicate of a kept one and is rejected; a cosine "
                             "equal to it is kept, and 1.0 keeps every image.")
    cluster_size: int = Field(1000, ge=2, description="A domain of at most this many images is compared pair "
                              "by pair; a larger one is split by k-means into ceil(images / cluster_size) "
                              "clusters, compared within each (a pair split across two clusters is missed).")
    seed: int = Field(0, description="Seed of that k-means clustering.")


class SamplingSpec(Strict):
    """Centroid-Guided Diversity Sampling sizes (paper Sec. 3.1)."""

    clusters_per_domain: int = Field(100, ge=1, description="K of the k-means clustering of each domain's "
                                     "image embeddings.")
    min_per_cluster: int = Field(100, ge=0, description="Fewest images drawn from a cluster (capped at its "
                                 "size; at most max_per_cluster).")
    max_per_cluster: int = Field(1000, ge=1, description="Most images drawn from a cluster: each draws a "
                                 "seeded number between min_per_cluster and this.")
    seed: int = Field(0, description="Seed of the clustering and the draws.")
    kmeans_backend: Literal["auto", "sklearn", "sklearn-minibatch", "faiss", "streaming"] = Field(
        "auto", description="k-means implementation: auto = scikit-learn in memory up to minibatch_above images "
        "per domain and streaming above; streaming = always; the others hold all vectors in memory at any size.")
    # streaming k-means is rde.secmm.cgds.kmeans_streaming
    minibatch_above: int = Field(20_000, ge=1, description="With auto: above this many images per domain, "
                                 "streaming k-means reads the vectors one pool shard at a time, never all at once.")
    stream_passes: int = Field(5, ge=1, description="Streaming: at most this many Lloyd passes (it stops "
                               "earlier when no label changes).")
    stream_batch: int = Field(4096, ge=1, description="Streaming: vectors per step (its distance matrix is "
                              "stream_batch × K floats).")
    stream_init_per_cluster: int = Field(256, ge=1, description="Streaming: the start is k-means on a seeded "
                                         "sample of min(N, this × K) vectors, held in memory (131 MB at K=100, "
                                         "dim 1280).")
    stream_init_tries: int = Field(10, ge=1, description="Streaming: k-means++ starts tried on that sample.")

    @model_validator(mode="after")
    def _bounds(self) -> SamplingSpec:
        if self.min_per_cluster > self.max_per_cluster:
            raise ValueError("sampling.min_per_cluster must not exceed sampling.max_per_cluster")
        return self


class AnnSpec(Strict):
    """The approximate top-K index used above a gallery size (faiss IVF-Flat, inner product), and the
    recall check that guards it: ``check_queries`` sampled queries are also searched exactly; below
    ``min_recall`` (recall@K against exact) the search falls back to exact. Defaults measured in
    benchmarks/ann_recall.py (recall@10 ≥ 0.99 on clustered 768-d embeddings at 100k)."""

    nlist: int | None = Field(None, ge=1, description="Inverted lists of the index; null = 4·√N for N "
                              "indexed vectors.")
    nprobe: int = Field(32, ge=1, description="Lists visited per query.")
    train_per_list: int = Field(64, ge=1, description="Training vectors per list (a seeded sample of the "
                                "indexed vectors).")
    # building the index costs ~30× an exact search of 200 queries at 100k (benchmarks/ann_recall.py)
    min_queries: int = Field(5_000, ge=1, description="Fewer queries than this are searched exactly at any "
                             "gallery size, since building the index would cost more than it saves.")
    check_queries: int = Field(64, ge=0, description="Queries also searched exactly to measure the index's "
                               "recall; 0 = no check.")
    min_recall: float = Field(0.99, ge=0.0, le=1.0, description="Below this recall@K against the exact search, "
                              "the search falls back to exact.")
    seed: int = Field(0, description="Seed of the training sample and the checked queries.")


class RetrievalSpec(Strict):
    """Multi-Expert Collaborative Filtering (paper Eq. 1): top-K per expert, union of candidates."""

    top_k: int = Field(1000, ge=1, description="Candidates each expert contributes per query (the union of "
                       "all experts' top-K is the candidate set).")
    index_above: int = Field(200_000, ge=1, description="Gallery size above which an approximate (ANN) index "
                             "is searched instead of an exact search.")
    ann: AnnSpec = Field(default_factory=AnnSpec, description="The approximate index and its recall check.")


class QueriesSpec(Strict):
    """Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11) and query post-processing."""

    per_domain: int = Field(100, ge=1, description="Queries kept per domain; valid ones beyond it are "
                            "rejected as over_target.")
    min_words: int = Field(5, ge=1, description="Shorter queries are rejected as too_short (words).")
    max_words: int = Field(15, ge=1, description="Longer queries are rejected as too_long (words; at least "
                           "min_words).")
    per_request: int = Field(10, ge=1, description="Queries asked for in one prompt (its [part_num]).")
    keywords_per_pos: int = Field(12, ge=1, description="Nouns, verbs and adjectives (each) sampled from the "
                                  "caption pool into each prompt.")
    max_rounds: int = Field(10, ge=1, description="Prompts per domain at most while per_domain is not reached.")
    temperature: float = Field(0.8, ge=0.0, description="Sampling temperature of the query generator.")
    max_tokens: int = Field(256, ge=16, description="Token budget of one query-generation answer.")
    near_duplicate_cosine: float = Field(0.92, gt=0.0, le=1.0, description="A query whose text-embedding "
                                         "cosine with a kept query is at least this is a near_duplicate.")
    near_duplicate_attributes: bool = Field(True, description="Count a near duplicate only when both queries "
                                            "state the same attribute values (\"red top\" and \"black top\" "
                                            "stay two queries).")
    echo_max_word_edits: int = Field(1, ge=0, description="A query at most this many words away from a line "
                                     "of the prompt's examples is rejected as echoes_example.")
    echo_span_content_words: int = Field(3, ge=1, description="A run copied from the examples that holds this "
                                         "many content words makes a query echoes_example.")
    vocabulary_check: bool = Field(True, description="Reject as off_vocabulary a query with a content word the "
                                   "domain's caption pool never uses.")
    keyword_check: bool = Field(True, description="Reject as no_keyword a query that uses no noun or adjective "
                                "sampled into its request.")
    # honoured by llama.cpp (offline, and servers through openai-http's grammar_field)
    constrained_decoding: bool = Field(False, description="Constrain generation with a GBNF grammar built per "
                                       "request from its sampled keywords and caption-pool phrases (llama.cpp "
                                       "backends).")
    grammar_phrases: int = Field(6, ge=1, description="Caption-pool phrases per sampled keyword offered in the "
                                 "grammar.")
    grammar_min_count: int = Field(2, ge=1, description="A noun enters the grammar once this many pool "
                                   "captions use it.")
    # fewer is often a measurement slip: "red bottoms" from a red jacket's hem
    grammar_min_pair_count: int = Field(3, ge=1, description="An adjective on a noun, a pair of nouns or a "
                                        "noun as subject enters the grammar once this many pool captions say it.")
    caption_sample_per_domain: int = Field(40, ge=1, description="Images per domain captioned for the caption "
                                           "pool that the query statistics come from.")
    caption_max_tokens: int = Field(80, ge=8, description="Token budget of one caption-pool caption (one or "
                                    "two sentences).")
    caption_file: str | None = Field(None, description="A CUHK-PEDES-style JSON file of captions to use as "
                                     "the caption pool instead of captioning images.")
    seed: int = Field(0, description="Seed of the caption sample, the keyword draws and the generator.")

    @model_validator(mode="after")
    def _lengths(self) -> QueriesSpec:
        if self.min_words > self.max_words:
            raise ValueError("queries.min_words must not exceed queries.max_words")
        return self


class EvaluationSpec(Strict):
    """What ``evaluate`` scores besides the built benchmark: hand-labelled check sets (YAML files
    like data/check_set/queries.yaml, relevance by identity over a pool artifact)."""

    check_sets: list[str] = Field(default_factory=list, description="Hand-labelled check-set YAML files scored "
                                  "besides the built benchmark (their identities are kept out of training).")
    check_set_pool: str = Field("data/demo_pool", description="The pool artifact the check sets' identities "
                                "refer to.")
    benchmark: str | None = Field(None, description="rde evaluate: the benchmark scored (a build-secmm benchmark "
                                  "folder or s3:// prefix, its dataset folder, a check-set YAML or a clip set); "
                                  "unset: this profile's build-secmm benchmark.")
    models: list[str] = Field(default_factory=list, description="rde evaluate: the retrievers compared, as model "
                              "specs (transformers-clip:, sentence-transformers:, open-clip:, expert:, student:, "
                              "python:, scores:); empty: each of this profile's experts.")
    labels: Literal["verified", "pending", "all"] | None = Field(None, description="rde evaluate: which labels "
                                                                 "count as relevant; unset: verified when any "
                                                                 "exist, else pending (the unreviewed MECF union).")
    reference: str | None = Field(None, description="rde evaluate: the model the others' paired differences are "
                                  "taken against (one of models); unset: the first.")
    map_cutoffs: list[int] = Field([10, 20, 30], min_length=1, description="rde evaluate: the cut-offs K of "
                                   "mAP@K (the paper's 10, 20, 30).")
    run_depth: int = Field(100, ge=1, description="rde evaluate: items per query in each model's TREC run file.")
    embed_group_items: int = Field(4096, ge=1, description="rde evaluate: gallery items one embedding task "
                                   "encodes (consecutive gallery shards, each decoded alone; one task and "
                                   "one vectors shard per group, one shard-range run's unit with fan-out).")
    bootstrap_resamples: int = Field(10000, ge=100, description="rde evaluate: bootstrap resamples of the "
                                     "queries for each 95 % interval.")


class ReviewSpec(Strict):
    """The human review of the MECF candidates (DSMM-TBIR Phase 3): the static review site and the
    Label Studio tasks written next to the benchmark."""

    page_size: int = Field(48, ge=1, le=1000, description="Candidates per page of the review site, and per "
                           "Label Studio task (a query with more candidates becomes several tasks).")
    thumbnail_height: int = Field(256, ge=16, le=4096, description="Gallery images taller than this are "
                                  "scaled down for the review's images/ folder; smaller ones are copied as "
                                  "they are.")
    label_studio_images: str | None = Field(None, description="Base URL under which Label Studio reads the "
                                            "review's images/ folder, when the server runs elsewhere (a web "
                                            "server or bucket that publishes the folder). Unset: Label Studio's "
                                            "local-files serving on this machine (/data/local-files/?d=<the "
                                            "image's absolute path>, with LABEL_STUDIO_LOCAL_FILES_DOCUMENT_ROOT=/"
                                            ").")


class RetrySpec(Strict):
    """Generator calls that fail for a transient reason (timeout, server error) are retried with
    exponential backoff, then recorded as rejected rows."""

    max_attempts: int = Field(3, ge=1, description="Calls per request in all, the first included.")
    backoff_s: float = Field(0.5, ge=0.0, description="Wait before the first retry, doubled for each next one "
                             "(seconds).")


class TemplateGallerySpec(Strict):
    """GTR+ advanced tier: the extract-and-expand loop that builds the template gallery."""

    sample_captions: int = Field(24, ge=1, description="Tier-1/2 captions sampled as the extraction round's "
                                 "input.")
    captions_per_request: int = Field(6, ge=1, description="Captions shown in one extraction request.")
    rounds: int = Field(2, ge=0, description="Expansion rounds after the extraction round.")
    max_templates: int = Field(64, ge=1, description="Templates kept; valid ones beyond it are rejected as "
                               "gallery_full.")
    min_words: int = Field(6, ge=1, description="Shorter templates are rejected as too_short (words).")
    max_words: int = Field(60, ge=1, description="Longer templates are rejected as too_long (words).")
    max_tokens: int = Field(256, ge=16, description="Token budget of one template-generation answer.")
    temperature: float = Field(0.7, ge=0.0, description="Sampling temperature of the template generator.")
    seed: int = Field(0, description="Seed of the caption sample and the generator.")
    measurable_slots: list[str] | None = Field(None, description="The slots the captioner can fill from what it "
                                               "measures; a template with another slot is rejected as "
                                               "unmeasurable_slot (null: every slot of the prompt file's "
                                               "vocabulary, for an MLLM that sees hair and shoes).")


class LargeFineSpec(Strict):
    """``build-largefine``: GTR+ three-tier captioning (paper Sec. 3.1) into LargeFine-style shards."""

    domains: list[str] = Field(default_factory=list, description="Domains captioned (unset: the profile's first "
                               "domain); images of other domains are rejected as out_of_domain.")
    tier_prompt: str = Field("gtr_tiers", description="Prompt file prompts/<name>.yaml of the tiers: gtr_tiers "
                             "has the paper's wording, gtr_tiers_small suits tiny LLMs.")
    shard_size: int = Field(64, ge=1, description="Images per captioning task.")
    max_images: int | None = Field(None, ge=1, description="Cap on the accepted images captioned; null = all.")
    neighbours_k: int = Field(10, ge=1, description="The hard negative is drawn from this many nearest "
                              "neighbours of an image (paper Eq. 1).")
    neighbour_index_above: int = Field(100_000, ge=1, description="Pool size above which the neighbours are "
                                       "searched in an approximate (ANN) index.")
    neighbour_ann: AnnSpec = Field(default_factory=AnnSpec, description="That approximate index and its recall "
                                   "check.")
    seed: int = Field(0, description="Seed of the hard-negative draw, the generator assignment and the "
                      "template choice.")
    temperature: float = Field(0.0, ge=0.0, description="Sampling temperature of the tier generators (0 = "
                               "greedy).")
    qa_max_tokens: int = Field(256, ge=16, description="Token budget of one Q&A answer (base and intermediate "
                               "tiers).")
    summary_max_tokens: int = Field(160, ge=16, description="Token budget of one summary (every tier's "
                                    "text is one).")
    min_qa_pairs: int = Field(2, ge=1, description="A Q&A answer with fewer distinct answered pairs is "
                              "rejected as malformed_qa.")
    min_words: int = Field(10, ge=1, description="A tier text with fewer words is rejected as too_short.")
    max_words: int = Field(200, ge=1, description="A tier text with more words is rejected as too_long.")
    max_repeated_sentence_share: float = Field(0.5, ge=0.0, le=1.0, description="A text with a larger share of "
                                               "repeated sentences (as generated) is rejected as repetitive.")
    drop_repeated_sentences: bool = Field(True, description="Keep only a sentence's first occurrence (each drop "
                                          "recorded in the row's cleaning).")
    boilerplate: list[str] = Field(default_factory=lambda: [
        "in the image", "in this image", "in the picture", "in the photo", "the image shows", "this image shows",
        "the picture shows", "in the target-image", "in target-image"],
        description="Phrases removed from every tier's text.")
    negative_mentions: list[str] = Field(default_factory=lambda: [
        "compare-image", "compare image", "both persons", "both of them", "the other person", "second person"],
        description="Phrases that name the hard-negative image, removed from intermediate and advanced texts.")
    retries: RetrySpec = Field(RetrySpec(), description="Retries of generator calls that fail for a transient "
                               "reason.")
    templates: TemplateGallerySpec = Field(TemplateGallerySpec(), description="The template gallery of the "
                                           "advanced tier.")
    webdataset: bool = Field(False, description="Also write the captions as WebDataset tar shards "
                             "(largefine_wds/): one sample per image, its image and a json of its tiers' texts.")

    @model_validator(mode="after")
    def _lengths(self) -> LargeFineSpec:
        if self.min_words > self.max_words:
            raise ValueError("largefine.min_words must not exceed largefine.max_words")
        return self


class TrainingSpec(Strict):
    """``train-saft`` / ``train-gtr``: a dual encoder trained on the captions of a ``build-largefine``
    run (DSMM-TBIR Sec. 3.3 / Table 8; GTR+ Sec. 3.2): the CPU model over cached tower features in
    memory, or a CLIP-like student from streamed pairs (``rde.training.pair_stream``)."""

    source_flow: str = Field("build-largefine", description="The flow whose largefine captions are the "
                             "training pairs.")
    model: ModelSpec | None = Field(None, description="The student: null = the CPU feature model over the "
                                    "bundled towers; a transformers-clip spec = any CLIP-like model by id or "
                                    "folder, its vision tower trained end to end.")
    max_pairs: int | None = Field(None, ge=2, description="Train on a seeded sample of this many pairs (the "
                                  "rest rejected as over_max_pairs); null = all.")
    views: int = Field(3, ge=1, description="The CPU model's cached views per image: view 0 the image, the others "
                       "random resized crops (a CLIP-like student draws a fresh crop at every step).")
    held_out_share: float = Field(0.3, gt=0.0, lt=1.0, description="Share of identities held out for the "
                                  "person-search evaluation.")
    epochs: int = Field(5, ge=1, description="Passes over the training pairs.")
    batch_size: int = Field(64, ge=2, description="Pairs per optimizer step.")
    lr_start: float = Field(5e-7, gt=0.0, description="Learning rate at the start of the linear warmup (SAFT: "
                            "5e-7).")
    lr_peak: float = Field(5e-6, gt=0.0, description="Learning rate after the warmup, then cosine-decayed to 0 "
                           "(SAFT: 5e-6).")
    warmup_frac: float = Field(0.1, ge=0.0, le=1.0, description="Share of the steps spent in the linear warmup.")
    weight_decay: float = Field(0.05, ge=0.0, description="AdamW weight decay.")
    tau_teacher: float = Field(0.05, gt=0.0, description="Temperature of the teacher's similarity distributions "
                               "(SAFT's τ_o).")
    alpha: float = Field(1.0, description="Weight of the SASS loss (and of CUSA's) in the SAFT objective.")
    beta: float = Field(0.75, description="Weight of the ISD loss in the SAFT objective.")
    saft_objective: Literal["itc", "itc+sass", "saft", "cusa", "hnm", "itc+iss"] = Field(
        "saft", description="train-saft's loss: saft = ITC + SASS + ISD; the others are its ablations and "
        "baselines (hnm: ITC with hard-negative mining).")
    train_text: bool = Field(False, description="Also train the text tower (SAFT keeps it frozen).")
    gtr_weighting: Literal["none", "fix", "ada"] = Field("ada", description="train-gtr's pair weights: none, "
                                                         "fix (w = q_txt) or ada (GMM confidence^β).")
    gamma: float = Field(0.2, ge=0.0, le=1.0, description="γ of ŝ = γ·s + (1 − γ)·q_txt, the score the GMM is "
                         "fitted on (GTR+ Eq. 7).")
    confidence_beta: float = Field(0.8, ge=0.0, description="β: a pair's weight is its GMM confidence to this "
                                   "power (GTR+ Eq. 10).")
    gmm_components: int = Field(2, ge=2, description="Components of the 1-D Gaussian mixture fitted after every "
                                "epoch.")
    gmm_min_fit_pairs: int = Field(10, ge=2, description="Pairs with and pairs without q_txt each need this many "
                                   "for a fit of their own; fewer keep weight 1.")
    seed: int = Field(0, description="Seed of the split, the pair sample, the crops and the initialisation.")
    processes: int = Field(1, ge=1, description="Training processes on this machine: above 1, data-parallel "
                           "(torch.distributed: gloo on the CPU, nccl with one GPU a rank when the student is on "
                           "a GPU): each step's batch is shared out, and its loss taken over the whole gathered "
                           "batch.")
    stream_above: int | None = Field(100_000, ge=0, description="The CPU model's cached features are held in "
                                     "memory up to this many captions and streamed from shards above it, as a "
                                     "CLIP-like student's images always are (null: always in memory).")
    shuffle_window: int = Field(4096, ge=2, description="Streamed pairs: each epoch takes the shards in a seeded "
                                "order and shuffles windows of this many consecutive pairs; memory holds a "
                                "window's ids and the shards it touches.")
    loader_workers: int = Field(2, ge=0, description="DataLoader worker processes that read streamed batches "
                                "(and decode, crop and preprocess a CLIP-like student's images); 0: in the "
                                "training process.")
    checkpoint_every: int = Field(500, ge=0, description="Steps between the checkpoints taken within an epoch "
                                  "(0: only at each epoch's end). A killed run resumes from the newest one, at "
                                  "the next batch of that epoch.")

    @model_validator(mode="after")
    def _student(self) -> TrainingSpec:
        if self.model is not None and self.model.backend != "transformers-clip":
            raise ValueError("training.model.backend must be 'transformers-clip' (or leave training.model unset)")
        return self


class VedjeSpec(Strict):
    """``train-vedje`` / ``index-cache`` / ``rerank``: the cached joint reranker (VEDJE; App. A.2–A.3
    defaults unless noted). Items are video clips (T frames) or images (T = 1)."""

    source: Literal["clips", "largefine"] = Field("clips", description="The items: the bundled video-clip set, "
                                                  "or the images of a build-largefine run.")
    clips_path: str = Field("data/demo_clips", description="The clip-set folder (source clips).")
    source_flow: str = Field("build-largefine", description="The flow run whose images are the items (source "
                             "largefine).")
    test_share: float = Field(0.3, gt=0.0, lt=1.0, description="Source largefine: share of identities held out "
                              "for testing.")
    backbone: ModelSpec | None = Field(None, description="The frozen backbone g_φ whose feature maps are "
                                       "compressed; null = the bundled EfficientNet-Lite0.")
    first_stage: ModelSpec | None = Field(None, description="The stage-1 expert (its ρ scores and VTC targets); "
                                          "null = models.experts[0].")
    joint_encoder: ModelSpec = Field(ModelSpec(backend="bert", model_id="bundled:all-MiniLM-L6-v2"),
                                     description="The joint text-and-cache encoder (a bert backend; "
                                     "options.layers: its k layers).")
    tokens_per_frame: int = Field(4, ge=1, description="M: cached tokens per frame.")
    structure: Literal["frames", "mean", "attention"] = Field("frames", description="Cache layout: frames = M "
                                                              "tokens per frame in temporal order; mean and "
                                                              "attention pool across frames first (controls).")
    horizons: list[int] = Field(default_factory=lambda: [3], min_length=1, description="H: the frame offsets "
                                "the future-delta head predicts (positive).")
    delta: bool = Field(True, description="Train with the future-delta loss (needs structure frames).")
    train_compressor: bool = Field(True, description="false: keep the previous train-vedje run's compressor "
                                   "frozen and retrain only the reranker, so index-cache's caches stay valid.")
    compressor_layers: int = Field(2, ge=1, description="Decoder layers of the compressor C_η.")
    # models/reranker/compressor.py: the paper does not say where the LayerNorms sit
    compressor_norm: Literal["post", "pre"] = Field("post", description="LayerNorm placement in the compressor: "
                                                    "post = after each residual sum, pre = before each "
                                                    "sub-layer plus one on the output.")
    heads: int = Field(8, ge=1, description="Attention heads of the compressor and the future-delta head.")
    dropout: float = Field(0.1, ge=0.0, lt=1.0, description="Dropout of the compressor and the future-delta "
                           "head.")
    max_text_tokens: int = Field(64, ge=4, description="Text tokens of a query or caption the joint encoder "
                                 "reads at most.")
    epochs: int = Field(4, ge=1, description="Passes over the training queries.")
    batch_size: int = Field(64, ge=2, description="Queries per optimizer step.")
    train_candidates: int = Field(8, ge=2, description="VTM candidates per training query: the positive plus "
                                  "hard negatives.")
    negatives_from: int = Field(20, ge=2, description="VTM candidates come from the stage-1 top N (a query "
                                "whose positive is not in it gets no VTM term).")
    lr_start: float = Field(1e-6, gt=0.0, description="Learning rate at the start of the linear warmup.")
    lr_peak: float = Field(3e-4, gt=0.0, description="Learning rate after the warmup, then times epoch_decay "
                           "per epoch.")
    warmup_steps: int = Field(400, ge=0, description="Optimizer steps of the linear warmup.")
    epoch_decay: float = Field(0.9, gt=0.0, le=1.0, description="Factor on the learning rate per epoch after "
                               "the warmup.")
    weight_decay: float = Field(0.02, ge=0.0, description="AdamW weight decay.")
    precision: Literal["bf16", "fp8", "fp4"] = Field("bf16", description="Number format of the stored caches.")
    candidates: list[int] = Field(default_factory=lambda: [20, 50, 100], min_length=1, description="N_c: "
                                  "stage-1 candidate counts reranked and evaluated.")
    shard_size: int = Field(64, ge=1, description="Items per index-cache task.")
    score_batch: int = Field(256, ge=1, description="Query-item pairs per joint-encoder forward at query time.")
    # all give the same scores up to float rounding
    score_path: Literal["onnx", "fast", "reference"] = Field(
        "onnx", description="Query-time scoring: onnx = the fast graph in ONNX Runtime on the CPU (falls back to "
        "fast without it or on a GPU); fast = the same in PyTorch; reference = the encoder's full forward.")
    seed: int = Field(0, description="Seed of the test split (source largefine), the initialisation, the query "
                      "order and the hard negatives.")

    @model_validator(mode="after")
    def _consistent(self) -> VedjeSpec:
        if self.joint_encoder.backend != "bert":
            raise ValueError("vedje.joint_encoder.backend must be 'bert' (a BERT/MiniLM encoder by id or bundled)")
        if self.delta and self.structure != "frames":
            raise ValueError("vedje.delta needs vedje.structure 'frames' (per-frame cached tokens)")
        if any(h < 1 for h in self.horizons):
            raise ValueError("vedje.horizons must be positive frame offsets")
        return self


class FanoutSpec(Strict):
    """Shard fan-out over a work pool: a per-shard GPU stage runs as shard-range flow runs of the
    ``deployment`` (any worker of its pool picks them up) instead of as tasks of this flow run. Off
    by default: small runs keep the single-worker path."""

    enabled: bool = Field(False, description="Fan the per-shard GPU stages out over the work pool.")
    stages: list[str] = Field(default_factory=list, description="The per-shard GPU stages that fan out, by "
                              "name; empty: all of them.")
    deployment: str = Field("run-shards/gpu", description="The deployment that runs a shard range, as \"flow "
                            "name/deployment name\" in prefect.yaml.")
    shards_per_run: int = Field(1, ge=1, description="Shards in one range (one flow run, which loads its "
                                "models once).")
    max_attempts: int = Field(3, ge=1, description="Runs of one range before the stage fails.")
    poll_s: float = Field(2.0, gt=0, description="Interval between checks of the ranges' flow runs (seconds).")
    # PREFECT_FLOWS_HEARTBEAT_FREQUENCY is 30 s in `rde stack up`
    stale_after_s: float = Field(90.0, ge=1, description="A flow run that sent no heartbeat this long is marked "
                                 "Crashed by the server's zombie automation (the window `rde stack up` and `rde "
                                 "stack automations` give it; by the parent itself on a server without one), and "
                                 "a shard-range run so marked is resubmitted (seconds).")
    unclaimed_warn_s: float = Field(300.0, gt=0, description="Warn when no worker has started a range's run "
                                    "this long (seconds).")


class PrefectSpec(Strict):
    """How the flows use Prefect: the GPU concurrency limit and the fan-out of shards over a pool."""

    # the flows' task runner reads RDE_TASK_RUNNER / RDE_TASK_WORKERS (rde/common/task_runners.py), not this key
    task_runner_workers: int = Field(2, ge=1, description="Not read: the flows' worker threads are set by the "
                                     "environment variable RDE_TASK_WORKERS.")
    gpu_concurrency_limit: str = Field("gpu", description="Tag of the Prefect global concurrency limit that "
                                       "GPU stages' shard tasks take a slot of.")
    fanout: FanoutSpec = Field(FanoutSpec(), description="Shard fan-out of GPU stages over a work pool.")
    resume_max_runs: int = Field(3, ge=1, description="Runs of one deployment flow run, counting those the "
                                 "server's resume automation starts after a crash: a run started more often "
                                 "fails at once instead (a crash that repeats, such as running out of memory, is "
                                 "not retried forever).")


class Profile(Strict):
    """A complete, validated profile."""

    name: str = Field(description="The profile's name, shown in summaries and part of the artifacts' paths.")
    description: str = Field("", description="Free text saying what the profile is for.")
    artifacts_root: str = Field(".rde/artifacts", description="Where runs write their artifacts: a local path "
                                "(relative to the project root) or an fsspec URL such as s3://bucket/prefix.")
    input: InputSpec = Field(InputSpec(), description="Where the images come from.")
    domains: list[Domain] = Field(min_length=1, description="The sub-domains of the benchmark, in order (the "
                                  "first is the default): each a bundled domain's name (pedestrian, vehicle) or "
                                  "the path of a domain file (relative to the project root); see "
                                  "docs/adding-a-domain.md for a domain file's fields.")
    ingest: IngestSpec = Field(IngestSpec(), description="Reading the inputs: shards and the limits on a file.")
    video: VideoSpec = Field(VideoSpec(), description="Video input (input.kind: video): sampling, tracking and "
                             "crops per track.")
    track_facts: TrackFactsSpec = Field(TrackFactsSpec(), description="What a crop's video track says about its "
                                        "subject (motion, direction, distance, place in the frame): facts "
                                        "captions and queries may state.")
    denoise: DenoiseSpec = Field(DenoiseSpec(), description="The filters that reject unusable images.")
    near_duplicates: NearDuplicateSpec = Field(NearDuplicateSpec(), description="The near-duplicate filter "
                                               "(build-secmm): of near-identical crops, only the sharpest is kept.")
    models: ModelsSection = Field(ModelsSection(), description="The models of each role; unset roles use the "
                                  "bundled offline models.")
    sampling: SamplingSpec = Field(SamplingSpec(), description="Centroid-guided diversity sampling (CGDS) of "
                                   "the gallery.")
    retrieval: RetrievalSpec = Field(RetrievalSpec(), description="Multi-expert candidate retrieval (MECF).")
    queries: QueriesSpec = Field(QueriesSpec(), description="Distribution-aware query generation (DAP) and its "
                                 "quality gates.")
    evaluation: EvaluationSpec = Field(EvaluationSpec(), description="What evaluate scores besides the built "
                                       "benchmark.")
    review: ReviewSpec = Field(ReviewSpec(), description="The human review of the candidates: the review site "
                               "and the Label Studio tasks.")
    largefine: LargeFineSpec = Field(LargeFineSpec(), description="build-largefine: three-tier captioning.")
    training: TrainingSpec = Field(TrainingSpec(), description="train-saft and train-gtr: the dual encoder's "
                                   "training.")
    vedje: VedjeSpec = Field(VedjeSpec(), description="train-vedje, index-cache and rerank: the cached joint "
                             "reranker.")
    prefect: PrefectSpec = Field(PrefectSpec(), description="Orchestration: the GPU concurrency limit and "
                                 "shard fan-out.")

    @field_validator("domains", mode="before")
    @classmethod
    def _load_domain_files(cls, value: Any) -> Any:
        """A name or path entry → its domain file, loaded (an inline mapping is validated as it is)."""
        return [load_domain(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    @model_validator(mode="before")
    @classmethod
    def _default_domain_first(cls, data: Any) -> Any:
        """``input.default_domain`` and ``largefine.domains`` unset: the first domain. The domain
        files are read here once (the ``domains`` field then takes them as they are)."""
        if not isinstance(data, dict) or not isinstance(data.get("domains"), list) or not data["domains"]:
            return data
        try:
            domains = [load_domain(v) if isinstance(v, str) else v for v in data["domains"]]
        except DomainError:
            return data  # the domains field reports it, naming the key
        first = domains[0]
        name = first.name if isinstance(first, Domain) else first.get("name") if isinstance(first, dict) else None
        if name is None:
            return data
        out = {**data, "domains": domains}
        for section, key, value in (("input", "default_domain", name), ("largefine", "domains", [name])):
            given = out.get(section, {})
            if isinstance(given, dict) and not given.get(key):
                out[section] = {**given, key: value}
        return out

    @model_validator(mode="after")
    def _domains_unique(self) -> Profile:
        try:
            DomainSet(self.domains)
        except DomainError as exc:
            raise ValueError(str(exc)) from None
        names = [d.name for d in self.domains]
        if self.input.default_domain not in names:
            raise ValueError(f"input.default_domain {self.input.default_domain!r} is not one of domains {names}")
        unknown = [d for d in self.largefine.domains if d not in names]
        if unknown:
            raise ValueError(f"largefine.domains {unknown} are not among domains {names}")
        unknown = [d for d in self.denoise.size_by_domain if d not in names]
        if unknown:
            raise ValueError(f"denoise.size_by_domain {unknown} are not among domains {names}")
        return self

    @model_validator(mode="after")
    def _domain_sizes(self) -> Profile:
        """Each domain file's ``subject.size`` where ``denoise.size_by_domain`` names no rule for it."""
        sizes = {d.name: d.subject.size for d in self.domains if d.subject.size and d.name not in
                 self.denoise.size_by_domain}
        if not sizes:
            return self
        denoise = self.denoise.model_copy(update={"size_by_domain": {**self.denoise.size_by_domain, **sizes}})
        return self.model_copy(update={"denoise": denoise})

    @model_validator(mode="after")
    def _detector_knows_the_classes(self) -> Profile:
        """An open-vocabulary detector without classes is told every domain's (subject, carried,
        ridden; its text names); any detector whose classes are known must know every class a
        domain names."""
        detector = self.models.detector
        wanted = list(dict.fromkeys((c, t) for d in self.domains for c, t, _ in d.detector_classes()))
        if detector.backend == "owl" and not detector.classes:
            detector = detector.model_copy(update={"classes": tuple(c for c, _ in wanted),
                                                   "prompts": tuple(t for _, t in wanted)})
            self = self.model_copy(update={"models": self.models.model_copy(update={"detector": detector})})
        known = known_classes(detector)
        if known is None:
            return self
        for d in self.domains:
            for cls, _, where in d.detector_classes():
                if cls not in known:
                    raise ValueError(f"domain file {d.source}: {where}: {cls!r} is not a class of the "
                                     f"{detector.backend} detector (an open-vocabulary detector, backend owl, "
                                     "finds classes by name)")
        return self

    @model_validator(mode="after")
    def _text_llms_named_on_a_gpu(self) -> Profile:
        """A profile that runs on a GPU names its text LLMs: unset, DAP and the template gallery
        would fall back to the bundled 135M CPU model, which keeps next to no query. The bundled
        model written out (``BUNDLED_TEXT_LLM``) is an explicit choice and passes."""
        unset = [role for role in TEXT_LLM_ROLES if getattr(self.models, role) is None]
        evidence = gpu_evidence(self) if unset else None
        if evidence is None:
            return self
        keys = " and ".join(f"models.{role}" for role in unset)
        uses = " and ".join(TEXT_LLM_ROLES[role] for role in unset)
        are, them = ("are", "each") if len(unset) > 1 else ("is", "it")
        raise ValueError(f"{keys} {are} unset on a GPU profile ({evidence}): {uses} would fall back to the "
                         f"bundled CPU model SmolLM2-135M; set {them} to a text LLM, e.g. "
                         f"{_flow_yaml(GPU_TEXT_LLM)} (profiles/production.yaml's Qwen3), or to "
                         f"{_flow_yaml(BUNDLED_TEXT_LLM)} to keep the bundled one")

    @cached_property
    def domain_set(self) -> DomainSet:
        """The domains, checked together, as the models read them."""
        return DomainSet(self.domains)

    def domain(self, name: str) -> Domain:
        return self.domain_set[name]

    def section_hash(self, *sections: str) -> str:
        """Hash of the named sections only, so a stage reruns when *its* config changes."""
        data = self.model_dump(mode="json")
        return sha256_json({s: data[s] for s in sections})


def _format_errors(source: str, exc: ValidationError) -> str:
    """One line per bad key (one line in all when there is one, as a domain file's error is)."""
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"])
        if err["type"] == "extra_forbidden":
            lines.append(f"{key}: unknown key")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
            message = err["msg"].removeprefix("Value error, ")
            lines.append(f"{key}: {message}{shown}" if key else message)
    if len(lines) == 1:
        return f"invalid profile {source}: {lines[0]}"
    return "\n".join([f"invalid profile {source}:", *(f"  {line}" for line in lines)])


def parse_profile(data: Any, source: str = "<profile>") -> Profile:
    """Validate a mapping as a Profile, with errors that name the offending key."""
    if not isinstance(data, dict):
        raise ProfileError(f"invalid profile {source}: expected a mapping at the top level")
    try:
        return Profile.model_validate(data)
    except ValidationError as exc:
        raise ProfileError(_format_errors(source, exc)) from None


CONFINEMENT_KEYS = {"confine", "roots"}  # input keys that only a profile file may set (not run parameters)


def load_profile(name_or_path: str = "demo", overrides: dict[str, Any] | None = None) -> Profile:
    """Load a bundled profile by name (``demo``, ``production``) or any YAML file by path."""
    path = Path(name_or_path)
    if not path.suffix:
        path = PROFILE_DIR / f"{name_or_path}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in PROFILE_DIR.glob("*.yaml")))
        raise ProfileError(f"profile {name_or_path!r} not found (bundled profiles: {known}; or give a YAML path)")
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ProfileError(f"profile {path} is not valid YAML: {exc}") from None
    if overrides:
        widening = sorted(set((overrides.get("input") or {}) if isinstance(overrides.get("input"), dict) else {})
                          & CONFINEMENT_KEYS)
        if widening:
            raise ProfileError(f"input.{', input.'.join(widening)} can only be set in a profile file: they decide "
                               "which files a run may read, so run parameters and --set cannot change them")
        data = deep_merge(data or {}, overrides)
    return parse_profile(data, str(path))


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """Recursive dict merge; ``extra`` wins."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out
