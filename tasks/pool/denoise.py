"""The denoise stage (GTR+): size, Laplacian blur, target count and exact duplicates decided on the
measurements, in one streaming pass → ``accepted`` + ``denoise_rejects``."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from rde.common.denoise import DenoiseCounts, decide_shards
from storage.schemas import ACCEPTED_IMAGES, REJECTS
from tasks.framework.stage import Stage, StageRun, Work, Write


class Denoise(Stage):
    """Apply the size, blur and target-count thresholds and remove exact duplicates → ``accepted``
    + ``denoise_rejects``, streaming shard by shard."""

    name = "denoise"
    version = "2"  # 2: per-domain size rule (denoise.size_by_domain)
    reads = ("images", "measurements")
    writes = (Write("accepted", "accepted_images", ACCEPTED_IMAGES),
              Write("denoise_rejects", "rejects", REJECTS, rejects=True))
    config = ("denoise",)
    balance = True
    title = "Denoise (GTR+): size, Laplacian blur, target count, exact duplicates; rejected rows by reason"
    row_unit = "images"

    def run(self, run: StageRun) -> Work:
        images, measurements = run.input("images"), run.input("measurements")
        counts = DenoiseCounts()
        stats: dict = {}

        def shards() -> Iterator[dict[str, pa.Table]]:
            pairs = ((images.read_shard(i), measurements.read_shard(i))
                     for i, _ in enumerate(images.manifest().shards))
            for accepted, rejects in decide_shards(pairs, run.section("denoise"), counts):
                yield {"accepted": accepted, "denoise_rejects": rejects}
            stats.update(input_rows=counts.input, accepted=counts.accepted, rejected=counts.rejected)

        return Work(shards(), stats)
