"""The measure stage: Laplacian variance and target detections per image (model work, per shard);
``denoise`` decides on them."""

from __future__ import annotations

from models.backends.detectors import load_detector
from models.backends.registry import detector_lineage
from rde.common.denoise import measure_table
from storage.locations import state_dir
from storage.schemas import MEASUREMENTS
from tasks.framework.stage import Lineage, Resources, Stage, StageRun, Work, Write


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
