"""The near-duplicates stage of build-secmm: after denoise, before CGDS, keep one image of each
group of near-identical crops per domain (the rule: ``rde/secmm/near_duplicates.py``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pyarrow as pa

from rde.common.embedding_cache import EmbeddingCache
from rde.common.reasons import rejected_row
from rde.secmm.near_duplicates import NEAR_DUPLICATE, Deduplication, find_near_duplicates
from storage import Artifact
from storage.schemas import ACCEPTED_IMAGES, REJECTS
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write

# what a rejected row carries besides its decision (read without the bytes)
COLUMNS = ["input_id", "image_id", "source", "domain", "width", "height", "laplacian_variance", "target_count"]


class NearDuplicates(Stage):
    """Per domain, drop images whose embedding cosine to a sharper kept image of their cluster is
    above ``near_duplicates.threshold``; the rest is the ``distinct`` pool."""

    name = "near-duplicates"
    version = "1"
    reads = ("accepted",)
    writes = (Write("distinct", "accepted_images", ACCEPTED_IMAGES),
              Write("near_duplicates", "rejects", REJECTS, rejects=True))
    config = ("near_duplicates",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.image_embedder.batch_size")
    balance = True
    prepares = EmbeddingCache  # lineage() opens the cache, run() reads it
    title = "Near duplicates: per domain, near-identical crops of which only the sharpest is kept"
    row_unit = "images"

    def lineage(self, run: StageRun) -> Lineage:
        cache = EmbeddingCache(run.ctx.base, run.registry().image_embedder())  # the cache CGDS reads too
        run.prepared = cache
        return Lineage(models={"image_embedder": cache.identity})

    def run(self, run: StageRun) -> Work:
        """Decide on the cached vectors (a miss is embedded and cached, one pool shard at a time),
        then copy the kept rows one pool shard at a time. Memory: the pool's metadata, one domain's
        vectors, one shard of bytes."""
        cache: EmbeddingCache = run.prepared
        accepted = run.input("accepted")
        rows, vectors = cache.index_artifact(accepted, COLUMNS)
        found = find_near_duplicates([r["image_id"] for r in rows], [r["domain"] for r in rows],
                                     [r["laplacian_variance"] for r in rows], vectors.take,
                                     run.section("near_duplicates"))
        stats = {"input_rows": len(rows), "accepted": len(rows) - found.dropped,
                 "rejected": {NEAR_DUPLICATE: found.dropped} if found.dropped else {},
                 "by_domain": [vars(c) for c in found.by_domain], "embedded": cache.embedded}
        return Work(_shards(accepted, rows, found, self.name), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        by_domain = result.stats.get("by_domain") or [{"domain": "-", "images": 0, "clusters": 0, "kept": 0,
                                                        "dropped": 0}]
        return Report(tables=[("near-duplicates-domains", by_domain,
                               "Near duplicates per domain: images, clusters compared within, kept, dropped")],
                      log="near-duplicates: " + ", ".join(f"{d['domain']} {d['dropped']} of {d['images']} dropped"
                                                          for d in by_domain))


def _shards(accepted: Artifact, rows: list[dict[str, Any]], found: Deduplication,
            stage: str) -> Iterator[dict[str, pa.Table]]:
    """Output shard i: pool shard i's kept rows (same order) and its rejected rows, reading one pool
    shard's bytes at a time; at least one shard, so an empty pool is written."""
    start, written = 0, False
    for _, table in accepted.iter_shards():
        mine = range(start, start + table.num_rows)
        start += table.num_rows
        if table.column("image_id").to_pylist() != [found.decisions[p].image_id for p in mine]:
            raise RuntimeError(f"{stage}: the accepted pool changed while the stage read it")
        rejects = [rejected_row(rows[p]["input_id"], stage, NEAR_DUPLICATE, kind="image", image_id=d.image_id,
                                source=rows[p]["source"], domain=d.domain,
                                detail=f"near-duplicate of {d.twin} (cosine {d.cosine:.4f})",
                                **{k: rows[p][k] for k in ("width", "height", "laplacian_variance", "target_count")})
                   for p in mine if not (d := found.decisions[p]).kept]
        kept = pa.array([found.decisions[p].kept for p in mine], pa.bool_())
        written = True
        yield {"distinct": table.filter(kept).select(ACCEPTED_IMAGES.names).cast(ACCEPTED_IMAGES),
               "near_duplicates": pa.Table.from_pylist(rejects, schema=REJECTS)}
    if not written:
        yield {"distinct": ACCEPTED_IMAGES.empty_table(), "near_duplicates": REJECTS.empty_table()}
