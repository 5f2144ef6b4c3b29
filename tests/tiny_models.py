"""The tiny random-weight model builders (``entry.tiny_models``) under the name the tests
import, and random test images."""

import numpy as np

from entry.tiny_models import (  # noqa: F401
    build_tiny_bert,
    build_tiny_clip,
    build_tiny_dinov2,
    build_tiny_owl,
    build_tiny_qwen2,
    build_tiny_qwen2vl,
    build_tiny_qwen3,
    tiny_tokenizer,
)


def random_images(n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 255, (int(rng.integers(60, 130)), int(rng.integers(30, 70)), 3), dtype=np.uint8)
            for _ in range(n)]
