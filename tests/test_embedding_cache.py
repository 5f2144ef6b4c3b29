"""Embeddings are cached by (model, preprocessing, image hash): a rerun never re-embeds."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from rde.common.embedding_cache import CachedVectors, EmbeddingCache


class CountingEmbedder:
    """A deterministic embedder that counts the images it is asked to embed."""

    def __init__(self, preprocessing: str = "p1", dim: int = 4) -> None:
        self.model_id, self.preprocessing, self.dim = "counting", preprocessing, dim
        self.calls = 0

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        self.calls += len(images)
        return np.stack([np.full(self.dim, float(im.mean()), np.float32) for im in images])


def _images(values: list[int]) -> list[np.ndarray]:
    return [np.full((2, 2, 3), v, np.uint8) for v in values]


def test_second_run_embeds_nothing_and_new_images_only_once(tmp_path: Path) -> None:
    images = _images([1, 2, 3])
    ids = ["a", "b", "c"]
    emb = CountingEmbedder()
    first = EmbeddingCache(str(tmp_path), emb).embed(ids, lambda pos: [images[p] for p in pos])
    assert emb.calls == 3 and first[:, 0].tolist() == [1, 2, 3]
    again = EmbeddingCache(str(tmp_path), emb).embed(ids, lambda pos: [images[p] for p in pos])
    assert emb.calls == 3 and np.array_equal(first, again)
    more = _images([1, 9, 9])
    mixed = EmbeddingCache(str(tmp_path), emb).embed(["a", "d", "d"], lambda pos: [more[p] for p in pos])
    assert emb.calls == 4 and mixed[:, 0].tolist() == [1, 9, 9]  # 'd' twice in the batch: embedded once


def test_other_preprocessing_is_another_cache(tmp_path: Path) -> None:
    images = _images([5])
    a, b = CountingEmbedder("p1"), CountingEmbedder("p2")
    EmbeddingCache(str(tmp_path), a).embed(["x"], lambda pos: images)
    EmbeddingCache(str(tmp_path), b).embed(["x"], lambda pos: images)
    assert a.calls == 1 and b.calls == 1
    assert EmbeddingCache(str(tmp_path), a).url != EmbeddingCache(str(tmp_path), b).url


class CountingExpert:
    """A text-image expert whose image side counts the images it encodes."""

    model_id, preprocessing, dim = "counting-expert", "p1", 3

    def __init__(self) -> None:
        self.calls = 0

    def encode_text(self, texts: list[str]) -> np.ndarray:
        return np.ones((len(texts), self.dim), np.float32)

    def encode_image(self, images: list[np.ndarray]) -> np.ndarray:
        self.calls += len(images)
        return np.stack([np.full(self.dim, float(im.mean()), np.float32) for im in images])


def test_an_experts_image_side_is_cached_per_lineage(tmp_path: Path) -> None:
    from rde.common.embedding_cache import ExpertImages

    images, ids = _images([4, 5]), ["a", "b"]
    expert = CountingExpert()
    lineage = {"backend": "attributes", "parts": {"detector": {"score_threshold": 0.5}}}
    load = lambda pos: [images[p] for p in pos]  # noqa: E731
    first = EmbeddingCache(str(tmp_path), ExpertImages(expert, lineage)).embed(ids, load)
    again = EmbeddingCache(str(tmp_path), ExpertImages(expert, lineage))
    assert np.array_equal(again.embed(ids, load), first)
    assert expert.calls == 2 and again.embedded == 0 and first[:, 0].tolist() == [4, 5]
    # another detector threshold is another cache: the expert encodes again
    stricter = {**lineage, "parts": {"detector": {"score_threshold": 0.7}}}
    other = EmbeddingCache(str(tmp_path), ExpertImages(expert, stricter))
    other.embed(ids, load)
    assert other.url != again.url and other.embedded == 2 and expert.calls == 4
    # an image embedder's identity (no lineage) is what it was: the CGDS cache keeps its key
    assert "lineage" not in EmbeddingCache(str(tmp_path), CountingEmbedder()).identity


def _append_many(root: str, start: int, count: int) -> None:
    """Child process: embed ``count`` new ids one at a time (one append each) into the shared cache."""
    cache = EmbeddingCache(root, CountingEmbedder())
    for k in range(start, start + count):
        cache.embed([f"id-{k}"], lambda pos, k=k: _images([k % 250]))


def test_processes_appending_to_one_cache_lose_nothing(tmp_path: Path) -> None:
    """Three processes append 12 images each, one append at a time, to one cache: every image is
    in it afterwards and the manifest lists every shard once (without the folder lock, appends
    that read the same manifest write the same shard index and one of them is lost)."""
    import multiprocessing

    from storage import Artifact

    ctx = multiprocessing.get_context("spawn")  # not fork: the suite's worker has threads
    workers = [ctx.Process(target=_append_many, args=(str(tmp_path), 100 * w, 12)) for w in range(3)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    assert all(w.exitcode == 0 for w in workers)
    cache = EmbeddingCache(str(tmp_path), CountingEmbedder())
    wanted = [f"id-{100 * w + k}" for w in range(3) for k in range(12)]
    assert set(cache.lookup(wanted)) == set(wanted)
    shards = Artifact(cache.url).manifest().shards
    assert [s.index for s in shards] == list(range(36))


def test_cached_vectors_read_the_rows_asked_for_in_their_order(tmp_path: Path) -> None:
    """``locate`` finds ids by the cache's ``image_id`` column; ``CachedVectors.take`` reads rows
    across cache shards and read batches in the order asked (repeats too), and an id cached twice
    is its last copy, as ``lookup`` gives it; ``blocks`` cuts where the source shard changes."""
    emb = CountingEmbedder()
    cache = EmbeddingCache(str(tmp_path), emb)
    ids = [f"i{v}" for v in range(20)]
    for at in range(0, 20, 7):  # three appends: three cache shards
        cache.embed(ids[at:at + 7], lambda pos, at=at: _images([at + p for p in pos]))
    cache._append(["i3"], np.full((1, 4), 99.0, np.float32))  # a later copy of i3 (two writers raced)
    located = cache.locate([*ids, "absent"])
    assert set(located) == set(ids) and located["i3"] == (3, 0) and located["i19"] == (2, 5)
    vectors = CachedVectors(cache.url, 4, np.array([located[i] for i in ids]), np.repeat([0, 1], 10))
    vectors.read_batch = 3  # several batches per cache shard
    order = [19, 0, 7, 7, 3, 13, 6]
    got = vectors.take(order)
    by_lookup = cache.lookup(ids)
    assert np.array_equal(got, np.stack([by_lookup[ids[i]] for i in order]))
    assert got[:, 0].tolist() == [19, 0, 7, 7, 99, 13, 6] and vectors.take([]).shape == (0, 4)
    assert [len(b) for b in vectors.blocks(np.arange(20))] == [10, 10]
    assert [b[:, 0].tolist() for b in vectors.blocks([8, 9, 10])] == [[8, 9], [10]]
    assert emb.calls == 20 and len(vectors) == 20
