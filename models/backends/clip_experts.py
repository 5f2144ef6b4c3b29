"""Text–image experts from the two other CLIP ecosystems (``transformers-clip`` is in ``experts.py``):

* ``SentenceTransformersClipExpert`` (backend ``sentence-transformers`` in the experts role): a
  sentence-transformers model that encodes texts and images (``clip-ViT-B-32``, a saved
  ``SentenceTransformer`` folder with a CLIP module), ``model.encode`` on strings and on PIL images.
* ``OpenClipExpert`` (backend ``open-clip``): an OpenCLIP model. ``model_id`` is the architecture
  (``ViT-B-32``, a model-config JSON file, or ``hf-hub:org/repo`` / ``local-dir:/folder``);
  ``options.pretrained`` is the weights: a pretrained tag (downloaded into the cache where the hub
  is reachable) or a checkpoint file. Needs the optional ``open_clip_torch``
  (``pip install '.[open-clip]'``).

Both return L2-normalised float32 vectors, batched by ``batch_size`` (``auto``: measured).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from models.backends import auto_batch
from models.backends.experts import BatchedTowers
from models.backends.model_errors import ModelLoadError, hub_hint
from models.backends.torch_runtime import resolve_device, resolve_dtype
from models.specs import OPEN_CLIP_SCHEMAS, ModelSpec

OPEN_CLIP_MISSING = "open-clip: open_clip_torch is not installed; pip install '.[open-clip]'"


def _pil(images: list[np.ndarray]) -> list:
    """RGB uint8 arrays → PIL images (what both libraries' image preprocessing takes)."""
    from PIL import Image

    return [Image.fromarray(np.ascontiguousarray(im, dtype=np.uint8)).convert("RGB") for im in images]


class SentenceTransformersClipExpert(BatchedTowers):
    """A sentence-transformers model with a text and an image modality (``clip-ViT-B-32`` and
    friends, or a local folder saved by ``SentenceTransformer.save``). A text-only model is refused."""

    def __init__(self, spec: ModelSpec) -> None:
        from sentence_transformers import SentenceTransformer

        self.spec = spec
        self.model_id = spec.model_id
        self.device = resolve_device(spec.device)
        try:
            self.model = SentenceTransformer(spec.model_id, device=str(self.device), revision=spec.revision)
        except (OSError, ValueError) as exc:
            raise ModelLoadError(hub_hint("expert", spec.model_id, exc)) from exc
        modalities = list(getattr(self.model, "modalities", ["text", "image"]))
        if "image" not in modalities:
            raise ModelLoadError(f"expert: sentence-transformers model {spec.model_id!r} encodes {modalities} only, "
                                 "not images (a text-image model such as clip-ViT-B-32 is needed)")
        self.model.eval()
        dim = getattr(self.model, "get_embedding_dimension", self.model.get_sentence_embedding_dimension)()
        self.dim = int(dim) if dim else int(self._encode(["a"]).shape[1])
        self.preprocessing = f"sentence-transformers:{spec.revision or 'main'}"
        self.batch = auto_batch.for_spec(spec, self.device)

    @torch.inference_mode()
    def _encode(self, inputs: list) -> np.ndarray:
        out = self.model.encode(list(inputs), batch_size=max(1, len(inputs)), convert_to_numpy=True,
                                normalize_embeddings=False, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)

    def _text(self, texts: list[str]) -> np.ndarray:
        return self._encode(list(texts))

    def _image(self, images: list[np.ndarray]) -> np.ndarray:
        return self._encode(_pil(list(images)))


def open_clip_arch(model_id: str) -> str:
    """The OpenCLIP model name for ``model_id``: a model-config JSON file is registered with
    open_clip (its name is the file's stem); a built-in name or a schema'd id is used as it is."""
    import open_clip

    path = Path(model_id).expanduser()
    if model_id.endswith(".json"):
        if not path.is_file():
            raise ModelLoadError(f"open-clip: no such file or folder: {path}")
        open_clip.add_model_config(path)
        return path.stem
    return model_id


class OpenClipExpert(BatchedTowers):
    """An OpenCLIP model: ``model_id`` the architecture (or a config JSON, ``hf-hub:``, ``local-dir:``),
    ``options.pretrained`` the weights (a tag or a checkpoint file; not used with a schema'd id)."""

    def __init__(self, spec: ModelSpec) -> None:
        try:
            import open_clip
        except ImportError as exc:
            raise ModelLoadError(OPEN_CLIP_MISSING) from exc
        self.spec = spec
        self.model_id = spec.model_id
        self.device = resolve_device(spec.device)
        self.dtype = resolve_dtype(spec.dtype, self.device)
        pretrained = spec.options.get("pretrained")
        schema = spec.model_id.startswith(OPEN_CLIP_SCHEMAS)
        if not pretrained and not schema:
            raise ModelLoadError(f"open-clip: {spec.model_id!r} needs options.pretrained (a pretrained tag or a "
                                 "checkpoint file): random weights are not a retriever")
        arch = open_clip_arch(spec.model_id)
        try:
            self.model, _, self.preprocess = open_clip.create_model_and_transforms(
                arch, pretrained=None if schema else str(pretrained), device=self.device)
            self.tokenizer = open_clip.get_tokenizer(arch)
        except (OSError, RuntimeError, ValueError) as exc:
            raise ModelLoadError(hub_hint("expert", f"{arch}:{pretrained}" if pretrained else arch, exc)) from exc
        self.model.eval().to(self.device, self.dtype)
        cfg = open_clip.get_model_config(arch) or {}
        self.dim = int(cfg.get("embed_dim") or self._text(["a"]).shape[1])
        self.preprocessing = f"open_clip:{arch}:{getattr(self.model.visual, 'image_size', '?')}"
        self.batch = auto_batch.for_spec(spec, self.device)

    @torch.inference_mode()
    def _text(self, texts: list[str]) -> np.ndarray:
        tokens = self.tokenizer(list(texts)).to(self.device)
        return self.model.encode_text(tokens).float().cpu().numpy()

    @torch.inference_mode()
    def _image(self, images: list[np.ndarray]) -> np.ndarray:
        pixels = torch.stack([self.preprocess(im) for im in _pil(images)]).to(self.device, self.dtype)
        return self.model.encode_image(pixels).float().cpu().numpy()

