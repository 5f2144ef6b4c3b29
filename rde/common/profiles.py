"""Profiles: YAML files validated by pydantic. A profile is data, never code.

Unknown keys and wrong types are rejected with a message naming the key and the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from models.specs import ModelSpec, ModelsSection, Strict
from storage.hashing import sha256_json

PROFILE_DIR = Path(__file__).resolve().parents[2] / "profiles"


class ProfileError(ValueError):
    """A profile could not be loaded; the message is meant for the user as it is."""


class DomainSpec(Strict):
    """A sub-domain of the benchmark and the detector classes that count as its target."""

    name: str = Field(pattern=r"^[a-z][a-z0-9_]*$")
    target_classes: list[str] = Field(min_length=1)


class InputSpec(Strict):
    """Where the images come from: the bundled demo pool, a folder, or a Parquet file of paths."""

    kind: Literal["pool", "folder", "paths"] = "pool"
    path: str = "data/demo_pool"
    default_domain: str = "pedestrian"
    # Allowed roots for 'paths' inputs; empty = the list file's own folder. A folder input is
    # confined to itself. Real paths (after links and '..') outside are rejected as outside_root.
    roots: list[str] = Field(default_factory=list)
    # false reads any path the worker can read: only for trusted inputs (deployment parameters are not)
    confine: bool = True


class IngestSpec(Strict):
    shard_size: int = Field(256, ge=1)
    max_file_bytes: int = Field(64 * 1024 * 1024, ge=1)
    max_pixels: int = Field(50_000_000, ge=1)  # larger images are rejected as decompression bombs


class SizeRule(Strict):
    """Minimum image width and height (pixels) below which an image is ``too_small``."""

    min_width: int = Field(ge=1)
    min_height: int = Field(ge=1)


class DenoiseSpec(Strict):
    """GTR+ denoising thresholds (paper Sec. 5.1): w<32 or h<64, Laplacian var <80, count≠1.

    ``min_width``/``min_height`` are the paper's rule for upright people and apply to every domain
    not named in ``size_by_domain`` (e.g. vehicles, which are wide and low, get their own rule).
    """

    min_width: int = Field(32, ge=1)
    min_height: int = Field(64, ge=1)
    size_by_domain: dict[str, SizeRule] = Field(default_factory=dict)
    min_laplacian_variance: float = Field(80.0, ge=0.0)
    required_target_count: int | None = Field(1, ge=0)  # None disables the count filter
    deduplicate: bool = True

    def size_rule(self, domain: str | None) -> SizeRule:
        """The size rule for images of ``domain`` (the default rule when it has none of its own)."""
        rule = self.size_by_domain.get(domain) if domain is not None else None
        return rule or SizeRule(min_width=self.min_width, min_height=self.min_height)


class SamplingSpec(Strict):
    """Centroid-Guided Diversity Sampling sizes (paper Sec. 3.1)."""

    clusters_per_domain: int = Field(100, ge=1)
    min_per_cluster: int = Field(100, ge=0)
    max_per_cluster: int = Field(1000, ge=1)
    seed: int = 0
    # auto: scikit-learn KMeans in memory up to minibatch_above images per domain, streaming above;
    # streaming: always; sklearn, sklearn-minibatch, faiss: in memory at any size (N × dim vectors held)
    kmeans_backend: Literal["auto", "sklearn", "sklearn-minibatch", "faiss", "streaming"] = "auto"
    # auto: above this many images per domain, streaming k-means (rde.secmm.cgds.kmeans_streaming): the
    # vectors are read from the embedding cache one pool shard at a time, never all at once
    minibatch_above: int = Field(20_000, ge=1)
    stream_passes: int = Field(5, ge=1)  # streaming: at most this many Lloyd passes (stops when no label changes)
    stream_batch: int = Field(4096, ge=1)  # streaming: rows per step (its distances: stream_batch × K floats)
    # streaming: the start is KMeans on a seeded reservoir sample of min(N, this × K) vectors (held: this × K × dim
    # floats, 131 MB at K=100, dim=1280) with stream_init_tries k-means++ tries
    stream_init_per_cluster: int = Field(256, ge=1)
    stream_init_tries: int = Field(10, ge=1)

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

    nlist: int | None = Field(None, ge=1)  # inverted lists; None = 4·√N
    nprobe: int = Field(32, ge=1)  # lists visited per query
    train_per_list: int = Field(64, ge=1)  # training vectors per list (a seeded sample of the gallery)
    # building the index costs ~30× an exact search of 200 queries at 100k (benchmarks/ann_recall.py):
    # fewer queries than this (MECF's text queries) are searched exactly at any gallery size
    min_queries: int = Field(5_000, ge=1)
    check_queries: int = Field(64, ge=0)  # queries searched exactly too, to measure recall; 0 = no check
    min_recall: float = Field(0.99, ge=0.0, le=1.0)
    seed: int = 0


class RetrievalSpec(Strict):
    """Multi-Expert Collaborative Filtering (paper Eq. 1): top-K per expert, union of candidates."""

    top_k: int = Field(1000, ge=1)
    index_above: int = Field(200_000, ge=1)  # gallery size above which an ANN index is used
    ann: AnnSpec = Field(default_factory=AnnSpec)


class QueriesSpec(Strict):
    """Distribution-Aware Prompting (DSMM-TBIR Sec. 3.1, Table 11) and query post-processing."""

    per_domain: int = Field(100, ge=1)
    min_words: int = Field(5, ge=1)
    max_words: int = Field(15, ge=1)
    per_request: int = Field(10, ge=1)  # queries asked for in one prompt ([part_num])
    keywords_per_pos: int = Field(12, ge=1)  # nouns / verbs / adjectives sampled into each prompt
    max_rounds: int = Field(10, ge=1)  # prompts per domain at most, until per_domain is reached
    temperature: float = Field(0.8, ge=0.0)
    max_tokens: int = Field(256, ge=16)
    near_duplicate_cosine: float = Field(0.92, gt=0.0, le=1.0)  # text-embedding cosine ≥ this → near duplicate
    # ... and only when both state the same attribute values ("red top" vs "black top" are two queries)
    near_duplicate_attributes: bool = True
    echo_max_word_edits: int = Field(1, ge=0)  # ≤ this many words changed from an output example → echoes_example
    echo_span_content_words: int = Field(3, ge=1)  # a copied run of words with this many content words → echo
    vocabulary_check: bool = True  # off_vocabulary: content words must occur in the domain's caption pool
    keyword_check: bool = True  # no_keyword: a line must use a noun/adjective sampled into its request
    # GBNF grammar per request from the sampled keywords and phrases of the caption pool (prompt file
    # ``grammar`` data); honoured by llama.cpp (offline, and servers through openai-http's grammar_field).
    constrained_decoding: bool = False
    grammar_phrases: int = Field(6, ge=1)  # caption-pool phrases per sampled keyword offered in the grammar
    grammar_min_count: int = Field(2, ge=1)  # a noun enters the grammar once the pool uses it this often
    # an adjective on a noun, a combination of two, a noun as subject: in the grammar once this many
    # pool captions say it (fewer is often a measurement slip: "red bottoms" from a red jacket's hem)
    grammar_min_pair_count: int = Field(3, ge=1)
    caption_sample_per_domain: int = Field(40, ge=1)  # images captioned for the caption pool
    caption_max_tokens: int = Field(80, ge=8)  # token budget of one pool caption ("one or two sentences")
    caption_file: str | None = None  # CUHK-PEDES-style JSON captions instead of captioning the pool
    seed: int = 0

    @model_validator(mode="after")
    def _lengths(self) -> QueriesSpec:
        if self.min_words > self.max_words:
            raise ValueError("queries.min_words must not exceed queries.max_words")
        return self


class EvaluationSpec(Strict):
    """What ``evaluate`` scores besides the built benchmark: hand-labelled check sets (YAML files
    like data/check_set/queries.yaml, relevance by identity over a pool artifact)."""

    check_sets: list[str] = Field(default_factory=list)
    check_set_pool: str = "data/demo_pool"


class RetrySpec(Strict):
    """Generator calls that fail for a transient reason (timeout, server error) are retried with
    exponential backoff, then recorded as rejected rows."""

    max_attempts: int = Field(3, ge=1)
    backoff_s: float = Field(0.5, ge=0.0)


class TemplateGallerySpec(Strict):
    """GTR+ advanced tier: the extract-and-expand loop that builds the template gallery."""

    sample_captions: int = Field(24, ge=1)  # tier-1/2 captions sampled as extraction input
    captions_per_request: int = Field(6, ge=1)
    rounds: int = Field(2, ge=0)  # expand rounds after the extraction round
    max_templates: int = Field(64, ge=1)
    min_words: int = Field(6, ge=1)
    max_words: int = Field(60, ge=1)
    max_tokens: int = Field(256, ge=16)
    temperature: float = Field(0.7, ge=0.0)
    seed: int = 0


class LargeFineSpec(Strict):
    """``build-largefine``: GTR+ three-tier captioning (paper Sec. 3.1) into LargeFine-style shards."""

    domains: list[str] = Field(default_factory=lambda: ["pedestrian"])  # other domains: rejected out_of_domain
    tier_prompt: str = "gtr_tiers"  # prompts/<name>.yaml: the paper's wording; gtr_tiers_small for tiny LLMs
    shard_size: int = Field(64, ge=1)  # images per captioning task
    max_images: int | None = Field(None, ge=1)  # cap on accepted images captioned (None = all)
    neighbours_k: int = Field(10, ge=1)  # hard negative drawn from the top-k nearest neighbours (Eq. 1)
    neighbour_index_above: int = Field(100_000, ge=1)  # pool size above which the ANN index is searched
    neighbour_ann: AnnSpec = Field(default_factory=AnnSpec)
    seed: int = 0  # hard-negative draw, generator assignment, template choice
    temperature: float = Field(0.0, ge=0.0)
    qa_max_tokens: int = Field(256, ge=16)
    summary_max_tokens: int = Field(160, ge=16)
    min_qa_pairs: int = Field(2, ge=1)  # fewer distinct answered pairs → malformed_qa
    min_words: int = Field(10, ge=1)  # quality gate on every tier's text (issue: <10 or >200 words)
    max_words: int = Field(200, ge=1)
    max_repeated_sentence_share: float = Field(0.5, ge=0.0, le=1.0)  # of the sentences as generated → repetitive
    drop_repeated_sentences: bool = True  # keep a sentence's first occurrence only (recorded in `cleaning`)
    boilerplate: list[str] = Field(default_factory=lambda: [
        "in the image", "in this image", "in the picture", "in the photo", "the image shows", "this image shows",
        "the picture shows", "in the target-image", "in target-image"])
    # Phrases that name the hard-negative image: removed from intermediate and advanced texts.
    negative_mentions: list[str] = Field(default_factory=lambda: [
        "compare-image", "compare image", "both persons", "both of them", "the other person", "second person"])
    retries: RetrySpec = RetrySpec()
    templates: TemplateGallerySpec = TemplateGallerySpec()

    @model_validator(mode="after")
    def _lengths(self) -> LargeFineSpec:
        if self.min_words > self.max_words:
            raise ValueError("largefine.min_words must not exceed largefine.max_words")
        return self


class TrainingSpec(Strict):
    """``train-saft`` / ``train-gtr``: the CPU dual encoder over cached tower features, trained on the
    captions of a ``build-largefine`` run (DSMM-TBIR Sec. 3.3 / Table 8; GTR+ Sec. 3.2)."""

    source_flow: str = "build-largefine"  # whose `largefine` captions are the training pairs
    # The student: None = the CPU feature model over the bundled towers; a `transformers-clip` spec
    # = any CLIP-like model by id or local folder, trained end to end on the images (vision tower).
    model: ModelSpec | None = None
    max_pairs: int | None = Field(None, ge=2)  # seeded subset of the pairs (None = all)
    views: int = Field(3, ge=1)  # augmented views per image (random resized crop), view 0 = original
    held_out_share: float = Field(0.3, gt=0.0, lt=1.0)  # identities kept for person-search evaluation
    epochs: int = Field(5, ge=1)
    batch_size: int = Field(64, ge=2)
    lr_start: float = Field(5e-7, gt=0.0)  # SAFT: 5e-7 → 5e-6 over 10 % warmup, cosine, wd 0.05
    lr_peak: float = Field(5e-6, gt=0.0)
    warmup_frac: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.05, ge=0.0)
    tau_teacher: float = Field(0.05, gt=0.0)
    alpha: float = 1.0  # SASS weight
    beta: float = 0.75  # ISD weight
    saft_objective: Literal["itc", "itc+sass", "saft", "cusa", "hnm", "itc+iss"] = "saft"
    train_text: bool = False  # SAFT keeps the text tower frozen
    gtr_weighting: Literal["none", "fix", "ada"] = "ada"
    gamma: float = Field(0.2, ge=0.0, le=1.0)
    confidence_beta: float = Field(0.8, ge=0.0)
    gmm_components: int = Field(2, ge=2)
    gmm_min_fit_pairs: int = Field(10, ge=2)  # pairs with / without q_txt each need this many for a fit
    seed: int = 0

    @model_validator(mode="after")
    def _student(self) -> TrainingSpec:
        if self.model is not None and self.model.backend != "transformers-clip":
            raise ValueError("training.model.backend must be 'transformers-clip' (or leave training.model unset)")
        return self


class VedjeSpec(Strict):
    """``train-vedje`` / ``index-cache`` / ``rerank``: the cached joint reranker (VEDJE; App. A.2–A.3
    defaults unless noted). Items are video clips (T frames) or images (T = 1)."""

    source: Literal["clips", "largefine"] = "clips"  # the bundled clip set, or a build-largefine run's images
    clips_path: str = "data/demo_clips"
    source_flow: str = "build-largefine"  # for source 'largefine'
    test_share: float = Field(0.3, gt=0.0, lt=1.0)  # largefine: identities held out for testing
    backbone: ModelSpec | None = None  # frozen g_φ with feature_maps; None = the bundled EfficientNet-Lite0
    first_stage: ModelSpec | None = None  # the stage-1 expert (ρ and VTC targets); None = models.experts[0]
    joint_encoder: ModelSpec = ModelSpec(backend="bert", model_id="bundled:all-MiniLM-L6-v2")  # options.layers: k
    tokens_per_frame: int = Field(4, ge=1)  # M
    structure: Literal["frames", "mean", "attention"] = "frames"
    horizons: list[int] = Field(default_factory=lambda: [3], min_length=1)  # H
    delta: bool = True
    # false: keep the compressor of the previous train-vedje run frozen and retrain only the online
    # reranker, so the caches index-cache wrote stay valid (no re-indexing)
    train_compressor: bool = True
    compressor_layers: int = Field(2, ge=1)
    # LayerNorm placement in the compressor C_η (the paper does not say; models/reranker/compressor.py):
    # 'post' after each residual sum, 'pre' before each sub-layer plus one on the output
    compressor_norm: Literal["post", "pre"] = "post"
    heads: int = Field(8, ge=1)
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    max_text_tokens: int = Field(64, ge=4)
    epochs: int = Field(4, ge=1)
    batch_size: int = Field(64, ge=2)  # queries per optimizer step
    train_candidates: int = Field(8, ge=2)  # VTM candidates per query: the positive + hard negatives
    # VTM candidates come from the stage-1 top-N (a query whose positive is not in it gets no VTM term)
    negatives_from: int = Field(20, ge=2)
    lr_start: float = Field(1e-6, gt=0.0)
    lr_peak: float = Field(3e-4, gt=0.0)
    warmup_steps: int = Field(400, ge=0)
    epoch_decay: float = Field(0.9, gt=0.0, le=1.0)
    weight_decay: float = Field(0.02, ge=0.0)
    precision: Literal["bf16", "fp8", "fp4"] = "bf16"
    candidates: list[int] = Field(default_factory=lambda: [20, 50, 100], min_length=1)  # N_c evaluated
    shard_size: int = Field(64, ge=1)  # items per index-cache task
    score_batch: int = Field(256, ge=1)  # pairs per joint-encoder forward at query time
    # joint scoring at query time (all give the same scores up to float rounding): 'onnx' = score_fast's
    # graph run by ONNX Runtime on the CPU (falls back to 'fast' without onnxruntime or on a GPU);
    # 'fast' = JointReranker.score_fast in PyTorch ([CLS]-only last block, shared text work);
    # 'reference' = the encoder's full forward
    score_path: Literal["onnx", "fast", "reference"] = "onnx"
    seed: int = 0

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

    enabled: bool = False
    stages: list[str] = Field(default_factory=list)  # the per-shard GPU stages that fan out (names); empty: all of them
    deployment: str = "run-shards/gpu"  # "flow name/deployment name", in prefect.yaml
    shards_per_run: int = Field(1, ge=1)  # a range's length; each run loads its models once
    max_attempts: int = Field(3, ge=1)  # runs of one range before the stage fails
    poll_s: float = Field(2.0, gt=0)
    # a RUNNING or PENDING range whose flow run sent no heartbeat (PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    # 30 s in `rde stack up`) for this long is marked Crashed (its worker presumed lost) and resubmitted
    stale_after_s: float = Field(90.0, ge=1)
    unclaimed_warn_s: float = Field(300.0, gt=0)  # warn when no worker has started a range's run this long


class PrefectSpec(Strict):
    task_runner_workers: int = Field(2, ge=1)
    gpu_concurrency_limit: str = "gpu"
    fanout: FanoutSpec = FanoutSpec()


class Profile(Strict):
    """A complete, validated profile."""

    name: str
    description: str = ""
    artifacts_root: str = ".rde/artifacts"  # local path (relative to the project root) or fsspec URL
    input: InputSpec = InputSpec()
    domains: list[DomainSpec] = Field(min_length=1)
    ingest: IngestSpec = IngestSpec()
    denoise: DenoiseSpec = DenoiseSpec()
    models: ModelsSection = ModelsSection()
    sampling: SamplingSpec = SamplingSpec()
    retrieval: RetrievalSpec = RetrievalSpec()
    queries: QueriesSpec = QueriesSpec()
    evaluation: EvaluationSpec = EvaluationSpec()
    largefine: LargeFineSpec = LargeFineSpec()
    training: TrainingSpec = TrainingSpec()
    vedje: VedjeSpec = VedjeSpec()
    prefect: PrefectSpec = PrefectSpec()

    @model_validator(mode="after")
    def _domains_unique(self) -> Profile:
        names = [d.name for d in self.domains]
        if len(set(names)) != len(names):
            raise ValueError(f"domains: names must be unique, got {names}")
        if self.input.default_domain not in names:
            raise ValueError(f"input.default_domain {self.input.default_domain!r} is not one of domains {names}")
        unknown = [d for d in self.largefine.domains if d not in names]
        if unknown:
            raise ValueError(f"largefine.domains {unknown} are not among domains {names}")
        unknown = [d for d in self.denoise.size_by_domain if d not in names]
        if unknown:
            raise ValueError(f"denoise.size_by_domain {unknown} are not among domains {names}")
        return self

    def domain(self, name: str) -> DomainSpec:
        for spec in self.domains:
            if spec.name == name:
                return spec
        raise KeyError(name)

    def section_hash(self, *sections: str) -> str:
        """Hash of the named sections only, so a stage reruns when *its* config changes."""
        data = self.model_dump(mode="json")
        return sha256_json({s: data[s] for s in sections})


def _format_errors(source: str, exc: ValidationError) -> str:
    lines = [f"invalid profile {source}:"]
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "(top level)"
        if err["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key")
        else:
            got = err.get("input")
            shown = "" if isinstance(got, dict | list) else f" (got {got!r})"
            lines.append(f"  {key}: {err['msg']}{shown}")
    return "\n".join(lines)


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
