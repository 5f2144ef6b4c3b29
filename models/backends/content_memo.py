"""Per-image results kept for the next caller in the process that asks about the same pixels.

Several backends run the same network on the same images within one stage: the semantic-bridge
expert's class probabilities and the image embedder's pooled embedding are one EfficientNet
forward; the bridge and the attribute expert both run the detector on the unaugmented image; the
VEDJE feature maps and stage-1 embeddings share a forward too. A ``ContentMemo`` keyed by a digest
of the pixels (not by object identity, which Python reuses) lets the second caller skip the work.
It is bounded by a number of items (least recently used go first), so memory does not grow with
the dataset, and shared by every instance of one model in the process.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Generic, TypeVar

import numpy as np

V = TypeVar("V")


def image_digest(image: np.ndarray) -> bytes:
    """A 128-bit digest of an image's shape, dtype and pixels (equal pixels ⇔ equal digest)."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{image.shape}|{image.dtype}".encode())
    h.update(np.ascontiguousarray(image).data)
    return h.digest()


class ContentMemo(Generic[V]):
    """A thread-safe LRU map from (namespace, image digest) to one result, at most ``capacity`` items."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(0, int(capacity))
        self._items: OrderedDict[tuple[Hashable, bytes], V] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._items)

    def get_or_compute(self, namespace: Hashable, images: Sequence[np.ndarray],
                       compute: Callable[[list[np.ndarray]], Sequence[V]]) -> list[V]:
        """One result per image: remembered ones as they are, the rest from one ``compute`` call on
        the distinct missing images (in their order), then remembered."""
        keys = [(namespace, image_digest(im)) for im in images]
        found: dict[tuple[Hashable, bytes], V] = {}
        with self._lock:
            for key in keys:
                if key in self._items and key not in found:
                    self._items.move_to_end(key)
                    found[key] = self._items[key]
        missing: dict[tuple[Hashable, bytes], int] = {}
        for i, key in enumerate(keys):
            if key not in found and key not in missing:
                missing[key] = i
        if missing:
            computed = list(compute([images[i] for i in missing.values()]))
            if len(computed) != len(missing):
                raise ValueError(f"compute returned {len(computed)} results for {len(missing)} images")
            found.update(zip(missing, computed, strict=True))
            self._store((key, found[key]) for key in missing)
        with self._lock:
            self.hits += len(keys) - len(missing)
            self.misses += len(missing)
        return [found[key] for key in keys]

    def remember(self, namespace: Hashable, images: Sequence[np.ndarray], values: Sequence[V]) -> None:
        """Keep results computed elsewhere (e.g. pooled rows of feature maps) for later callers."""
        if len(images) != len(values):
            raise ValueError(f"{len(values)} results for {len(images)} images")
        self._store(((namespace, image_digest(image)), value) for image, value in zip(images, values, strict=True))

    def _store(self, pairs: Iterable[tuple[tuple[Hashable, bytes], V]]) -> None:
        """Keep these (key, result) pairs as the most recent, then drop the least recent over capacity."""
        # a value that is a view (a row of a batch's array) would keep its whole base alive for as long
        # as it is remembered: measured, 200 KB per remembered EfficientNet row instead of 5 KB, so a
        # 10k-image CGDS pass grew by 1.4 GB; kept as a copy that owns only its own data
        pairs = [(key, value.copy() if isinstance(value, np.ndarray) and value.base is not None else value)
                 for key, value in pairs]  # digests computed outside the lock
        with self._lock:
            for key, value in pairs:
                self._items[key] = value
                self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self.hits = self.misses = 0


_memos: dict[str, ContentMemo] = {}
_memos_lock = threading.Lock()


def shared_memo(name: str, capacity: int) -> ContentMemo:
    """The process-wide memo called ``name`` (created on first use with ``capacity``; a later larger
    capacity grows it), so every instance of one model shares its results. Capacity 0: a private
    memo that keeps nothing (memoisation off)."""
    if capacity <= 0:
        return ContentMemo(0)
    with _memos_lock:
        memo = _memos.get(name)
        if memo is None:
            memo = _memos[name] = ContentMemo(capacity)
        memo.capacity = max(memo.capacity, int(capacity))
        return memo


def clear_all() -> None:
    """Empty every shared memo (tests; benchmarks timing a stage's first pass over its images)."""
    with _memos_lock:
        memos = list(_memos.values())
    for memo in memos:
        memo.clear()
