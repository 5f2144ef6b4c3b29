"""Streamed pairs as the trainer uses them: the step's ``Batch``, gathered from every rank, and the source.

``StreamedTraining`` is the trainer's source over ``rde.training.pair_stream``'s ``StreamedPairs``:
a DataLoader per epoch, the rank's parts gathered into the global batch
(``rde.training.distributed``), and the streamed pass that gives ŝ of every pair for the GMM refit,
keeping only the scalars; ``held_out_embeddings`` is the held-out pass for person search.
``LoaderClock`` times how long a training loop waits for its batches. Split from the stream itself
(the epoch order, the dataset its DataLoader workers read) so each is read on its own.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from rde.training.distributed import Ranks, gather_rows
from rde.training.pair_stream import PairIndex, Preprocess, StreamedPairs, steps_per_epoch, writable_rgb
from storage import Artifact


def unit(x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.normalize(x, dim=-1)


@dataclass
class Batch:
    """One step's batch as the loss sees it: ``pairs`` (pair ids), ``image_keys`` (equal for pairs of
    one image) and the unit teacher vectors are the **global** batch's, in rank order; ``images``,
    ``texts`` and ``other_images`` are this rank's model inputs."""

    pairs: torch.Tensor
    image_keys: torch.Tensor
    images: Any
    texts: Any
    other_images: Any = None
    teacher_images: torch.Tensor | None = None
    teacher_texts: torch.Tensor | None = None

    def to(self, device: torch.device) -> Batch:
        return Batch(**{k: to_device(v, device) for k, v in self.__dict__.items()})


def to_device(x: Any, device: torch.device) -> Any:
    """A tensor, or a dict of them (a tokenizer's output), on ``device``; anything else as it is."""
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=True)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def gathered_batch(local: dict[str, Any], ranks: Ranks | None, device: torch.device) -> Batch:
    """A rank's loaded part → the step's ``Batch`` on ``device``: ids and teacher vectors gathered
    from every rank (fixed inputs, no gradient), the model inputs kept local."""
    part = Batch(pairs=local["pairs"], image_keys=local["image_keys"], images=local["images"], texts=local["texts"],
                 other_images=local.get("other_images"), teacher_images=local["teacher_images"],
                 teacher_texts=local["teacher_texts"]).to(device)
    return replace(part, pairs=gather_rows(part.pairs, ranks), image_keys=gather_rows(part.image_keys, ranks),
                   teacher_images=unit(gather_rows(part.teacher_images, ranks)),
                   teacher_texts=unit(gather_rows(part.teacher_texts, ranks)))


@dataclass
class LoaderClock:
    """Time a training loop spent waiting for its next batch, and in all (the data stall share)."""

    waiting: float = 0.0
    total: float = 0.0
    batches: int = 0

    @property
    def stall_share(self) -> float:
        return self.waiting / self.total if self.total else 0.0

    def timed(self, items: Iterator[Any]) -> Iterator[Any]:
        """``items``, with the time spent getting each one, and the whole loop's, counted."""
        began = time.perf_counter()
        try:
            while True:
                asked = time.perf_counter()
                item = next(items, None)
                self.waiting += time.perf_counter() - asked
                if item is None:
                    return
                self.batches += 1
                yield item
        finally:
            self.total += time.perf_counter() - began


@dataclass
class StreamedTraining:
    """The trainer's source over streamed pairs (``rde.training.retrieval_training.train``):
    ``workers`` DataLoader workers, each with ``prefetch`` batches ahead."""

    dataset: StreamedPairs
    workers: int = 2
    prefetch: int = 2

    def __len__(self) -> int:
        return len(self.dataset.index)

    def for_model(self, model: Any) -> StreamedTraining:
        """This source with the student's own preprocessing."""
        return replace(self, dataset=replace(self.dataset, preprocess=Preprocess(model.pixel_values, model.tokens)))

    @property
    def q_txt(self) -> torch.Tensor:
        return torch.tensor(self.dataset.index.q_txt, dtype=torch.float32)

    def steps_per_epoch(self, batch_size: int) -> int:
        return steps_per_epoch(len(self), batch_size)

    def epoch_batches(self, epoch: int, start_position: int, cfg: Any, ranks: Ranks | None,
                      device: torch.device) -> Iterator[tuple[int, Batch]]:
        """(position after the batch, the batch on ``device``) of the epoch from ``start_position``
        (a multiple of the batch size): the stream's order for (``cfg.seed``, epoch), the ranks'
        parts gathered."""
        dataset = replace(self.dataset, ranks=ranks, batch_size=cfg.batch_size, seed=cfg.seed,
                          other_view=cfg.objective == "itc+iss").at(epoch, start_position // cfg.batch_size)
        # its own generator: making the iterator must not draw from the global RNG (the model's dropout)
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=self.workers,
                                             prefetch_factor=self.prefetch if self.workers else None,
                                             pin_memory=device.type == "cuda",
                                             generator=torch.Generator().manual_seed(0))
        for local in loader:
            yield min(len(self), (local["number"] + 1) * cfg.batch_size), gathered_batch(local, ranks, device)

    @torch.no_grad()
    def positive_cosines(self, model: Any, batch_size: int = 256) -> np.ndarray:
        """s of every pair (the uncropped image, or view 0), by pair id, in one streamed pass in
        shard order."""
        out = np.zeros(len(self), np.float32)
        index, pre = self.dataset.index, self.dataset.preprocess
        for part in _parts(index, ["pair"], batch_size):
            img = model.encode_image(_image_input(index, part, pre, _device_of(model)))
            txt = model.encode_text(_text_input(index, part, pre, _device_of(model)))
            out[np.asarray(part["pair"])] = (img * txt).sum(dim=1).float().cpu().numpy()
        return out


def _parts(index: PairIndex, columns: list[str], batch_size: int) -> Iterator[dict[str, list]]:
    """The split's rows in shard order, ``batch_size`` at a time, with ``columns`` and what the
    model's inputs are made of; one shard read at a time."""
    wanted = [*columns, *(("image_views", "text_vector") if index.features else ("image", "text"))]
    for position, shard in enumerate(index.shards):
        table = Artifact(index.url).read_shard(shard, list(dict.fromkeys(wanted))).take(pa.array(index.rows[position]))
        for start in range(0, table.num_rows, batch_size):
            yield table.slice(start, batch_size).to_pydict()


def _image_input(index: PairIndex, part: dict[str, list], pre: Preprocess | None, device: torch.device,
                 rows: list[int] | None = None) -> Any:
    """The model's input for these rows' images as they are (no crop; view 0 of cached features)."""
    rows = list(range(len(part["pair"]))) if rows is None else rows
    if index.features:
        return torch.tensor(np.asarray([part["image_views"][k][0] for k in rows], np.float32), device=device)
    return to_device(pre.pixel_values([writable_rgb(part["image"][k]) for k in rows]), device)


def _text_input(index: PairIndex, part: dict[str, list], pre: Preprocess | None, device: torch.device) -> Any:
    if index.features:
        return torch.tensor(np.asarray(part["text_vector"], np.float32), device=device)
    return to_device(pre.tokens(part["text"]), device)


def _device_of(model: Any) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def held_out_embeddings(model: Any, index: PairIndex, preprocess: Preprocess | None,
                        batch_size: int = 256) -> tuple[np.ndarray, list, np.ndarray, list] | None:
    """The held-out pairs for person search, in one streamed pass: every caption's text vector and
    identity, and one vector per image (the gallery, by image id) with its identity; None if no pair
    is held out. Holds vectors, not images."""
    if not len(index):
        return None
    device = _device_of(model)
    texts, text_ids, gallery, gallery_ids = [], [], {}, {}
    for part in _parts(index, ["pair", "image_id", "identity"], batch_size):
        texts.append(model.encode_text(_text_input(index, part, preprocess, device)).float().cpu().numpy())
        text_ids += part["identity"]
        firsts: dict[str, int] = {}  # the rows of images not embedded yet, one an image
        for k, i in enumerate(part["image_id"]):
            if i not in gallery:
                firsts.setdefault(i, k)
        new = list(firsts.values())
        if new:
            vectors = model.encode_image(_image_input(index, part, preprocess, device, new)).float().cpu().numpy()
            for k, v in zip(new, vectors, strict=True):
                gallery[part["image_id"][k]], gallery_ids[part["image_id"][k]] = v, part["identity"][k]
    ordered = sorted(gallery)
    return (np.concatenate(texts), text_ids, np.stack([gallery[i] for i in ordered]),
            [gallery_ids[i] for i in ordered])
