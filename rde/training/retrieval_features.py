"""Cached tower and teacher features for training the CPU dual encoder.

Image side, per view: the semantic-bridge vector (MiniLM space) and EfficientNet-Lite0's pooled
features. View 0 is the image itself; views 1..V-1 are random resized crops with the paper's
ranges (scale [0.8, 1.0], aspect ratio [0.2, 2.0]), seeded per image. Teacher vectors (any
TextImageExpert) are computed once for every image and every text, so a training step never runs
the teacher (SAFT: "teacher embeddings precomputed once").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import cv2
import numpy as np

from models.backends.interfaces import TextImageExpert
from rde.common.seeds import draw_seed


def random_resized_crop(image: np.ndarray, rng: np.random.Generator, scale: tuple[float, float] = (0.8, 1.0),
                        ratio: tuple[float, float] = (0.2, 2.0), attempts: int = 10) -> np.ndarray:
    """A crop of area share in ``scale`` and aspect ratio (w/h, log-uniform) in ``ratio``, resized
    back to the original size; falls back to the whole image when no crop fits (as torchvision)."""
    h, w = image.shape[:2]
    area = h * w
    for _ in range(attempts):
        target = area * rng.uniform(*scale)
        aspect = math.exp(rng.uniform(math.log(ratio[0]), math.log(ratio[1])))
        cw, ch = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < cw <= w and 0 < ch <= h:
            x, y = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
            return cv2.resize(image[y:y + ch, x:x + cw], (w, h), interpolation=cv2.INTER_LINEAR)
    return image


@dataclass
class ImageFeatures:
    bridge: np.ndarray  # V×N×d
    cnn: np.ndarray  # V×N×c
    teacher: np.ndarray | None  # N×t

    def stacked(self) -> np.ndarray:
        """V×N×(d+c): the FeatureDualEncoder's image input."""
        return np.concatenate([self.bridge, self.cnn], axis=2).astype(np.float32)


def image_features(images: Sequence[np.ndarray], ids: Sequence[str], bridge: TextImageExpert, embedder,
                   teacher: TextImageExpert | None, views: int = 3, seed: int = 0) -> ImageFeatures:
    """Tower features of ``views`` views per image (view 0 unaugmented) and teacher vectors."""
    per_view_bridge, per_view_cnn = [], []
    for v in range(views):
        batch = list(images) if v == 0 else [
            random_resized_crop(im, np.random.default_rng(draw_seed(seed, f"{i}#view{v}")))
            for im, i in zip(images, ids, strict=True)]
        per_view_bridge.append(bridge.encode_image(batch))
        per_view_cnn.append(embedder.embed(batch))
    return ImageFeatures(np.stack(per_view_bridge), np.stack(per_view_cnn),
                         teacher.encode_image(list(images)) if teacher is not None else None)
