"""What a profile says about models: backend specs and the table of backends per role.

They live next to the backends (``models/backends/registry.py`` builds them) so that ``models/``
depends on nothing above it; ``rde.common.profiles`` composes them into a profile.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, values are not coerced silently."""

    model_config = ConfigDict(extra="forbid", frozen=True)



class DetectorSpec(Strict):
    """Detector backend. ``ssd_mobilenet`` uses the bundled COCO weights; ``yolo`` needs ``weights``."""

    backend: Literal["ssd_mobilenet", "yolo"] = "ssd_mobilenet"
    weights: str | None = None  # local path to YOLO weights (.pt / .yaml); required for yolo
    score_threshold: float = Field(0.5, ge=0.0, le=1.0)
    nms_iou: float = Field(0.45, ge=0.0, le=1.0)
    input_size: int = Field(300, ge=32)
    batch_size: int = Field(8, ge=1)
    device: str = "cpu"
    memo_items: int = Field(8192, ge=0)  # detections of this many recent images kept per process (speed only)

    @model_validator(mode="after")
    def _yolo_needs_weights(self) -> DetectorSpec:
        if self.backend == "yolo" and not self.weights:
            raise ValueError("detector.backend 'yolo' needs detector.weights (a local .pt or .yaml path)")
        return self


class ModelSpec(Strict):
    """A model named by backend and id (Hugging Face id, local path, or a bundled name).

    ``device``: cpu | cuda | cuda:N | mps | auto. ``dtype`` applies on accelerators; the CPU always
    computes in float32. ``options`` holds backend-specific settings (see each backend's docstring).
    """

    backend: str
    model_id: str
    revision: str | None = None
    # ``auto``: measured on first use per (backend, model, device, machine), see models/backends/auto_batch.py
    batch_size: Annotated[int, Field(ge=1)] | Literal["auto"] = 32
    device: str = "cpu"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    options: dict[str, Any] = Field(default_factory=dict)

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
    "experts": {"semantic-bridge", "attributes", "transformers-clip", "vlm-embedding"},
    "teacher": {"semantic-bridge", "attributes", "transformers-clip", "vlm-embedding"},
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

    detector: DetectorSpec = DetectorSpec()
    image_embedder: ModelSpec | None = None
    text_encoder: ModelSpec | None = None
    experts: list[ModelSpec] = Field(default_factory=list)
    generators: list[ModelSpec] = Field(default_factory=list)
    teacher: ModelSpec | None = None
    query_generator: ModelSpec | None = None  # text LLM for DAP queries (default: bundled SmolLM2)
    template_generator: ModelSpec | None = None  # text LLM for the GTR+ template gallery (default: SmolLM2)

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
