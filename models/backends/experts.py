"""Text–image experts: encode texts and images into one space, compared by cosine.

Offline (real bundled weights, no vision-language model needed):

* ``SemanticBridgeExpert``: an image becomes the probability-weighted MiniLM embedding of its
  ImageNet classes (EfficientNet-Lite0) plus its detected COCO objects (SSD-MobileNet); a query
  is its MiniLM embedding. Knows *what* is in the image, not colours.
* ``AttributeExpert``: measured colours per region, carried and ridden objects, the subject's type
  versus the same slots parsed from the query. Knows colours and objects, not semantics.

Production: ``TransformersClipExpert`` (CLIP / SigLIP by id) and ``VlmEmbeddingExpert``
(last-token pooled embeddings of a vision-language model, Qwen3-VL-Embedding / Jina-v4 style).
"""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from models.backends import auto_batch
from models.backends.attributes import measure_attributes, parse_text_attributes
from models.backends.detectors import Detector
from models.backends.image_embedders import EfficientNetLiteEmbedder
from models.backends.interfaces import TextEncoder, l2_normalize
from models.backends.model_errors import ModelLoadError, hub_hint
from models.backends.slot_layout import slot_layout
from models.backends.text_vectors import cached_text_vectors
from models.backends.torch_runtime import batched, load_image_text_model, resolve_device, resolve_dtype
from models.domains import DomainSet
from models.specs import ModelSpec


class SemanticBridgeExpert:
    """Image → MiniLM space through ImageNet class probabilities and detected object labels.

    Options: ``top_k`` classes (5), ``class_prompt`` ("a photo of a {}"), ``detection_weight`` (1.0),
    ``min_detection_score`` (0.3). The class prompts' vectors are kept in ``vector_cache`` (a
    folder; see ``models.backends.text_vectors``) for later processes.
    """

    preprocessing = "effnet-lite0-imagenet+ssd-coco→minilm"

    def __init__(self, spec: ModelSpec, embedder: EfficientNetLiteEmbedder, detector: Detector,
                 text_encoder: TextEncoder, vector_cache: Path | None = None) -> None:
        self.spec = spec
        self.model_id = spec.model_id
        self.embedder, self.detector, self.text_encoder = embedder, detector, text_encoder
        self.dim = text_encoder.dim
        self.top_k = int(spec.options.get("top_k", 5))
        self.prompt = str(spec.options.get("class_prompt", "a photo of a {}"))
        self.detection_weight = float(spec.options.get("detection_weight", 1.0))
        self.min_detection_score = float(spec.options.get("min_detection_score", 0.3))
        self.vector_cache = vector_cache

    @cached_property
    def _class_vectors(self) -> np.ndarray:
        prompts = [self.prompt.format(name) for name in self.embedder.class_names]
        return cached_text_vectors(self.text_encoder, prompts, self.vector_cache)

    def _label_vectors(self, labels: list[str]) -> dict[str, np.ndarray]:
        unique = sorted(set(labels))
        return dict(zip(unique, self.text_encoder.encode([self.prompt.format(x) for x in unique]), strict=True))

    def encode_text(self, texts: list[str]) -> np.ndarray:
        return self.text_encoder.encode(texts)

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        if not images:
            return np.zeros((0, self.dim), np.float32)
        probs = self.embedder.class_probabilities(images)
        detections = self.detector.detect(images)
        labels = self._label_vectors([lab for d in detections for lab in d.labels])
        out = np.zeros((len(images), self.dim), np.float32)
        for i, (p, dets) in enumerate(zip(probs, detections, strict=True)):
            top = np.argsort(-p)[: self.top_k]
            weights = p[top] / max(float(p[top].sum()), 1e-12)
            out[i] = weights @ self._class_vectors[top]
            for label, score in zip(dets.labels, dets.scores, strict=True):
                if score >= self.min_detection_score:
                    out[i] += self.detection_weight * float(score) * labels[label]
        return l2_normalize(out)


class AttributeExpert:
    """Measured attributes vs parsed query, in the slots of the profile's domains (colours per
    region, carried and ridden objects, the subject's type: ``slot_layout.SlotLayout``).
    ``track_slots`` (its slot layout, whose motion states a text is parsed into): the stages that
    rank with it also compare the motion and direction a query states with each image's video
    track (``rde.common.track_slots``): the pixels of one crop cannot say which way a subject
    moves."""

    def __init__(self, spec: ModelSpec, detector: Detector, domains: DomainSet) -> None:
        self.spec = spec
        self.model_id = spec.model_id
        self.detector = detector
        self.layout = self.track_slots = slot_layout(domains)
        self.dim = sum(len(vocab) for vocab in self.layout.slots.values())
        self.object_min_score = float(spec.options.get("object_min_score", 0.3))
        self.mask_iterations = int(spec.options.get("mask_iterations", 2))  # GrabCut person mask; 0 = box
        self.preprocessing = f"ssd-coco+grabcut{self.mask_iterations}+lab-colour-naming-v2+riding-v1"

    def encode_text(self, texts: list[str]) -> np.ndarray:
        return np.stack([parse_text_attributes(t, self.layout).vector() for t in texts]) if texts \
            else np.zeros((0, self.dim), np.float32)

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        """Measured attribute vectors; ``batch_size: auto`` hands the detector every image at once
        (it chunks by its own batch size, the only one that changes speed here)."""
        out = []
        size = max(1, len(images)) if self.spec.batch_size == auto_batch.AUTO else int(self.spec.batch_size)
        for batch in batched(images, size):
            for image, dets in zip(batch, self.detector.detect(list(batch)), strict=True):
                out.append(measure_attributes(image, dets, self.layout, self.object_min_score,
                                                  self.mask_iterations).vector())
        return np.stack(out) if out else np.zeros((0, self.dim), np.float32)


def _features(output: object) -> torch.Tensor:
    """``get_*_features`` returns a tensor (transformers 4) or an output with ``pooler_output`` (5)."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output  # type: ignore[attr-defined]


class BatchedTowers:
    """A dual encoder's two towers in batches of its auto-chosen size (``self.batch``), vectors
    L2-normalised: a subclass sets ``batch`` and ``dim`` and implements ``_text`` and ``_image``."""

    batch: auto_batch.BatchSize
    dim: int

    def _text(self, texts: list[str]) -> np.ndarray:
        raise NotImplementedError

    def _image(self, images: list[np.ndarray]) -> np.ndarray:
        raise NotImplementedError

    def encode_text(self, texts: list[str]) -> np.ndarray:
        size = self.batch.resolve("text", list(texts), lambda b: self._text(list(b)))
        out = [self._text(list(b)) for b in batched(list(texts), size)]
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        size = self.batch.resolve("image", images, lambda b: self._image(list(b)))
        out = [self._image(list(b)) for b in batched(images, size)]
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)


class TransformersClipExpert(BatchedTowers):
    """CLIP / SigLIP (any dual encoder with ``get_text_features``/``get_image_features``) by id."""

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

        self.spec = spec
        self.model_id = spec.model_id
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(spec.model_id, revision=spec.revision)
            self.image_processor = AutoImageProcessor.from_pretrained(spec.model_id, revision=spec.revision)
            self.model = AutoModel.from_pretrained(spec.model_id, revision=spec.revision, dtype=self.dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("expert", spec.model_id, exc)) from exc
        self.model.eval().to(self.device)
        cfg = self.model.config
        self.dim = int(getattr(cfg, "projection_dim", 0) or cfg.text_config.hidden_size)
        # SigLIP was trained with max-length padding; CLIP with dynamic padding
        self.padding = spec.options.get("padding", "max_length" if "siglip" in cfg.model_type else True)
        self.max_length = int(spec.options.get("max_length", getattr(cfg.text_config, "max_position_embeddings", 64)))
        self.preprocessing = f"hf:{type(self.image_processor).__name__}:{spec.revision or 'main'}"
        self.batch = auto_batch.for_spec(spec, self.device)

    @torch.inference_mode()
    def _text(self, texts: list[str]) -> np.ndarray:
        tok = self.tokenizer(list(texts), padding=self.padding, truncation=True, max_length=self.max_length,
                             return_tensors="pt").to(self.device)
        return _features(self.model.get_text_features(**tok)).float().cpu().numpy()

    @torch.inference_mode()
    def _image(self, images: list[np.ndarray]) -> np.ndarray:
        pix = self.image_processor(images=list(images), return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        return _features(self.model.get_image_features(pixel_values=pix)).float().cpu().numpy()



class VlmEmbeddingExpert:
    """Embeddings from a vision-language model, as Qwen3-VL-Embedding / GME / Jina-v4 compute them:
    the final hidden state of the last token of a chat-formatted input (left padding), L2-normalised.

    Options: ``text_instruction`` and ``image_instruction`` (the task prompts these models are
    trained with), ``trust_remote_code`` (False).
    """

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.model_id = spec.model_id
        self.processor, self.model, self.device, self.dtype = load_image_text_model(spec, "expert")
        cfg = self.model.config
        self.dim = int(getattr(cfg, "text_config", cfg).hidden_size)
        self.text_instruction = spec.options.get("text_instruction", "Find an image that matches the given text.")
        self.image_instruction = spec.options.get("image_instruction", "Represent the given image.")
        self.preprocessing = f"hf:{type(self.processor).__name__}:last-token:{spec.revision or 'main'}"
        self.batch = auto_batch.for_spec(spec, self.device)

    def _conversation(self, text: str, with_image: bool) -> str:
        content = ([{"type": "image"}] if with_image else []) + [{"type": "text", "text": text}]
        messages = [{"role": "system", "content": [{"type": "text", "text": self.text_instruction if not with_image
                                                    else self.image_instruction}]},
                    {"role": "user", "content": content}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)

    @torch.inference_mode()
    def _embed(self, texts: list[str], images: list[np.ndarray] | None) -> np.ndarray:
        kwargs = {"text": texts, "return_tensors": "pt", "padding": True}
        if images:
            kwargs["images"] = images
        inputs = self.processor(**kwargs).to(self.device)
        out = self.model(**inputs, output_hidden_states=True)
        return out.hidden_states[-1][:, -1].float().cpu().numpy()  # left padding: the last token is real

    def _texts(self, texts: list[str]) -> np.ndarray:
        return self._embed([self._conversation(t, False) for t in texts], None)

    def _images(self, images: list[np.ndarray]) -> np.ndarray:
        return self._embed([self._conversation("", True) for _ in images], list(images))

    def encode_text(self, texts: list[str]) -> np.ndarray:
        size = self.batch.resolve("text", list(texts), lambda b: self._texts(list(b)))
        out = [self._texts(list(b)) for b in batched(list(texts), size)]
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        size = self.batch.resolve("image", images, lambda b: self._images(list(b)))
        out = [self._images(list(b)) for b in batched(images, size)]
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)
