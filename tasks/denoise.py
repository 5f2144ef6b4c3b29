"""Denoise stages: measure (per shard, model work) then denoise, which decides (one streaming pass)."""

from __future__ import annotations

from collections.abc import Iterator

import pyarrow as pa

from models.backends.detectors import load_detector
from models.backends.registry import detector_lineage
from rde.common.denoise import DenoiseCounts, decide_shards, measure_table
from storage.locations import state_dir
from storage.schemas import ACCEPTED_IMAGES, MEASUREMENTS, REJECTS
from tasks.ingest import Ingest
from tasks.stage import Lineage, Resources, Stage, StageRun, Work, Write
from tasks.video import Videos


class Measure(Stage):
    """Laplacian variance and target detections for every image, one task per images shard (the
    detector is loaded once per process). Measures only; ``denoise`` decides."""

    name = "measure"
    version = "1"
    reads = ("images",)
    writes = (Write("measurements", "measurements", MEASUREMENTS),)
    config = ("domains", "ingest")
    # tagged for the GPU pool; it does not hold a slot of the limit (as before the stage contract)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.detector.batch_size")
    balance = True
    title = "Measure: Laplacian variance and target detections per image"
    row_unit = "images"

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"detector": detector_lineage(run.models.detector)})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("images").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        images = run.input("images").read_shard(index, ["input_id", "image_id", "domain", "image_bytes"])
        detector = load_detector(run.models.detector, str(state_dir()))
        domains = {d.name: d for d in run.section("domains")}
        table = measure_table(images, detector, domains, run.models.detector.batch_size,
                              run.section("ingest").max_pixels)
        return Work.one({"measurements": table},
                        {"input_rows": images.num_rows, "accepted": table.num_rows, "rejected": {}})


class Denoise(Stage):
    """Apply the size, blur and target-count thresholds and remove exact duplicates → ``accepted``
    + ``denoise_rejects``, streaming shard by shard."""

    name = "denoise"
    version = "2"  # 2: per-domain size rule (denoise.size_by_domain)
    reads = ("images", "measurements")
    writes = (Write("accepted", "accepted_images", ACCEPTED_IMAGES),
              Write("rejects", "rejects", REJECTS, folder="denoise_rejects", rejects=True))
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
                yield {"accepted": accepted, "rejects": rejects}
            stats.update(input_rows=counts.input, accepted=counts.accepted, rejected=counts.rejected)

        return Work(shards(), stats)


# every building flow starts with these (videos only for video input)
CLEAN_POOL: tuple[Stage, ...] = (Videos(), Ingest(), Measure(), Denoise())

