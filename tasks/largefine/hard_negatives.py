"""The hard-negatives stage: the images to caption, their top-k neighbours and hard negative
(GTR+ Eq. 1) and generator, over ``rde.largefine.hard_negatives``."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import pyarrow as pa

from rde.common.seeds import draw_seed
from rde.largefine.hard_negatives import chosen_vectors, hard_negative_neighbours_streamed
from rde.largefine.selection import select_rows
from rde.largefine.tiered_captions import assign_generator
from storage.schemas import NEIGHBOURS, REJECTS
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Stage, StageRun, Work, Write


class HardNegatives(Stage):
    """Choose the images to caption (profile domains, optional seeded cap), read their vectors
    (``embed-images``), find each one's top-k neighbours and draw its hard negative (GTR+ Eq. 1),
    assign a generator; written in shards of ``largefine.shard_size``."""

    name = "hard-negatives"
    # 3: exact scores the same on any CPU and for any query batch (rde.common.topk); 4: the vectors come
    # from embed-images (fanned out), not from the embedding cache
    version = "4"
    reads = ("accepted", "image_vectors")
    writes = (Write("neighbours", "neighbours", NEIGHBOURS),
              Write("select_rejects", "rejects", REJECTS, rejects=True))
    config = ("largefine.domains", "largefine.max_images", "largefine.neighbours_k", "largefine.seed",
              "largefine.shard_size", "largefine.neighbour_index_above", "largefine.neighbour_ann")
    balance = True
    # images whose neighbours are searched together in the exact search (4096 × 1280 floats: 21 MB),
    # one pass over the vectors per batch; not a profile field, because a field in ``config`` enters
    # the stage key, which every shard records, and would rewrite identical neighbours
    query_batch: ClassVar[int] = 4096

    def lineage(self, run: StageRun) -> Lineage:
        if not run.models.generators:
            raise ValueError("build-largefine: the profile names no models.generators to caption with")
        # the generator count decides each image's generator (assign_generator)
        return Lineage(models={"generators": [g.model_dump(mode="json") for g in run.models.generators]})

    def run(self, run: StageRun) -> Work:
        """Select, then search the chosen rows' neighbours with their vectors left in ``image_vectors``
        (``hard_negative_neighbours_streamed``): a query batch and one pool shard of vectors in memory
        where the search is exact; all of them only above ``neighbour_index_above``, where the IVF
        index is built over the whole pool."""
        lf = run.section("largefine")
        accepted = run.input("accepted")
        rows = [dict(r, accepted_shard=index) for index, table in
                accepted.iter_shards(["image_id", "source", "domain", "identity"]) for r in table.to_pylist()]
        positions, rejects = select_rows(rows, lf.domains, lf.max_images, lf.seed)
        chosen = [rows[p] for p in positions]
        vectors = chosen_vectors(run.input("image_vectors"), rows, positions, set(lf.domains))
        found = hard_negative_neighbours_streamed(vectors.take, vectors.blocks, [r["image_id"] for r in chosen],
                                                  lf.neighbours_k, lf.seed, lf.neighbour_index_above,
                                                  lf.neighbour_ann, self.query_batch)
        shard_of = {r["image_id"]: r["accepted_shard"] for r in chosen}
        n_gen = len(run.models.generators)
        out_rows = [{**{k: r[k] for k in ("image_id", "source", "domain", "identity", "accepted_shard")},
                     "neighbour_ids": nb.neighbour_ids, "neighbour_scores": nb.scores,
                     "hard_negative_id": nb.hard_negative_id,
                     "hard_negative_shard": shard_of.get(nb.hard_negative_id) if nb.hard_negative_id else None,
                     "generator_index": assign_generator(lf.seed, r["image_id"], n_gen),
                     "seed": draw_seed(lf.seed, r["image_id"])}
                    for r, nb in zip(chosen, found, strict=True)]
        table = pa.Table.from_pylist(out_rows, schema=NEIGHBOURS)
        n_shards = max(1, -(-len(out_rows) // lf.shard_size))
        reject_table = pa.Table.from_pylist(rejects, schema=REJECTS)
        shards = [{"neighbours": table.slice(i * lf.shard_size, lf.shard_size),
                   "select_rejects": reject_table if i == 0 else REJECTS.empty_table()} for i in range(n_shards)]
        return Work(shards, {"input_rows": len(rows), "accepted": len(chosen),
                             "rejected": dict(Counter(r["reason"] for r in rejects)),
                             "without_hard_negative": sum(nb.hard_negative_id is None for nb in found)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        return Report(log=f"hard-negatives: top-{run.section('largefine').neighbours_k} neighbours of "
                          f"{result.accepted} images, {stats.get('without_hard_negative', 0)} without a hard negative")
