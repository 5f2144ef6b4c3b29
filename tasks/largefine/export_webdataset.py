"""The export-webdataset stage: the caption shards as WebDataset tars (``largefine.webdataset``)."""

from __future__ import annotations

import json
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import pyarrow as pa

from rde.common.dataset_cards import card_folder_note
from rde.largefine import webdataset_export
from rde.largefine.card import CARD_FILES, WDS_SNIPPET, card_markdown, card_stats, write_card
from rde.largefine.tier_inputs import accepted_rows
from storage.filesystem import atomic_write_bytes, join, resolve
from storage.hashing import sha256_bytes
from storage.schemas import WDS_INDEX
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Report, Stage, StageRun, Work, Write

WDS_FOLDER = "largefine_wds"


class ExportWebDataset(Stage):
    """With ``largefine.webdataset`` on, the same captions as WebDataset tars in ``largefine_wds/``:
    one tar per captioning shard, one sample per image with a text (its image and a json of its
    tiers' texts, ``q_txt``, hard negative and lineage), and an index shard beside each tar."""

    name = "export-webdataset"
    version = "1"
    reads = ("largefine", "neighbours", "accepted")
    writes = (Write(WDS_FOLDER, "wds_index", WDS_INDEX),)
    config = ("largefine.webdataset",)
    title = "WebDataset export: the caption shards as tars (one sample per captioned image)"
    row_unit = "images"

    def applies(self, profile: Any) -> bool:
        return bool(profile.largefine.webdataset)

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("largefine").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        """The tar is stored first (one atomic write), then its index rows; a run stopped between the
        two writes this shard's tar again (the same bytes)."""
        captions = run.input("largefine").read_shard(index).to_pylist()
        chosen = run.input("neighbours").read_shard(index, ["image_id", "accepted_shard"]).to_pylist()
        wanted: dict[int, set[str]] = defaultdict(set)
        for row in chosen:
            wanted[row["accepted_shard"]].add(row["image_id"])
        found = accepted_rows(run.input("accepted").url, wanted,
                               ["input_id", "source", "domain", "identity", "image_format", "image_bytes"])
        images = [found[row["image_id"]] for row in chosen]
        data, rows = webdataset_export.write_tar(images, captions)
        fs, folder = resolve(run.output_url(WDS_FOLDER))
        name = webdataset_export.tar_name(index)
        atomic_write_bytes(fs, join(folder, name), data, uuid.uuid4().hex[:8])
        digest = sha256_bytes(data)
        table = pa.Table.from_pylist([{**r, "tar": name, "tar_sha256": digest} for r in rows], schema=WDS_INDEX)
        return Work.one({WDS_FOLDER: table}, {"input_rows": len(chosen), "accepted": len(rows), "tar_bytes": len(data),
                                           "images_without_text": len(chosen) - len(rows)})

    def report(self, run: StageRun, result: StageResult) -> Report:
        """Tars no index shard names (left by an earlier run with more shards) are removed; the
        dataset card is written again with the tars' loading snippet."""
        fs, folder = resolve(run.output_url(WDS_FOLDER))
        listed = {webdataset_export.tar_name(i) for i in range(self.shard_count(run))}
        for path in fs.ls(folder, detail=False, refresh=True):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if name.endswith(".tar") and name not in listed:
                fs.rm(path)
        if "://" not in run.ctx.root:  # the numbers export-largefine's card wrote beside it, not read again
            numbers = Path(run.ctx.root) / CARD_FILES[1]
            stats = json.loads(numbers.read_text()) if numbers.exists() else card_stats(run.ctx.artifact_url)
            write_card(Path(run.ctx.root), card_markdown(stats, run.profile_name, webdataset=True), stats)
        snippet = "\n".join(WDS_SNIPPET)
        return Report(markdown=[("webdataset", card_folder_note(run.ctx.root) + snippet,
                                 "LargeFine captions as WebDataset tars")])
