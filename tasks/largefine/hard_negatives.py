"""The hard-negatives stage: each chosen image's top-k neighbours and hard negative (GTR+ Eq. 1) and
generator, per shard of ``chosen_images``, over ``rde.largefine.hard_negatives``."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import ClassVar

import numpy as np
import pyarrow as pa

from rde.common.seeds import draw_seed
from rde.common.topk import uses_index
from rde.largefine.hard_negatives import Neighbours, hard_negative_neighbours_of, vectors_at
from rde.largefine.tiered_captions import assign_generator
from storage.schemas import NEIGHBOURS
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write


class HardNegatives(Stage):
    """Per shard of ``chosen_images``: each image's top-k neighbours among all chosen images (their
    vectors read from ``image_vectors`` on demand) and its hard negative drawn from them (GTR+
    Eq. 1), and its generator. A per-shard CPU stage, so with ``prefect.fanout.cpu_deployment`` its
    shards run on the cpu pool's workers and the parent does none of the search.

    Exact search (up to ``largefine.neighbour_index_above`` images) is done per search block: the
    shards whose rows fill one query batch (``query_batch`` rows) are searched together in one pass
    over the gallery, computed once per process by the first of its shards to run and kept for the
    others (a shard-range run of ``query_batch / shard_size`` shards makes one pass). The neighbours
    and scores are the same bits as one search over the whole pool, whichever block, batch or
    worker computes them. Above the threshold the IVF index is built over all N vectors in one
    process, as one block: the stage then does not fan out (:meth:`fans_out`)."""

    name = "hard-negatives"
    # 3: exact scores the same on any CPU and for any query batch (rde.common.topk); 4: the vectors come
    # from embed-images (fanned out), not from the embedding cache; 5: per shard of select-images' chosen
    # images, searched in blocks
    version = "5"
    reads = ("chosen_images", "image_vectors")
    writes = (Write("neighbours", "neighbours", NEIGHBOURS),)
    config = ("largefine.neighbours_k", "largefine.seed", "largefine.neighbour_index_above",
              "largefine.neighbour_ann")
    balance = True
    row_unit = "images"
    # images whose neighbours are searched together in the exact search (4096 × 1280 floats: 21 MB),
    # one pass over the vectors per block; not a profile field, because a field in ``config`` enters
    # the stage key, which every shard records, and would rewrite identical neighbours
    query_batch: ClassVar[int] = 4096
    # search blocks kept per process (their neighbours: a few MB each); two threads of one run each on a block
    kept_blocks: ClassVar[int] = 4

    def __init__(self) -> None:
        # (stage key and input, first shard) -> the block's neighbours and its hard negatives' shards
        self._blocks: OrderedDict[tuple[str, int], tuple[list[Neighbours], dict[str, int]]] = OrderedDict()
        self._locks: dict[tuple[str, int], threading.Lock] = {}
        self._guard = threading.Lock()

    def __getstate__(self) -> dict:  # a Dask worker gets the stage without its blocks and locks
        return {}

    def __setstate__(self, state: dict) -> None:
        self.__init__()

    def lineage(self, run: StageRun) -> Lineage:
        if not run.models.generators:
            raise ValueError("build-largefine: the profile names no models.generators to caption with")
        # the generator count decides each image's generator (assign_generator)
        return Lineage(models={"generators": [g.model_dump(mode="json") for g in run.models.generators]})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("chosen_images").manifest().shards)

    def fans_out(self, run: StageRun) -> bool:
        """Exact search fans out; the IVF index over the whole pool is built in one process."""
        return not self._one_block(run, sum(s.rows for s in run.input("chosen_images").manifest().shards))

    @staticmethod
    def _one_block(run: StageRun, n: int) -> bool:
        """Whether ``n`` chosen images are searched through the IVF index (``uses_index``): one
        search block, the whole pool, in one process."""
        lf = run.section("largefine")
        return uses_index(n, n, lf.neighbour_index_above, lf.neighbour_ann)

    def process(self, run: StageRun, index: int) -> Work:
        """Shard ``index``'s rows of its search block's neighbours (:meth:`block`)."""
        lf = run.section("largefine")
        chosen = run.input("chosen_images")
        sizes = [s.rows for s in chosen.manifest().shards]
        first, found, shard_of = self.block(run, index, sizes)
        start = sum(sizes[:index]) - sum(sizes[:first])
        mine = found[start:start + sizes[index]]
        rows = chosen.read_shard(index, ["image_id", "source", "domain", "identity", "accepted_shard"]).to_pylist()
        n_gen = len(run.models.generators)
        out = [{**r, "neighbour_ids": nb.neighbour_ids, "neighbour_scores": nb.scores,
                "hard_negative_id": nb.hard_negative_id,
                "hard_negative_shard": shard_of.get(nb.hard_negative_id) if nb.hard_negative_id else None,
                "generator_index": assign_generator(lf.seed, r["image_id"], n_gen),
                "seed": draw_seed(lf.seed, r["image_id"])}
               for r, nb in zip(rows, mine, strict=True)]
        return Work([{"neighbours": pa.Table.from_pylist(out, schema=NEIGHBOURS)}],
                    {"input_rows": len(rows), "accepted": len(rows), "rejected": {},
                     "without_hard_negative": sum(nb.hard_negative_id is None for nb in mine)})

    def block(self, run: StageRun, index: int, sizes: list[int]) -> tuple[int, list[Neighbours], dict[str, int]]:
        """The search block holding shard ``index``: its first shard, its rows' neighbours and the
        accepted shard of each of their hard negatives; computed here or by an earlier shard of the
        block in this process."""
        if self._one_block(run, sum(sizes)):
            first, last = 0, len(sizes) - 1
        else:
            per = max(1, self.query_batch // max(1, max(sizes)))
            first = index // per * per
            last = min(len(sizes), first + per) - 1
        name = (f"{run.key}:{run.input('chosen_images').url}", first)
        with self._guard:
            lock = self._locks.setdefault(name, threading.Lock())
        with lock:
            if name not in self._blocks:
                self._blocks[name] = self._search(run, sizes, first, last)
                while len(self._blocks) > self.kept_blocks:
                    old, _ = self._blocks.popitem(last=False)
                    self._locks.pop(old, None)
            return (first, *self._blocks[name])

    def _search(self, run: StageRun, sizes: list[int], first: int, last: int
                ) -> tuple[list[Neighbours], dict[str, int]]:
        """Shards ``first``..``last``'s neighbours among every chosen image, and the accepted shard of
        each hard negative drawn (the tiers read its image from there)."""
        lf = run.section("largefine")
        table = pa.concat_tables(t for _, t in run.input("chosen_images").iter_shards(
            ["image_id", "accepted_shard", "vector_row"]))
        accepted_shard = table.column("accepted_shard").to_numpy()
        places = np.stack([accepted_shard, table.column("vector_row").to_numpy()], axis=1).astype(np.int64)
        vectors = vectors_at(run.input("image_vectors"), places)
        ids = table.column("image_id").to_pylist()
        rows = np.arange(sum(sizes[:first]), sum(sizes[:last + 1]), dtype=np.int64)
        found = hard_negative_neighbours_of(rows, vectors.take, vectors.blocks, ids, lf.neighbours_k, lf.seed,
                                            lf.neighbour_index_above, lf.neighbour_ann)
        wanted = {nb.hard_negative_id for nb in found if nb.hard_negative_id}
        # an image chosen twice (two rows of one id) is read from its last row's shard
        shard_of = {i: int(s) for i, s in zip(ids, accepted_shard, strict=True) if i in wanted}
        return found, shard_of

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(log=f"hard-negatives: top-{run.section('largefine').neighbours_k} neighbours of "
                          f"{result.accepted} images, {stats.get('without_hard_negative', 0)} without a hard negative")
