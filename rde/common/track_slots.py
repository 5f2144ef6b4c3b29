"""The attribute expert's motion and direction slots: a query's "walking to the left" compared
with what each gallery image's video track measured (``rde.common.track_context``).

An expert whose ``track_slots`` is true (the attribute expert) scores a query q against an image g
as

    s(q, g) = (a_q · a_g + w · t_q · t_g) / ‖(a_q, w · t_q)‖

where a are the expert's own unit vectors (colours, objects, types), t the one-hot motion and
direction slots (the layout's ``motion`` states and ``DIRECTIONS``) the query states and the
track measured, and w the weight of the track slots (1: a slot counts as much as any other). The
query side is renormalised, the gallery side is not: a query that states no motion or direction
scores every image exactly as the expert alone does, and an image without a track (a still, a
crop from a moving camera) is neither helped nor penalised. As inner products, the fused vectors
go through the same exact or approximate top-k as any expert's.
"""

from __future__ import annotations

import numpy as np

from models.backends.attributes import DIRECTIONS, parse_text_attributes
from models.backends.slot_layout import SlotLayout


def _dim(layout: SlotLayout) -> int:
    return len(layout.text_slots["motion"]) + len(DIRECTIONS)


def text_track_vectors(texts: list[str], layout: SlotLayout) -> np.ndarray:
    """The motion and direction each text states, one-hot (zeros where it states none)."""
    motions = layout.text_slots["motion"]
    out = np.zeros((len(texts), _dim(layout)), np.float32)
    for i, text in enumerate(texts):
        attrs = parse_text_attributes(text, layout)
        for offset, slot in ((0, "motion"), (len(motions), "direction")):
            values = attrs.slots.get(slot)
            if values is not None:
                out[i, offset : offset + len(values)] = values
    return out


def image_track_vectors(facts: list[dict[str, list[str]]], layout: SlotLayout) -> np.ndarray:
    """The motion and direction each image's track measured (``motion_facts``' output), one-hot."""
    motions = layout.text_slots["motion"]
    out = np.zeros((len(facts), _dim(layout)), np.float32)
    for i, found in enumerate(facts):
        for value in found.get("motion", []):
            if value in motions:
                out[i, motions.index(value)] = 1.0
        for value in found.get("direction", []):
            if value in DIRECTIONS:
                out[i, len(motions) + DIRECTIONS.index(value)] = 1.0
    return out


def fuse_track_slots(query_vecs: np.ndarray, image_vecs: np.ndarray, texts: list[str],
                     facts: list[dict[str, list[str]]], layout: SlotLayout,
                     weight: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The expert's vectors with the track slots of ``layout`` (the expert's ``track_slots``)
    appended (see the module docstring)."""
    q = np.hstack([query_vecs.astype(np.float32), weight * text_track_vectors(texts, layout)])
    norms = np.linalg.norm(q, axis=1, keepdims=True)
    q = np.divide(q, norms, out=np.zeros_like(q), where=norms > 0)
    g = np.hstack([image_vecs.astype(np.float32), weight * image_track_vectors(facts, layout)])
    return q, g
