"""A benchmark's gallery, read one shard at a time: its item ids and domains (without pixels, for the
ranking), its items' pixels (for embedding: an image, or a clip's frames), its items' track facts
(for an expert with track slots) and encoded thumbnails (for the report)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from rde.common.image_decoding import decode_rgb
from rde.evaluation.tables import ShardedTable
from storage import Artifact

Item = np.ndarray | list[np.ndarray]  # an RGB image, or a clip's frames


class GallerySource(Protocol):
    size: int
    shards: int

    def ids_domains(self, index: int) -> tuple[list[str], list[str]]: ...

    def ids(self) -> list[str]: ...

    def items(self, index: int) -> list[Item]: ...

    def facts(self, ids: list[str]) -> list[dict[str, list[str]]] | None: ...

    def encoded(self, ids: Sequence[str]) -> dict[str, bytes]: ...


class ArtifactGallery:
    """A built benchmark's gallery table (``image_id``, ``domain``, ``image_bytes`` per row)."""

    def __init__(self, table: ShardedTable, facts: Callable[[list[str]], list[dict]] | None = None) -> None:
        self.table, self._facts = table, facts
        self._ids = [self.table.read_shard(i, ["image_id", "domain"]).to_pydict() for i in range(table.shards)]
        self.shards = table.shards
        self.size = sum(len(s["image_id"]) for s in self._ids)

    def ids_domains(self, index: int) -> tuple[list[str], list[str]]:
        return self._ids[index]["image_id"], self._ids[index]["domain"]

    def ids(self) -> list[str]:
        return [i for shard in self._ids for i in shard["image_id"]]

    def items(self, index: int) -> list[Item]:
        return [decode_rgb(b) for b in self.table.read_shard(index, ["image_bytes"]).column("image_bytes").to_pylist()]

    def facts(self, ids: list[str]) -> list[dict[str, list[str]]] | None:
        return self._facts(ids) if self._facts else None

    def encoded(self, ids: Sequence[str]) -> dict[str, bytes]:
        wanted, found = set(ids), {}
        for index in range(self.shards):
            if wanted & set(self._ids[index]["image_id"]):
                table = self.table.read_shard(index, ["image_id", "image_bytes"])
                found.update({i: b for i, b in zip(table.column("image_id").to_pylist(),
                                                   table.column("image_bytes").to_pylist(), strict=True)
                              if i in wanted})
        return found


class CheckSetGallery:
    """A check set's gallery: the pool's crops, already decoded by ``load_check_set``, in shards of
    ``shard_size``."""

    shard_size = 256

    def __init__(self, check: Any, facts: list[dict[str, list[str]]] | None) -> None:
        self.check, self._facts = check, facts
        self.size = len(check.gallery_ids)
        self.shards = max(1, -(-self.size // self.shard_size))
        self._position = {g: n for n, g in enumerate(check.gallery_ids)}

    def _span(self, index: int) -> range:
        return range(index * self.shard_size, min(self.size, (index + 1) * self.shard_size))

    def ids_domains(self, index: int) -> tuple[list[str], list[str]]:
        span = self._span(index)
        return [self.check.gallery_ids[j] for j in span], [self.check.gallery_domains[j] for j in span]

    def ids(self) -> list[str]:
        return list(self.check.gallery_ids)

    def items(self, index: int) -> list[Item]:
        return [self.check.gallery_images[j] for j in self._span(index)]

    def facts(self, ids: list[str]) -> list[dict[str, list[str]]] | None:
        return None if self._facts is None else [self._facts[self._position[i]] for i in ids]

    def encoded(self, ids: Sequence[str]) -> dict[str, bytes]:
        import cv2

        out = {}
        for i in ids:
            if i in self._position:
                ok, data = cv2.imencode(".jpg", self.check.gallery_images[self._position[i]][:, :, ::-1])
                if ok:
                    out[i] = data.tobytes()
        return out


class ClipGallery:
    """A clip set's clips (each its T frames), ``shard_size`` clips a shard; every clip's domain is
    ``clips``. A clip's thumbnail is its middle frame."""

    shard_size = 32

    def __init__(self, clips: Artifact, frames: Artifact, clip_ids: list[str]) -> None:
        self.frames = frames
        self.clip_ids = clip_ids
        wanted = set(clip_ids)
        self._frames = {r["clip_id"]: r["frame_indices"] for r in clips.rows(["clip_id", "frame_indices"])
                        if r["clip_id"] in wanted}
        self.size = len(clip_ids)
        self.shards = max(1, -(-self.size // self.shard_size))

    def ids_domains(self, index: int) -> tuple[list[str], list[str]]:
        ids = self.clip_ids[index * self.shard_size:(index + 1) * self.shard_size]
        return ids, ["clips"] * len(ids)

    def ids(self) -> list[str]:
        return list(self.clip_ids)

    def _decoded(self, indices: set[int]) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        for shard in range(len(self.frames.manifest().shards)):
            table = self.frames.read_matching(shard, "frame_index", indices, ["frame_index", "image_bytes"])
            out.update(zip(table.column("frame_index").to_pylist(), table.column("image_bytes").to_pylist(),
                           strict=True))
        return out

    def items(self, index: int) -> list[Item]:
        ids, _ = self.ids_domains(index)
        data = self._decoded({f for c in ids for f in self._frames[c]})
        return [[decode_rgb(data[f]) for f in self._frames[c]] for c in ids]

    def facts(self, ids: list[str]) -> list[dict[str, list[str]]] | None:
        return None

    def encoded(self, ids: Sequence[str]) -> dict[str, bytes]:
        middle = {c: self._frames[c][len(self._frames[c]) // 2] for c in ids if c in self._frames}
        data = self._decoded(set(middle.values()))
        return {c: data[f] for c, f in middle.items() if f in data}
