"""Seeds that follow the data, not the run's order or sharding."""

from __future__ import annotations

from storage.hashing import sha256_json


def draw_seed(seed: int, image_id: str) -> int:
    """A 63-bit seed that depends only on the run seed and the image (not on order or sharding)."""
    return int(sha256_json({"seed": seed, "image": image_id})[:15], 16)
