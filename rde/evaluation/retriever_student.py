"""``student:<path>``: a model trained by ``rde train-saft`` / ``rde train-gtr``, as a retriever.

What a training run leaves (``tasks/training/train.py``, ``rde/training/checkpoints.py``), under
the run's folder ``<artifacts root>/<flow>/<profile>/``:

* ``train_<method>/model.pt``: the final ``state_dict``;
* ``train_<method>/checkpoints/<stage key[:16]>/step-<n>.pt``: ``{"model": state_dict, "step": n, ...}``;
* ``train_<method>_log/_manifest.json``: the train stage's manifest. Its ``config.training`` is the
  profile's training section (``training.model``: the student's base model); its ``upstream``
  holds the training-features artifact's entry, whose ``models.models`` is the models section the
  features were computed with (``models_lineage``: detector, image embedder, text encoder, experts).

``<path>`` is one of those files, or a folder (the run's, or its ``train_<method>``): the newest
of the ``model.pt`` / ``step-*.pt`` / ``epoch-*.pt`` under it (modification time).

A state dict does not say how to compute its inputs, so the loader reads the manifest beside it:

* the CPU model (``FeatureDualEncoder``, ``training.model: null``) projects frozen features: an
  image is [the semantic-bridge vector ; the image embedder's pooled features] of the unaugmented
  image, a text is the bridge's text vector (``rde.training.retrieval_features``). The towers are
  rebuilt from the features entry's models section: ``experts[0]`` (the bridge), its detector and
  text encoder, and the image embedder;
* a CLIP-like student (``HFClipDualEncoder``) needs its base model (``training.model.model_id``):
  the architecture's config, tokenizer and image processor. The base must load offline.

Where no manifest fits (a checkpoint file copied elsewhere; a checkpoint whose stage key is not
the manifest's, i.e. a run whose train stage has not finished), both come from the profile given
to ``load_retriever`` (its ``models`` and ``training.model``), and the lineage says so.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.backends.registry import BUNDLED_IMAGE_EMBEDDER, ModelRegistry, spec_lineage
from models.backends.torch_runtime import batched, resolve_device
from models.specs import DetectorSpec, ModelSpec, ModelsSection
from rde.evaluation.retriever_specs import RetrieverError, RetrieverSpec, existing_path, fingerprint

TRAINED_FILE = re.compile(r"^(model|step-\d+|epoch-\d+)\.pt$")


@dataclass(frozen=True)
class TrainingConfig:
    """What the student's inputs are computed with, and where that was read (``origin``)."""

    origin: str
    base: ModelSpec | None  # training.model: the CLIP-like student's base; None = the CPU feature model
    models: ModelsSection  # the towers of the CPU model (experts[0] is the bridge)


def trained_file(spec: RetrieverSpec) -> Path:
    """The checkpoint ``spec`` names: the file, or the newest trained file under the folder."""
    path = existing_path(spec.text, spec.target)
    if path.is_file():
        return path
    found = [p for p in path.rglob("*.pt") if TRAINED_FILE.match(p.name)]
    if not found:
        raise RetrieverError(f"{spec.text}: no trained model under {path} (model.pt or checkpoints/*/step-*.pt of "
                             "a train-saft / train-gtr run)")
    return max(found, key=lambda p: (p.stat().st_mtime_ns, p.name))


def _fields(data: dict[str, Any] | None, cls: type) -> dict[str, Any] | None:
    return None if not data else {k: v for k, v in data.items() if k in cls.model_fields}


def _spec(data: dict[str, Any] | None) -> ModelSpec | None:
    fields = _fields(data, ModelSpec)
    return None if fields is None else ModelSpec(**fields)


def _manifest(checkpoint: Path) -> tuple[Path, dict[str, Any]] | None:
    """The train stage's manifest that fits ``checkpoint``: beside its stage folder, and for a step
    checkpoint with the stage key its folder is named after."""
    if checkpoint.parent.parent.name == "checkpoints":
        stage_dir, key = checkpoint.parent.parent.parent, checkpoint.parent.name
    else:
        stage_dir, key = checkpoint.parent, None
    manifest = stage_dir.parent / f"{stage_dir.name}_log" / "_manifest.json"
    if not manifest.is_file():
        return None
    data = json.loads(manifest.read_text(encoding="utf-8"))
    if key is not None and not str(data.get("stage_key", "")).startswith(key):
        return None
    return manifest, data


def training_config(checkpoint: Path, profile: Any) -> TrainingConfig:
    """The student's base model and towers: from the run's manifest, else from ``profile``."""
    found = _manifest(checkpoint)
    if found is None:
        return TrainingConfig(f"profile {profile.name}", profile.training.model, profile.models)
    path, data = found
    base = _spec((data.get("config", {}).get("training") or {}).get("model"))
    models = next((u["models"]["models"] for u in data.get("upstream", [])
                   if isinstance(u.get("models"), dict) and isinstance(u["models"].get("models"), dict)), None)
    if models is None:
        section = profile.models
    else:
        section = ModelsSection(detector=DetectorSpec(**(_fields(models.get("detector"), DetectorSpec) or {})),
                                image_embedder=_spec(models.get("image_embedder")),
                                text_encoder=_spec(models.get("text_encoder")),
                                experts=[s for s in (_spec(d) for d in models.get("experts") or []) if s][:1])
    return TrainingConfig(f"manifest {path} (stage key {str(data.get('stage_key', ''))[:16]})", base, section)


def student_lineage(spec: RetrieverSpec, profile: Any) -> dict[str, Any]:
    """The checkpoint's content and what its inputs are computed with."""
    checkpoint = trained_file(spec)
    config = training_config(checkpoint, profile)
    out: dict[str, Any] = {"checkpoint": fingerprint(checkpoint), "config": config.origin}
    if config.base is not None:
        out["base_model"] = spec_lineage(config.base)
    elif config.models.experts:
        registry = ModelRegistry(config.models)
        out["towers"] = {"bridge": registry.lineage(config.models.experts[0]),
                         "image_embedder": spec_lineage(config.models.image_embedder or BUNDLED_IMAGE_EMBEDDER)}
    return out


class FeatureStudent:
    """The CPU model over the frozen towers it was trained on (module docstring)."""

    def __init__(self, model: torch.nn.Module, bridge: Any, embedder: Any) -> None:
        self.model, self.bridge, self.embedder = model, bridge, embedder
        self.dim = int(model.txt_proj.out_features)
        self.preprocessing = f"student-features:{bridge.preprocessing}+{embedder.preprocessing}"

    @torch.inference_mode()
    def encode_text(self, texts: list[str]) -> np.ndarray:
        features = torch.from_numpy(np.asarray(self.bridge.encode_text(list(texts)), np.float32))
        return self.model.encode_text(features).numpy()

    @torch.inference_mode()
    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        features = np.concatenate([self.bridge.encode_image(list(images)), self.embedder.embed(list(images))], axis=1)
        return self.model.encode_image(torch.from_numpy(features.astype(np.float32))).numpy()


class ClipStudent:
    """A fine-tuned CLIP-like model, preprocessed as training evaluates it (``tokens``, ``pixel_values``)."""

    def __init__(self, model: Any, device: torch.device) -> None:
        self.model, self.device = model, device
        self.dim = int(model.model.config.projection_dim)
        self.preprocessing = f"student-clip:{type(model.image_processor).__name__}"

    @torch.inference_mode()
    def encode_text(self, texts: list[str]) -> np.ndarray:
        out = [self.model.encode_text({k: v.to(self.device) for k, v in self.model.tokens(list(b)).items()})
               for b in batched(list(texts), 256)]
        return torch.cat(out).float().cpu().numpy()

    @torch.inference_mode()
    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        out = [self.model.encode_image(self.model.pixel_values(list(b)).to(self.device)) for b in batched(images, 64)]
        return torch.cat(out).float().cpu().numpy()


def _state_dict(spec: RetrieverSpec, checkpoint: Path) -> dict[str, torch.Tensor]:
    try:
        state = torch.load(checkpoint, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise RetrieverError(f"{spec.text}: {checkpoint} is not a torch checkpoint ({type(exc).__name__})") from exc
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a step checkpoint; model.pt is the state dict itself
    if not isinstance(state, dict) or not state:
        raise RetrieverError(f"{spec.text}: {checkpoint} holds no model state")
    return state


def load_student(spec: RetrieverSpec, profile: Any, device: str = "auto") -> FeatureStudent | ClipStudent:
    """The student ``spec`` names, with the towers or base model it was trained with."""
    from models.retrieval.dual_encoder import FeatureDualEncoder, HFClipDualEncoder

    checkpoint = trained_file(spec)
    state = _state_dict(spec, checkpoint)
    config = training_config(checkpoint, profile)
    where = f"{spec.text}: {checkpoint.name} (read with the {config.origin})"
    if "img_proj.weight" in state:
        d, total = state["img_proj.weight"].shape
        model = FeatureDualEncoder(bridge_dim=d, cnn_dim=total - d, text_dim=d)
        try:
            model.load_state_dict(state)
        except RuntimeError as exc:  # a state dict of another shape: one line, not a traceback
            raise RetrieverError(f"{where}: the weights do not fit a feature student "
                                 f"({str(exc).splitlines()[0]})") from None
        if not config.models.experts:
            raise RetrieverError(f"{where}: no expert to compute the bridge features with")
        registry = ModelRegistry(config.models)
        try:
            bridge, embedder = registry.expert(config.models.experts[0]), registry.image_embedder()
        except Exception as exc:
            raise RetrieverError(f"{where}: its towers could not be loaded ({type(exc).__name__}: {exc})") from exc
        if (bridge.dim, embedder.dim) != (d, total - d):
            raise RetrieverError(f"{where}: the model takes {d} bridge + {total - d} image features, its towers "
                                 f"give {bridge.dim} + {embedder.dim} (not the towers it was trained on)")
        return FeatureStudent(model.eval(), bridge, embedder)
    if any(k.startswith("model.") for k in state):
        if config.base is None:
            raise RetrieverError(f"{where}: a CLIP-like student, but training.model (its base model) is not set")
        try:
            model = HFClipDualEncoder(config.base.model_id, revision=config.base.revision)
            model.load_state_dict(state)
        except (OSError, ValueError, RuntimeError) as exc:
            raise RetrieverError(f"{where}: its base model {config.base.model_id!r} could not be loaded or does not "
                                 f"fit ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); the base must be a "
                                 "local folder or in the Hugging Face cache (`rde models fetch`)") from exc
        target = resolve_device(device)
        return ClipStudent(model.eval().to(target), target)
    raise RetrieverError(f"{where}: not a train-saft / train-gtr model (keys {sorted(state)[:3]}...)")
