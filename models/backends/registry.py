"""Build backends from profile specs; each distinct spec is loaded once per process.

Roles and backend names (``models.<role>.backend`` in a profile):

| role | backends |
|---|---|
| image_embedder | ``efficientnet-lite0`` (bundled), ``transformers`` (DINOv2/DINOv3 by id) |
| text_encoder | ``sentence-transformers`` (``bundled:all-MiniLM-L6-v2`` or any id) |
| experts | ``semantic-bridge``, ``attributes`` (offline), ``transformers-clip`` (CLIP/SigLIP), ``vlm-embedding`` |
| experts | ``sentence-transformers`` (text-image models: ``clip-ViT-B-32``), ``open-clip`` (OpenCLIP) |
| generators | ``grounded`` (offline captioner), ``llama-cpp``, ``openai-http``, ``vllm``, ``transformers-vlm`` |
| detector | ``ssd_mobilenet`` (bundled), ``yolo`` (ultralytics, local weights) |
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from models.backends import auto_batch
from models.backends.detectors import Detector, load_detector
from models.backends.interfaces import Generator, ImageEmbedder, TextEncoder, TextImageExpert
from models.backends.model_errors import ModelLoadError
from models.domains import DomainSet
from models.prompt_files import load_prompt
from models.specs import (
    BACKENDS,
    BUNDLED_LLM,
    MEASURED_BACKENDS,
    SPEED_ONLY_DETECTOR_FIELDS,
    SPEED_ONLY_OPTIONS,
    DetectorSpec,
    ModelSpec,
    ModelsSection,
)
from storage.locations import state_dir

BUNDLED_IMAGE_EMBEDDER = ModelSpec(backend="efficientnet-lite0", model_id="efficientnet-lite0", batch_size="auto")
BUNDLED_TEXT_ENCODER = ModelSpec(backend="sentence-transformers", model_id="bundled:all-MiniLM-L6-v2",
                                 batch_size="auto")
AUTO_BATCH_CACHE = "auto_batch.json"  # chosen batch sizes, in the state folder
TEXT_VECTOR_CACHE = "text_vectors"  # fixed prompt lists' embeddings (the bridge's class prompts), in the state folder
DOMAIN_BACKENDS = {"attributes", "grounded"}  # what they measure and say is the profile's domains'

_cache: dict[tuple[str, str], Any] = {}
_lock = threading.RLock()  # composite backends load their parts through _cached too


def _cached(role: str, spec: ModelSpec, build: Callable[[], Any], parts: tuple[str, ...] = ()) -> Any:
    """The backend for ``spec``, built once per process; ``parts`` names what a composed backend is
    built from (its embedder, detector), so the same spec composed of other parts is another one."""
    key = (role, spec.cache_key(), *parts)
    with _lock:
        if key not in _cache:
            if spec.backend not in BACKENDS[role]:
                raise ModelLoadError(f"{role}: unknown backend {spec.backend!r} (known: {sorted(BACKENDS[role])})")
            _cache[key] = build()
        return _cache[key]


def spec_lineage(spec: ModelSpec | None) -> dict[str, Any]:
    """A model spec as it enters stage keys and manifests: the spec (empty when unset), plus the
    identity of the prompt file a composed backend renders internally (editing it re-runs the stage).
    The batch size of a measured backend and the speed-only options (``SPEED_ONLY_OPTIONS``) are
    left out: they change speed, not results (beyond float tolerance), so ``auto`` choosing
    differently on another machine does not re-run a stage."""
    if spec is None:
        return {}
    out: dict[str, Any] = spec.model_dump(mode="json")
    if spec.backend in MEASURED_BACKENDS:
        out.pop("batch_size", None)
    out["options"] = {k: v for k, v in out.get("options", {}).items() if k not in SPEED_ONLY_OPTIONS}
    if spec.backend == "grounded":
        from models.backends.measured_facts import FACTS_VERSION  # loads the text stack: lazily

        out["internal_prompt"] = load_prompt("grounded_captioner").identity
        out["facts_version"] = FACTS_VERSION
    return out


def detector_lineage(spec: DetectorSpec) -> dict[str, Any]:
    """A detector spec as it enters stage keys: without its speed-only fields."""
    return spec.model_dump(mode="json", exclude=set(SPEED_ONLY_DETECTOR_FIELDS))


def models_lineage(models: ModelsSection) -> dict[str, Any]:
    """A whole models section as it enters stage keys: each model spec through ``spec_lineage``."""
    out: dict[str, Any] = models.model_dump(mode="json")
    for role in out:
        value = getattr(models, role)
        if isinstance(value, ModelSpec):
            out[role] = spec_lineage(value)
        elif isinstance(value, DetectorSpec):
            out[role] = detector_lineage(value)
        elif isinstance(value, list):
            out[role] = [spec_lineage(s) if isinstance(s, ModelSpec) else d for s, d in zip(value, out[role],
                                                                                            strict=True)]
    return out


class ModelRegistry:
    """The models a profile names, built on first use and shared by every stage in the process."""

    def __init__(self, models: ModelsSection, domains: DomainSet | None = None) -> None:
        self.models = models
        self.domains = domains
        auto_batch.set_cache_file(state_dir() / AUTO_BATCH_CACHE)

    @classmethod
    def of(cls, profile: Any) -> ModelRegistry:
        """The registry of a profile's models and domains."""
        return cls(profile.models, profile.domain_set)

    def _domains(self, spec: ModelSpec) -> DomainSet:
        if self.domains is None:
            raise ModelLoadError(f"{spec.backend}: this backend measures the profile's domains; build the registry "
                                 "with them (ModelRegistry.of(profile))")
        return self.domains

    def detector(self) -> Detector:
        return load_detector(self.models.detector, str(state_dir()))

    def image_embedder(self, spec: ModelSpec | None = None) -> ImageEmbedder:
        spec = spec or self.models.image_embedder or BUNDLED_IMAGE_EMBEDDER

        def build() -> ImageEmbedder:
            from models.backends.image_embedders import EfficientNetLiteEmbedder, TransformersImageEmbedder

            return EfficientNetLiteEmbedder(spec) if spec.backend == "efficientnet-lite0" \
                else TransformersImageEmbedder(spec)

        return _cached("image_embedder", spec, build)

    def text_encoder(self, spec: ModelSpec | None = None) -> TextEncoder:
        spec = spec or self.models.text_encoder or BUNDLED_TEXT_ENCODER

        def build() -> TextEncoder:
            from models.backends.text_encoders import SentenceTransformerTextEncoder

            return SentenceTransformerTextEncoder(spec)

        return _cached("text_encoder", spec, build)

    def _bundled_embedder(self, batch_size: int | str = "auto"):
        """The bundled EfficientNet-Lite0 inside a composed backend, at that backend's batch size, with
        the options of the profile's image embedder when that is EfficientNet-Lite0 too (one set of
        speed settings, and at the same batch size one shared instance)."""
        from models.backends.image_embedders import EfficientNetLiteEmbedder

        embedder = self.image_embedder(self._bundled_embedder_spec(batch_size))
        assert isinstance(embedder, EfficientNetLiteEmbedder)
        return embedder

    def _bundled_embedder_spec(self, batch_size: int | str) -> ModelSpec:
        base = self.models.image_embedder
        if base is None or base.backend != BUNDLED_IMAGE_EMBEDDER.backend:
            base = BUNDLED_IMAGE_EMBEDDER
        return base.model_copy(update={"batch_size": batch_size})

    def _part_specs(self, spec: ModelSpec) -> dict[str, ModelSpec | DetectorSpec]:
        """What a composed backend is built from: the semantic bridge from the bundled embedder, the
        detector and the text encoder; the attribute expert from the detector; the grounded captioner
        from the bundled embedder and the detector. Other backends: nothing."""
        if spec.backend == "semantic-bridge":
            return {"image_embedder": self._bundled_embedder_spec(spec.batch_size), "detector": self.models.detector,
                    "text_encoder": self.models.text_encoder or BUNDLED_TEXT_ENCODER}
        if spec.backend == "attributes":
            return {"detector": self.models.detector}
        if spec.backend == "grounded":
            return {"image_embedder": self._bundled_embedder_spec("auto"), "detector": self.models.detector}
        return {}

    def _parts(self, spec: ModelSpec) -> tuple[str, ...]:
        """The specs a composed backend is built from (see ``_cached``), and the domains it measures."""
        parts = tuple(p.model_dump_json() if isinstance(p, DetectorSpec) else p.cache_key()
                      for p in self._part_specs(spec).values())
        return (*parts, self._domains(spec).fingerprint) if spec.backend in DOMAIN_BACKENDS else parts

    def lineage(self, spec: ModelSpec) -> dict[str, Any]:
        """``spec_lineage`` of a backend with the lineage of the parts it is composed of (``parts``):
        the detector's threshold changes what the semantic-bridge and attribute experts encode and
        what the grounded captioner states, so it is part of the keys of the stages that use them."""
        out = spec_lineage(spec)
        parts = self._part_specs(spec)
        if parts:
            out["parts"] = {name: detector_lineage(p) if isinstance(p, DetectorSpec) else spec_lineage(p)
                            for name, p in parts.items()}
        if spec.backend in DOMAIN_BACKENDS:
            out["domains"] = self._domains(spec).fingerprint
        return out

    def expert(self, spec: ModelSpec) -> TextImageExpert:
        def build() -> TextImageExpert:
            from models.backends import experts

            if spec.backend == "semantic-bridge":
                from models.backends.text_vectors import cache_folder

                return experts.SemanticBridgeExpert(spec, self._bundled_embedder(spec.batch_size), self.detector(),
                                                    self.text_encoder(),
                                                    cache_folder(state_dir() / TEXT_VECTOR_CACHE))
            if spec.backend == "attributes":
                return experts.AttributeExpert(spec, self.detector(), self._domains(spec))
            if spec.backend == "transformers-clip":
                return experts.TransformersClipExpert(spec)
            if spec.backend in ("sentence-transformers", "open-clip"):
                from models.backends import clip_experts

                return clip_experts.SentenceTransformersClipExpert(spec) if spec.backend == "sentence-transformers" \
                    else clip_experts.OpenClipExpert(spec)
            return experts.VlmEmbeddingExpert(spec)

        return _cached("experts", spec, build, self._parts(spec))

    def experts(self) -> list[TextImageExpert]:
        return [self.expert(spec) for spec in self.models.experts]

    def generator(self, spec: ModelSpec) -> Generator:
        def build() -> Generator:
            from models.backends import generators, llama_cpp_generator

            if spec.backend == "grounded":
                from models.backends.grounded_captioner import GroundedCaptionGenerator

                llm = self.generator(ModelSpec(**{**BUNDLED_LLM, **spec.options.get("llm", {})}))
                return GroundedCaptionGenerator(spec, self.detector(), self._bundled_embedder(), llm,
                                                self._domains(spec))
            return {"llama-cpp": llama_cpp_generator.LlamaCppGenerator, "openai-http": generators.OpenAIHttpGenerator,
                    "vllm": generators.VllmGenerator, "transformers-vlm": generators.TransformersVlmGenerator,
                    }[spec.backend](spec)

        return _cached("generators", spec, build, self._parts(spec))

    def generators(self) -> list[Generator]:
        return [self.generator(spec) for spec in self.models.generators]

    def configured(self) -> list[tuple[str, ModelSpec | Any]]:
        """Every (role, spec) the profile names, with bundled defaults for unset roles."""
        out: list[tuple[str, Any]] = [("detector", self.models.detector),
                                      ("image_embedder", self.models.image_embedder or BUNDLED_IMAGE_EMBEDDER),
                                      ("text_encoder", self.models.text_encoder or BUNDLED_TEXT_ENCODER)]
        out += [("experts", s) for s in self.models.experts]
        out += [("generators", s) for s in self.models.generators]
        if self.models.teacher:
            out.append(("teacher", self.models.teacher))
        out += [(role, getattr(self.models, role) or ModelSpec(**BUNDLED_LLM))
                for role in ("query_generator", "template_generator")]
        return out

    def load(self, role: str, spec: Any) -> Any:
        """Load one configured model by role (used by ``rde models``)."""
        if role == "detector":
            return self.detector()
        if role == "image_embedder":
            return self.image_embedder(spec)
        if role == "text_encoder":
            return self.text_encoder(spec)
        if role in ("experts", "teacher"):
            return self.expert(spec)
        return self.generator(spec)
