"""Items, frames and queries for the cached reranker, from either source:

- ``clips``: the bundled clip set (``rde build-demo-clips``): T frames per clip, its grounded
  captions as queries; split by time (``gap`` clips between train and test are rejected with
  reason ``split_gap`` so no test frame is trained on).
- ``largefine``: a ``build-largefine`` run's accepted images (T = 1) and captions; relevance by
  track identity; a seeded share of identities held out as the test split.

Every query is relevant to the items of its item's group (the clip itself; the identity's images).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from rde.common.caption_source import finished_captions
from rde.common.image_decoding import decode_rgb
from rde.common.seeds import draw_seed
from storage import Artifact
from storage.filesystem import join
from storage.locations import resolve_location


@dataclass
class ItemSet:
    """Items (each T frame keys), their queries, and a loader from frame key to RGB image."""

    item_ids: list[str]
    groups: list[str]
    splits: list[str]
    frames: list[list[str]]
    query_texts: list[str]
    query_items: list[int]
    load_frames: Callable[[Sequence[str]], dict[str, np.ndarray]]
    rejected: dict[str, int] = field(default_factory=dict)
    input_rows: int = 0

    @property
    def query_splits(self) -> list[str]:
        return [self.splits[i] for i in self.query_items]

    def frame_keys(self) -> list[str]:
        return sorted({k for f in self.frames for k in f})


def _clips(path: str) -> ItemSet:
    root = resolve_location(path)
    frames_art, clips_art = Artifact(join(root, "frames")), Artifact(join(root, "clips"))
    if not clips_art.is_complete() or not frames_art.is_complete():
        raise FileNotFoundError(f"no clip set at {root}: run `rde clips build` (needs vtest.avi) or point "
                                "vedje.clips_path at one")
    name = root.rstrip("/").split("/")[-1]
    rows = clips_art.rows()
    kept = [r for r in rows if r["split"] in ("train", "test")]
    items = ItemSet([r["clip_id"] for r in kept], [r["clip_id"] for r in kept], [r["split"] for r in kept],
                    [[f"{name}:{i}" for i in r["frame_indices"]] for r in kept], [], [], lambda keys: {},
                    {"split_gap": gap} if (gap := sum(r["split"] == "gap" for r in rows)) else {}, len(rows))
    for k, r in enumerate(kept):
        items.query_texts += r["captions"]
        items.query_items += [k] * len(r["captions"])

    def load(keys: Sequence[str]) -> dict[str, np.ndarray]:
        wanted = {int(k.rsplit(":", 1)[1]) for k in keys}
        return {f"{name}:{r['frame_index']}": decode_rgb(r["image_bytes"]) for r in frames_art.rows()
                if r["frame_index"] in wanted}

    items.load_frames = load
    return items


def _largefine(source_root: str, test_share: float, seed: int) -> ItemSet:
    captions = finished_captions(source_root, "train-vedje (vedje.source 'largefine')")
    identity = {r["image_id"]: r["identity"] for r in Artifact(join(source_root, "neighbours")).rows(
        ["image_id", "identity"])}
    caps = captions.rows(["image_id", "text"])
    ids = sorted({c["image_id"] for c in caps})
    groups = [identity.get(i) or i for i in ids]
    people = sorted(set(groups))
    rng = np.random.default_rng(seed)
    test = set(rng.choice(people, size=max(1, int(test_share * len(people))), replace=False).tolist())
    index = {i: k for k, i in enumerate(ids)}
    items = ItemSet(ids, groups, ["test" if g in test else "train" for g in groups], [[i] for i in ids],
                    [c["text"] for c in caps], [index[c["image_id"]] for c in caps], lambda keys: {},
                    input_rows=len(ids))

    def load(keys: Sequence[str]) -> dict[str, np.ndarray]:
        wanted = set(keys)
        return {r["image_id"]: decode_rgb(r["image_bytes"]) for _, tb in Artifact(join(source_root, "accepted"))
                .iter_shards(["image_id", "image_bytes"]) for r in tb.to_pylist() if r["image_id"] in wanted}

    items.load_frames = load
    return items


def clip_spans(path: str) -> dict[str, dict[str, float | int | None]]:
    """Each clip's first and last frame index, and their times in seconds when the clip set records
    the video's frame rate (``fps`` in its manifest config)."""
    clips = Artifact(join(resolve_location(path), "clips"))
    fps = clips.manifest().config.get("fps")
    spans: dict[str, dict[str, float | int | None]] = {}
    for r in clips.rows(["clip_id", "frame_indices"]):
        first, last = min(r["frame_indices"]), max(r["frame_indices"])
        spans[r["clip_id"]] = {"first_frame": first, "last_frame": last,
                               "start_s": round(first / fps, 3) if fps else None,
                               "end_s": round(last / fps, 3) if fps else None}
    return spans


def load_items(profile: Any, source_root: str | None = None) -> ItemSet:
    """The profile's VEDJE items, from its ``vedje`` section (``source_root``: where the source flow's
    artifacts are)."""
    v = profile.vedje
    if v.source == "clips":
        return _clips(v.clips_path)
    if source_root is None:
        raise ValueError("vedje.source 'largefine' needs the build-largefine run's artifact root")
    return _largefine(source_root, v.test_share, v.seed)


def negatives_for(query: int, ranked: np.ndarray, groups: Sequence[str], group: str, k: int, seed: int,
                  step: int) -> list[int]:
    """``k`` hard negatives for a query: items of other groups among its stage-1 ranking ``ranked``
    (best first), drawn without replacement, seeded by (seed, query, step)."""
    pool = [int(i) for i in ranked if groups[int(i)] != group]
    if len(pool) <= k:
        return pool
    rng = np.random.default_rng(draw_seed(seed, f"{query}:{step}"))
    return sorted(rng.choice(pool, size=k, replace=False).tolist(), key=pool.index)
