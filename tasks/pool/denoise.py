"""The denoise stage (GTR+): size, Laplacian blur, target count and exact duplicates decided on the
measurements, per shard → ``accepted`` + ``denoise_rejects``."""

from __future__ import annotations

import pyarrow as pa

from rde.common.denoise import DenoiseCounts, decide_shards, first_occurrences
from storage.schemas import ACCEPTED_IMAGES, REJECTS
from tasks.framework.stage import Stage, StageRun, Work, Write


class Denoise(Stage):
    """Apply the size, blur and target-count thresholds and remove exact duplicates → ``accepted``
    + ``denoise_rejects``, one task per shard of ``images`` (a CPU stage: with
    ``prefect.fanout.cpu_deployment`` its shards run on the cpu pool, so the parent never reads an
    image). An exact duplicate is rejected after its first occurrence in input order: a shard
    looks its own images' content hashes up in the ``image_id`` column of the shards before it
    (``first_occurrences``), so it needs no state from another shard's task and holds the ids of
    one shard only."""

    name = "denoise"
    version = "3"  # 2: per-domain size rule (denoise.size_by_domain); 3: per shard
    reads = ("images", "measurements")
    writes = (Write("accepted", "accepted_images", ACCEPTED_IMAGES),
              Write("denoise_rejects", "rejects", REJECTS, rejects=True))
    config = ("denoise",)
    balance = True
    title = "Denoise (GTR+): size, Laplacian blur, target count, exact duplicates; rejected rows by reason"
    row_unit = "images"

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("images").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        images, spec = run.input("images"), run.section("denoise")
        mine = images.read_shard(index)
        seen: dict[str, str] = {}
        if spec.deduplicate and index:
            seen = first_occurrences(set(mine.column("image_id").to_pylist()),
                                     (images.read_shard(i, ["image_id", "input_id"]) for i in range(index)))
        counts = DenoiseCounts()
        [(accepted, rejects)] = decide_shards(iter([(mine, run.input("measurements").read_shard(index))]), spec,
                                              counts, seen)
        tables: dict[str, pa.Table] = {"accepted": accepted, "denoise_rejects": rejects}
        return Work.one(tables, {"input_rows": counts.input, "accepted": counts.accepted,
                                 "rejected": dict(counts.rejected)})
