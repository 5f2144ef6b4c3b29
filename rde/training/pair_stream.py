"""Streamed training pairs for a CLIP-like student: memory bounded by a shuffle window and a batch,
never by the number of pairs.

The pairs are an artifact of shards (``storage.schemas.TRAINING_PAIRS``): a row is one caption with
its image's encoded bytes and the teacher's image and text vectors. An epoch's order is made from
the shards' row counts alone (``epoch_order``): the shards in a seeded permutation, cut into windows
of ``window`` consecutive pairs, each window shuffled. Global batch ``b`` is positions
``[b·B, (b+1)·B)`` of that order, so the order depends on the seed and the epoch only: not on the
number of DataLoader workers, the number of ranks, or where a resumed run starts.

``StreamedPairs`` is the ``IterableDataset``: DataLoader worker ``w`` of ``W`` takes every ``W``-th
batch from the start batch on (the DataLoader hands them out in that round-robin order), reads the
rows of this rank's part of each (the shards the window touches cached), decodes them, draws the random
resized crop (SAFT's scale and ratio ranges, seeded by pair and epoch, so a resumed run redraws the
same crop) and runs the student's own preprocessing.

What the trainer does with these batches (``StreamedTraining``: the DataLoader per epoch, the
ranks' parts gathered into the global batch, the streamed passes over every pair) is
``rde.training.pair_batches``: this module is the stream, that one its use in a training step.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rde.common.image_decoding import decode_rgb
from rde.common.seeds import draw_seed
from rde.training.distributed import Ranks, local_part
from rde.training.retrieval_features import random_resized_crop
from storage import Artifact

IMAGE_COLUMNS = ("pair", "image_key", "image", "text", "teacher_image", "teacher_text")
FEATURE_COLUMNS = ("pair", "image_key", "image_views", "text_vector", "teacher_image", "teacher_text")
FEATURE_PAIRS_KIND = "training_feature_pairs"  # the CPU model's cached features (else images)


@dataclass(frozen=True)
class PairIndex:
    """Where the pairs of one split are: per shard (manifest order) the artifact's shard index, the
    rows of the split; ``q_txt`` by pair id (NaN: none). Built from three small columns, checking
    that the split's pair ids are 0..P-1 each once; kept: two numbers a pair, no text, no pixels.
    ``features``: the rows hold the CPU model's cached tower features (``TRAINING_FEATURE_PAIRS``),
    not images (``TRAINING_PAIRS``)."""

    url: str
    shards: tuple[int, ...]
    rows: tuple[np.ndarray, ...]
    q_txt: np.ndarray
    features: bool = False

    @classmethod
    def scan(cls, url: str, split: str = "train") -> PairIndex:
        shards, rows, pairs, q = [], [], [], []  # pair ids: only to check them
        for index, table in Artifact(url).iter_shards(["split", "pair", "q_txt"]):
            mask = np.asarray(table.column("split").to_pylist()) == split
            if not mask.any():
                continue
            shards.append(index)
            rows.append(np.flatnonzero(mask))
            pairs.append(table.column("pair").to_numpy()[mask].astype(np.int64))
            q.append(table.column("q_txt").to_numpy(zero_copy_only=False)[mask].astype(np.float64))
        ids = np.concatenate(pairs) if pairs else np.zeros(0, np.int64)
        if len(ids) and not np.array_equal(np.sort(ids), np.arange(len(ids))):
            raise ValueError(f"{url}: the {split} pairs' ids are not 0..{len(ids) - 1} each once")
        q_txt = np.full(len(ids), np.nan)
        if len(ids):
            q_txt[ids] = np.concatenate(q)
        features = Artifact(url).manifest().kind == FEATURE_PAIRS_KIND
        return cls(url, tuple(shards), tuple(rows), q_txt, features)

    @property
    def columns(self) -> tuple[str, ...]:
        return FEATURE_COLUMNS if self.features else IMAGE_COLUMNS

    def __len__(self) -> int:
        return len(self.q_txt)

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rows]


def epoch_order(lengths: Sequence[int], seed: int, epoch: int, window: int) -> Iterator[np.ndarray]:
    """The epoch's order as arrays of (shard position, row position) slots, window by window: shards
    in a permutation seeded by (seed, epoch), concatenated, cut into windows of ``window`` slots,
    each window permuted. Holds one window."""
    rng = np.random.default_rng([seed, epoch])
    buffered: list[np.ndarray] = []
    count = 0
    for s in rng.permutation(len(lengths)):
        buffered.append(np.stack([np.full(lengths[s], s), np.arange(lengths[s])], axis=1))
        count += lengths[s]
        while count >= window:
            slots = np.concatenate(buffered)
            yield slots[:window][rng.permutation(window)]
            rest = slots[window:]
            buffered, count = [rest], len(rest)
    if count:
        slots = np.concatenate(buffered)
        yield slots[rng.permutation(len(slots))]


def global_batches(order: Iterator[np.ndarray], batch_size: int) -> Iterator[np.ndarray]:
    """Consecutive ``batch_size`` slots of the order, across window ends; a last batch of one pair
    is dropped (it has no in-batch negative, as in the in-memory trainer)."""
    pending = np.zeros((0, 2), np.int64)
    for part in order:
        pending = np.concatenate([pending, part])
        while len(pending) >= batch_size:
            yield pending[:batch_size]
            pending = pending[batch_size:]
    if len(pending) >= 2:
        yield pending


def steps_per_epoch(pairs: int, batch_size: int) -> int:
    """Batches of at least two pairs in an epoch of ``pairs``."""
    return pairs // batch_size + (pairs % batch_size >= 2)


@dataclass(frozen=True)
class Preprocess:
    """The student's own input preparation, run in the DataLoader's workers."""

    pixel_values: Callable[[list[np.ndarray]], Any]
    tokens: Callable[[list[str]], Any]


@dataclass
class StreamedPairs(torch.utils.data.IterableDataset):
    """One epoch's batches of this rank from ``start_batch`` on, as dicts of tensors (module docstring)."""

    index: PairIndex
    batch_size: int
    window: int
    seed: int
    preprocess: Preprocess
    other_view: bool = False  # a second crop of each image (ISS)
    ranks: Ranks | None = None
    epoch: int = 0
    start_batch: int = 0
    _cache: OrderedDict = field(default_factory=OrderedDict, repr=False)

    def __post_init__(self) -> None:
        super().__init__()

    @property
    def cached_shards(self) -> int:
        """Shards kept read: as many as a window and a batch can touch (the window's pairs may start
        in the last row of one shard and end in the first of another), so a shard is read once a
        window; memory is about a window of rows and two shards more."""
        shortest = min(self.index.lengths, default=1)
        return 2 + -(-(self.window + self.batch_size) // max(1, shortest))

    def at(self, epoch: int, start_batch: int) -> StreamedPairs:
        return replace(self, epoch=epoch, start_batch=start_batch, _cache=OrderedDict())

    def batch_slots(self) -> Iterator[tuple[int, np.ndarray]]:
        """(global batch number, its slots) of the epoch, every batch."""
        yield from enumerate(global_batches(epoch_order(self.index.lengths, self.seed, self.epoch, self.window),
                                            self.batch_size))

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        if info is not None:
            os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a forked tokenizer must not start threads
            torch.set_num_threads(1)
        for b, slots in self.batch_slots():
            if b >= self.start_batch and (b - self.start_batch) % workers == worker:
                yield self.load(b, local_part(torch.as_tensor(slots), self.ranks).numpy())

    def _shard(self, position: int) -> pa.Table:
        if position not in self._cache:
            self._cache[position] = Artifact(self.index.url).read_shard(self.index.shards[position],
                                                                        list(self.index.columns))
            while len(self._cache) > self.cached_shards:
                self._cache.popitem(last=False)
        self._cache.move_to_end(position)
        return self._cache[position]

    def rows(self, slots: np.ndarray) -> dict[str, list]:
        """The loaded columns of these slots, in slot order: one ``take`` per shard they touch."""
        out: dict[str, list] = {c: [None] * len(slots) for c in self.index.columns}
        for s in np.unique(slots[:, 0]):
            at = np.flatnonzero(slots[:, 0] == s)
            part = self._shard(int(s)).take(pa.array(self.index.rows[s][slots[at, 1]])).to_pydict()
            for c in self.index.columns:
                for k, value in zip(at.tolist(), part[c], strict=True):
                    out[c][k] = value
        return out

    def load(self, number: int, slots: np.ndarray) -> dict[str, Any]:
        """Batch ``number``'s part of this rank: images decoded, cropped and preprocessed, or the
        cached features of one seeded view per pair."""
        r = self.rows(slots)
        out = {"number": number, "pairs": torch.tensor(r["pair"], dtype=torch.long),
               "image_keys": torch.tensor(r["image_key"], dtype=torch.long),
               "teacher_images": torch.tensor(np.asarray(r["teacher_image"], np.float32)),
               "teacher_texts": torch.tensor(np.asarray(r["teacher_text"], np.float32))}
        if self.index.features:
            chosen = [draw_seed(self.seed, f"{p}#epoch{self.epoch}#view") % len(v)
                      for p, v in zip(r["pair"], r["image_views"], strict=True)]
            out["images"] = torch.tensor(np.asarray([v[c] for v, c in zip(r["image_views"], chosen, strict=True)],
                                                    np.float32))
            out["texts"] = torch.tensor(np.asarray(r["text_vector"], np.float32))
            if self.other_view:
                out["other_images"] = torch.tensor(np.asarray(
                    [v[(c + 1) % len(v)] for v, c in zip(r["image_views"], chosen, strict=True)], np.float32))
            return out
        images = [writable_rgb(b) for b in r["image"]]
        out["images"] = self.preprocess.pixel_values([
            random_resized_crop(im, np.random.default_rng(draw_seed(self.seed, f"{p}#epoch{self.epoch}")))
            for im, p in zip(images, r["pair"], strict=True)])
        out["texts"] = self.preprocess.tokens(r["text"])
        if self.other_view:
            out["other_images"] = self.preprocess.pixel_values([
                random_resized_crop(im, np.random.default_rng(draw_seed(self.seed, f"{p}#epoch{self.epoch}#other")))
                for im, p in zip(images, r["pair"], strict=True)])
        return out


def writable_rgb(data: bytes) -> np.ndarray:
    """Decoded, as a writable array (the preprocessing hands it to torch, which wants one)."""
    return np.require(decode_rgb(data), requirements="W")
