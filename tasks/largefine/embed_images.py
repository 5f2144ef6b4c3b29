"""The embed-images stage: the image embedder over the accepted images of ``largefine.domains``,
per shard (fanned out over the pool with ``prefect.fanout``)."""

from __future__ import annotations

from typing import ClassVar

import numpy as np
import pyarrow as pa

from models.backends.registry import BUNDLED_IMAGE_EMBEDDER, spec_lineage
from rde.common.image_decoding import decode_rgb
from storage.schemas import IMAGE_VECTORS
from tasks.framework.stage import Lineage, Resources, Stage, StageRun, Work, Write


class EmbedImages(Stage):
    """The profile's image embedder over every accepted image of ``largefine.domains``, one task per
    accepted shard. A GPU stage, so with ``prefect.fanout`` its shards run on the pool's workers:
    the parent keeps only the hard negatives' index and search. Rows of other domains are not this
    stage's input; each input row is embedded (an accepted image decodes)."""

    name = "embed-images"
    version = "1"
    reads = ("accepted",)
    writes = (Write("image_vectors", "image_vectors", IMAGE_VECTORS),)
    config = ("largefine.domains",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="models.image_embedder.batch_size")
    balance = True
    title = "Embed the images of largefine.domains for the hard-negative search"
    row_unit = "images"
    decode_batch: ClassVar[int] = 512  # images decoded and handed to the embedder at once (its own batches inside)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"image_embedder": spec_lineage(run.models.image_embedder or BUNDLED_IMAGE_EMBEDDER)})

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("accepted").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        table = run.input("accepted").read_shard(index, ["image_id", "domain", "image_bytes"])
        domains = set(run.section("largefine").domains)
        keep = [i for i, d in enumerate(table.column("domain").to_pylist()) if d in domains]
        ids = table.column("image_id").take(keep).to_pylist() if keep else []
        embedder, column, vectors = run.registry().image_embedder(), table.column("image_bytes"), []
        for start in range(0, len(keep), self.decode_batch):  # decoded pixels: one batch at a time
            images = [decode_rgb(column[i].as_py()) for i in keep[start:start + self.decode_batch]]
            vectors += [v.astype(np.float32) for v in embedder.embed(images)]
        out = pa.table({"image_id": ids, "vector": pa.array(vectors, type=IMAGE_VECTORS.field("vector").type)},
                       schema=IMAGE_VECTORS)
        return Work.one({"image_vectors": out}, {"input_rows": len(keep), "accepted": len(keep), "rejected": {}})
