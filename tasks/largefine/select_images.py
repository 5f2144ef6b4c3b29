"""The select-images stage: the images build-largefine captions (the profile's domains, an optional
seeded cap) and where each one's vector is in ``image_vectors``, over ``rde.largefine.selection``."""

from __future__ import annotations

from collections import Counter

import pyarrow as pa

from rde.largefine.hard_negatives import vector_places
from rde.largefine.selection import select_rows
from storage.schemas import CHOSEN_IMAGES, REJECTS
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Report, Stage, StageRun, Work, Write


class SelectImages(Stage):
    """Choose the images to caption from the accepted ones and find each one's vector in
    ``image_vectors`` (its ids checked against the accepted rows); written in shards of
    ``largefine.shard_size``, the shards that the hard negatives' search and the captioning tiers
    follow. It reads ids and domains only, never an image or a vector: the selection is a seeded
    draw over every accepted image (``largefine.max_images``), so it stays one step over the whole
    input, in the parent."""

    name = "select-images"
    version = "1"
    reads = ("accepted", "image_vectors")
    writes = (Write("chosen_images", "chosen_images", CHOSEN_IMAGES),
              Write("select_rejects", "rejects", REJECTS, rejects=True))
    config = ("largefine.domains", "largefine.max_images", "largefine.seed", "largefine.shard_size")
    balance = True

    def run(self, run: StageRun) -> Work:
        lf = run.section("largefine")
        rows = [dict(r, accepted_shard=index) for index, table in
                run.input("accepted").iter_shards(["image_id", "source", "domain", "identity"])
                for r in table.to_pylist()]
        positions, rejects = select_rows(rows, lf.domains, lf.max_images, lf.seed)
        places = vector_places(run.input("image_vectors"), rows, positions, set(lf.domains))
        chosen = [{**{k: rows[p][k] for k in ("image_id", "source", "domain", "identity", "accepted_shard")},
                   "vector_row": int(place[1])} for p, place in zip(positions, places, strict=True)]
        table = pa.Table.from_pylist(chosen, schema=CHOSEN_IMAGES)
        reject_table = pa.Table.from_pylist(rejects, schema=REJECTS)
        n_shards = max(1, -(-len(chosen) // lf.shard_size))
        shards = [{"chosen_images": table.slice(i * lf.shard_size, lf.shard_size),
                   "select_rejects": reject_table if i == 0 else REJECTS.empty_table()} for i in range(n_shards)]
        return Work(shards, {"input_rows": len(rows), "accepted": len(chosen),
                             "rejected": dict(Counter(r["reason"] for r in rejects))})

    def report(self, run: StageRun, result: StageResult) -> Report:
        return Report(log=f"select-images: {result.accepted} of {result.input_rows} accepted images chosen to caption")
