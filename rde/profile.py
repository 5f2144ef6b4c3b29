"""Profiles: YAML files validated by pydantic. A profile is data, never code.

Unknown keys and wrong types are rejected with a message naming the key and the file. Here: the
whole profile (``Profile``), composed of the sections each part of the engine declares beside its
logic, the checks that need more than one section, and loading (``load_profile``: a bundled name or
a path, run parameters and ``--set`` overrides merged by ``deep_merge``; ``parse_profile``).

Where the sections live: the pool's (``input``, ``ingest``, ``video``, ``track_facts``, ``denoise``)
in ``rde.common.pool_config`` and the orchestration's (``prefect``) in
``rde.common.orchestration_config``, since logic in ``rde.common`` and the stage framework reads
them; each pipeline's in its own package (``rde.secmm.config``, ``rde.largefine.config``,
``rde.training.config``, ``rde.vedje.config``, ``rde.evaluation.config``), or, for a section one
module alone reads, in that module with ``@profile_section`` (``near_duplicates``, ``sampling`` and
``retrieval``, in ``rde.secmm.near_duplicates``, ``cgds`` and ``mecf``), found by
``rde.common.declarations``. Composing them imports
every pipeline, and ``rde.common`` imports no pipeline while a pipeline imports no other, so
``Profile`` can live in neither: it sits in a layer of its own, below the stage framework and the
flows that load profiles and above the pipelines (``rde.profile`` in tests/test_import_direction.py's
LAYERS). Pipeline logic reads the profile it is handed and never imports this module.
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, create_model, field_validator, model_validator

from models.backends.detectors import known_classes
from models.domains import Domain, DomainError, DomainSet, load_domain
from models.specs import BUNDLED_LLM, ModelsSection, Strict
from rde.common.declarations import section_fields
from rde.common.orchestration_config import PrefectSpec
from rde.common.pool_config import DenoiseSpec, IngestSpec, InputSpec, TrackFactsSpec, VideoSpec
from rde.evaluation.config import EvaluationSpec
from rde.largefine.config import LargeFineSpec
from rde.secmm.config import QueriesSpec, ReviewSpec
from rde.training.config import TrainingSpec
from rde.vedje.config import VedjeSpec
from storage.hashing import sha256_json

PROFILE_DIR = Path(__file__).resolve().parents[1] / "profiles"


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


class ProfileCore(Strict):
    """A complete, validated profile but for the sections declared beside their logic (``Profile``
    adds them)."""

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
    models: ModelsSection = Field(ModelsSection(), description="The models of each role; unset roles use the "
                                  "bundled offline models.")
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
    def _domains_unique(self) -> ProfileCore:
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
    def _domain_sizes(self) -> ProfileCore:
        """Each domain file's ``subject.size`` where ``denoise.size_by_domain`` names no rule for it."""
        sizes = {d.name: d.subject.size for d in self.domains if d.subject.size and d.name not in
                 self.denoise.size_by_domain}
        if not sizes:
            return self
        denoise = self.denoise.model_copy(update={"size_by_domain": {**self.denoise.size_by_domain, **sizes}})
        return self.model_copy(update={"denoise": denoise})

    @model_validator(mode="after")
    def _detector_knows_the_classes(self) -> ProfileCore:
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
    def _text_llms_named_on_a_gpu(self) -> ProfileCore:
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


# The whole profile: the sections above and those a logic module declares beside itself with
# ``@profile_section`` (rde.common.declarations finds the declaring modules by their source, so a new
# stage's section needs no line here), after them in the declaring modules' order.
def compose_profile() -> type[ProfileCore]:
    """``ProfileCore`` with every declared section added (a new class each call: ``Profile`` is the
    one made when this module is imported)."""
    return create_model("Profile", __base__=ProfileCore, __module__=__name__,
                        __doc__="A complete, validated profile.", **section_fields())


Profile = compose_profile()


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
