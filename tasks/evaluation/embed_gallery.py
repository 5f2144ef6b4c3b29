"""The embed-gallery stage of ``rde evaluate``: one retriever's image side over the benchmark's gallery,
one task per gallery shard (a GPU stage: with ``prefect.fanout`` its shards run on the pool's workers)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from rde.evaluation.benchmarks import mean_of_frames
from rde.evaluation.plan import EvaluationPlan, loaded_retriever
from rde.evaluation.retrievers import RetrieverError, RetrieverSpec
from storage.evaluation_schemas import GALLERY_VECTORS
from tasks.framework.stage import Lineage, Resources, Stage, StageRun, Work, Write


class EmbedGallery(Stage):
    """A retriever's vector for every gallery item: an image's own vector, a clip's the mean of its
    frames' (L2-normalised). One task per group of consecutive gallery shards holding about
    ``evaluation.embed_group_items`` items (a build's gallery comes in shards of a hundred images,
    and each task costs the orchestration a few tenths of a second), decoded and encoded one gallery
    shard at a time. An expert of the profile reads and fills the embedding cache MECF wrote, so the build's
    gallery is not encoded twice."""

    version = "1"
    resources = Resources(device="gpu", hold_slot=False)
    balance = True
    row_unit = "images"
    config = ("evaluation.embed_group_items",)

    def __init__(self, spec: RetrieverSpec, plan: EvaluationPlan) -> None:
        self.spec, self.plan = spec, plan
        self.name = f"embed-gallery-{spec.slug}"
        self.writes = (Write(f"{plan.vectors_folder(spec)}/gallery_vectors", "gallery_vectors", GALLERY_VECTORS),)
        self.title = f"The gallery through {spec.text}"
        self._groups: list[list[int]] | None = None

    def lineage(self, run: StageRun) -> Lineage:
        bench = self.plan.benchmark
        return Lineage(models={"retriever": self.plan.lineage(self.spec)},
                       extra={"gallery": bench.gallery_key}, upstream=list(bench.upstream))

    def groups(self, run: StageRun) -> list[list[int]]:
        """The gallery's shards in consecutive groups of at least ``evaluation.embed_group_items``
        items (the last may hold fewer); one group per task and per output shard."""
        if self._groups is None:
            target = run.section("evaluation").embed_group_items
            gallery, groups, size = self.plan.benchmark.gallery, [[]], 0
            for index in range(gallery.shards):
                if size >= target:
                    groups.append([])
                    size = 0
                groups[-1].append(index)
                size += len(gallery.ids_domains(index)[0])
            self._groups = groups
        return self._groups

    def shard_count(self, run: StageRun) -> int:
        return len(self.groups(run))

    def process(self, run: StageRun, index: int) -> Work:
        gallery, ids, domains, parts = self.plan.benchmark.gallery, [], [], []
        for shard in self.groups(run)[index]:  # one gallery shard's pixels at a time
            shard_ids, shard_domains = gallery.ids_domains(shard)
            vectors = self._vectors(run, shard_ids, lambda shard=shard: gallery.items(shard))
            if vectors.shape[0] != len(shard_ids) or not np.isfinite(vectors).all():
                raise RetrieverError(f"{self.spec.text}: encode_image returned shape {vectors.shape} for "
                                     f"{len(shard_ids)} items" if vectors.shape[0] != len(shard_ids) else
                                     f"{self.spec.text}: encode_image returned NaN or infinite values")
            ids, domains, parts = ids + shard_ids, domains + shard_domains, [*parts, vectors.astype(np.float32)]
        vectors = np.concatenate(parts) if parts else np.zeros((0, 1), np.float32)
        column = pa.array(list(vectors), type=GALLERY_VECTORS.field("vector").type)
        table = pa.table({"item_id": ids, "domain": domains, "vector": column}, schema=GALLERY_VECTORS)
        return Work.one({self.writes[0].name: table}, {"input_rows": len(ids), "accepted": len(ids), "rejected": {}})

    def _vectors(self, run: StageRun, ids: list[str], items) -> np.ndarray:
        expert = loaded_retriever(self.spec, self.plan.profile, self.plan.lineage(self.spec))
        loaded = items()
        if not ids:
            return np.zeros((0, int(getattr(expert, "dim", 1))), np.float32)
        if isinstance(loaded[0], list):  # clips: the mean of each clip's frames' vectors, one encode call a shard
            frames = expert.encode_image([frame for clip in loaded for frame in clip])
            ends = np.cumsum([len(clip) for clip in loaded])
            return np.stack([mean_of_frames(frames[end - len(clip):end])
                             for clip, end in zip(loaded, ends, strict=True)])
        if self.spec.kind == "expert":
            from rde.common.embedding_cache import EmbeddingCache, ExpertImages

            lineage = self.plan.lineage(self.spec)["expert"]  # MECF's cache key: shared vectors
            cache = EmbeddingCache(run.ctx.base, ExpertImages(expert, lineage))
            return cache.embed(ids, lambda positions: [loaded[p] for p in positions])
        return np.asarray(expert.encode_image(loaded), dtype=np.float32)
