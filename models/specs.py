"""What a profile says about models: backend specs and the table of backends per role.

They live next to the backends (``models/backends/registry.py`` builds them) so that ``models/``
depends on nothing above it; ``rde.profile`` composes them into a profile.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# an OpenCLIP model id that names its weights too (a Hub repo or a local folder), not only an architecture
OPEN_CLIP_SCHEMAS = ("hf-hub:", "local-dir:")


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, values are not coerced silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)



class DetectorSpec(Strict):
    """Detector backend. ``ssd_mobilenet`` uses the bundled COCO weights; ``yolo`` needs ``weights``;
    ``owl`` (OWL-ViT / OWLv2 through transformers) finds the classes it is told by name."""

    backend: Literal["ssd_mobilenet", "yolo", "owl"] = Field(
        "ssd_mobilenet", description="ssd_mobilenet = the bundled COCO detector; yolo = Ultralytics YOLO with "
        "weights; owl = an open-vocabulary OWL-ViT or OWLv2 (model_id), for classes outside COCO.")
    weights: str | None = Field(None, description="Local path to YOLO weights (.pt or .yaml); required for yolo.")
    model_id: str | None = Field(None, description="owl: a Hugging Face id or local folder of an OWL-ViT or OWLv2 "
                                 "detector (e.g. google/owlv2-base-patch16-ensemble).")
    revision: str | None = Field(None, description="owl: the Hugging Face revision to load (null = default branch).")
    classes: tuple[str, ...] = Field((), description="owl: the class names it reports (unset: every class the "
                                     "profile's domains name: subjects, carried and ridden objects).")
    prompts: tuple[str, ...] = Field((), description="owl: the text it looks for, one per class (unset: each "
                                     "domain's subject.open_vocabulary, else the class name).")
    score_threshold: float = Field(0.5, ge=0.0, le=1.0, description="Detections scoring lower are ignored.")
    nms_iou: float = Field(0.45, ge=0.0, le=1.0, description="Overlap (IoU) above which non-maximum suppression "
                           "drops the weaker of two boxes.")
    input_size: int = Field(300, ge=32, description="Side of the square network input the images are resized to "
                            "(pixels).")
    batch_size: int = Field(8, ge=1, description="Images per detector forward.")
    device: str = Field("cpu", description="Where the detector runs: cpu, cuda, cuda:N, mps or auto.")
    memo_items: int = Field(8192, ge=0, description="Detections of this many recent images kept per process "
                            "(speed only).")

    @model_validator(mode="after")
    def _yolo_needs_weights(self) -> DetectorSpec:
        if self.backend == "yolo" and not self.weights:
            raise ValueError("detector.backend 'yolo' needs detector.weights (a local .pt or .yaml path)")
        if self.backend == "owl" and not self.model_id:
            raise ValueError("detector.backend 'owl' needs detector.model_id (a Hugging Face id or local folder)")
        if self.prompts and len(self.prompts) != len(self.classes):
            raise ValueError(f"detector.prompts: one per class, got {len(self.prompts)} for {len(self.classes)}")
        return self


# The bundled CPU text LLM (SmolLM2 GGUF through llama.cpp): what an unset query or template generator
# falls back to, and what a profile writes out to choose it explicitly.
BUNDLED_LLM = {"backend": "llama-cpp", "model_id": "bundled:SmolLM2-135M-Instruct"}


class ModelSpec(Strict):
    """A model named by backend and id (Hugging Face id, local path, or a bundled name).

    ``device``: cpu | cuda | cuda:N | mps | auto. ``dtype`` applies on accelerators; the CPU always
    computes in float32. ``options`` holds backend-specific settings (see each backend's docstring).
    """

    backend: str = Field(description="The backend that loads the model; which ones a role accepts is listed "
                         "under models.")
    model_id: str = Field(description="A Hugging Face id, a local path, or a bundled:<name> model.")
    revision: str | None = Field(None, description="The Hugging Face revision (branch, tag or commit) to load; "
                                 "null = the default branch.")
    # ``auto``: measured on first use per (backend, model, device, machine), see models/backends/auto_batch.py
    batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(32, description="Inputs per forward; auto "
                                                                       "= measured on first use (embedders, text "
                                                                       "encoders and experts only).")
    device: str = Field("cpu", description="Where the model runs: cpu, cuda, cuda:N, mps or auto.")
    dtype: Literal["float32", "float16", "bfloat16"] = Field("float32", description="Weights and compute type on "
                                                             "accelerators; the CPU always computes in float32.")
    options: dict[str, Any] = Field(default_factory=dict, description="Backend-specific settings (see each "
                                    "backend's docstring).")

    @model_validator(mode="after")
    def _auto_only_where_measured(self) -> ModelSpec:
        if self.batch_size == "auto" and self.backend not in MEASURED_BACKENDS:
            raise ValueError(f"batch_size 'auto' is measured only for {sorted(MEASURED_BACKENDS)}; "
                             f"give backend {self.backend!r} a number")
        return self

    def cache_key(self) -> str:
        """Identity of the loaded model (for per-process caches and artifact lineage)."""
        return self.model_dump_json()


# Backend names per role (implemented in models/backends/registry.py).
BACKENDS: dict[str, set[str]] = {
    "image_embedder": {"efficientnet-lite0", "transformers"},
    "text_encoder": {"sentence-transformers"},
    "experts": {"semantic-bridge", "attributes", "transformers-clip", "vlm-embedding", "sentence-transformers",
                "open-clip"},
    "teacher": {"semantic-bridge", "attributes", "transformers-clip", "vlm-embedding", "sentence-transformers",
                "open-clip"},
    "generators": {"grounded", "llama-cpp", "openai-http", "vllm", "transformers-vlm"},
    "query_generator": {"llama-cpp", "openai-http", "vllm", "transformers-vlm"},
    "template_generator": {"llama-cpp", "openai-http", "vllm", "transformers-vlm"},
    "joint_encoder": {"bert"},
}
# Backends whose batch size only changes speed (within float tolerance), so it may be ``auto``.
MEASURED_BACKENDS = BACKENDS["image_embedder"] | BACKENDS["text_encoder"] | BACKENDS["experts"]
# Model options that change speed only (results equal within float tolerance): left out of stage keys.
SPEED_ONLY_OPTIONS = frozenset({"auto_batch", "fold_batch_norm", "channels_last", "memo_items", "facts_threads"})
# Detector fields of the same kind.
SPEED_ONLY_DETECTOR_FIELDS = frozenset({"memo_items"})


class ModelsSection(Strict):
    """The models a profile uses; unset roles fall back to the bundled offline models."""

    detector: DetectorSpec = Field(DetectorSpec(), description="The object detector of denoise (target count) "
                                   "and CGDS (category check).")
    image_embedder: ModelSpec | None = Field(None, description="Image embeddings for clustering and neighbours; "
                                             "null = the bundled EfficientNet-Lite0.")
    text_encoder: ModelSpec | None = Field(None, description="Text embeddings of the generated queries "
                                           "(near-duplicate check); null = the bundled MiniLM sentence encoder.")
    experts: list[ModelSpec] = Field(default_factory=list, description="Text-to-image experts whose top-K "
                                     "candidates are pooled into the benchmark's candidates (MECF).")
    generators: list[ModelSpec] = Field(default_factory=list, description="Image captioners: the first writes the "
                                        "caption pool; the GTR+ tiers draw one per image (seeded).")
    teacher: ModelSpec | None = Field(None, description="The teacher of SAFT's distillation losses; null = "
                                      "the last of models.experts.")
    query_generator: ModelSpec | None = Field(None, description="The text LLM of the DAP queries (production: "
                                              "Qwen3 through vllm); null = the bundled SmolLM2, an error on a "
                                              "profile with a model on cuda or a vllm backend.")
    template_generator: ModelSpec | None = Field(None, description="The text LLM of the GTR+ template gallery "
                                                 "(production: Qwen3 through vllm); null = the bundled SmolLM2, "
                                                 "an error on a profile with a model on cuda or a vllm backend.")

    @model_validator(mode="after")
    def _known_backends(self) -> ModelsSection:
        for role in ("image_embedder", "text_encoder", "teacher", "query_generator", "template_generator"):
            spec = getattr(self, role)
            if spec is not None and spec.backend not in BACKENDS[role]:
                raise ValueError(f"models.{role}.backend {spec.backend!r} is not one of {sorted(BACKENDS[role])}")
        for role in ("experts", "generators"):
            for i, spec in enumerate(getattr(self, role)):
                if spec.backend not in BACKENDS[role]:
                    raise ValueError(f"models.{role}[{i}].backend {spec.backend!r} is not one of "
                                     f"{sorted(BACKENDS[role])}")
        return self
