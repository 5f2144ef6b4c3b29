"""The cgds stage: Centroid-Guided Diversity Sampling of the gallery (DSMM-TBIR Sec. 3.1) over
``rde.secmm.cgds``."""

from __future__ import annotations

from collections import Counter

from rde.common.embedding_cache import EmbeddingCache
from rde.secmm import cgds
from rde.secmm.cgds import gallery_shards
from storage.schemas import (
    GALLERY,
    SAMPLING,
)
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


class Cgds(Stage):
    """Embed the denoised pool, k-means per domain, sample per cluster, keep the target category."""

    name = "cgds"
    # 4: domains above sampling.minibatch_above are clustered by streaming k-means over the cached
    # vectors (rde.secmm.cgds.kmeans_streaming) instead of MiniBatchKMeans on all of them in memory
    # 5: draws from the near-duplicates stage's ``distinct`` pool, not the denoised one
    version = "5"
    reads = ("distinct",)
    writes = (Write("gallery", "gallery", GALLERY), Write("sampling", "sampling", SAMPLING))
    config = ("sampling",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.image_embedder.batch_size")
    prepares = EmbeddingCache  # the image embedder's cache

    def lineage(self, run: StageRun) -> Lineage:
        cache = EmbeddingCache(run.ctx.base, run.registry().image_embedder())
        run.prepared = cache
        return Lineage(models={"image_embedder": cache.identity})

    def run(self, run: StageRun) -> Work:
        """The draw on embeddings, then the gallery written streaming: per domain, one output shard
        per pool shard, with the drawn images' bytes copied from that pool shard (same rows and
        order as drawing over the whole pool). Memory: the pool's metadata, one shard of bytes
        while embedding the misses, and the vectors of one domain at most ``minibatch_above``
        images (k-means in memory) or of one pool shard (a larger domain, streamed: see
        ``cgds.kmeans_streaming``); never the pool's N × dim vectors."""
        cache: EmbeddingCache = run.prepared
        pool = run.input("distinct")
        rows, vectors = cache.index_artifact(pool, [*cgds.GALLERY_FIELDS, "target_count"])
        drawn = cgds.draw_gallery(rows, run.section("sampling"), vectors.take, vectors.blocks)
        stats = {"input_rows": len(rows), "accepted": len(drawn.gallery),
                 "rejected": dict(Counter(s["reason"] for s in drawn.sampling if s["reason"])),
                 "clusters": drawn.clusters, "embedded": cache.embedded}
        return Work(gallery_shards(pool, drawn), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        stats = result.stats
        clusters = stats.get("clusters", [])
        return Report(tables=[("cgds-clusters", clusters or [{"domain": "-", "cluster": 0, "size": 0}],
                               "CGDS: cluster sizes and how many images each contributed to the gallery")],
                      log=f"cgds: gallery {result.accepted} of {result.input_rows} images, {len(clusters)} "
                          f"clusters, embedded {0 if result.skipped else stats.get('embedded', 0)} new images")
