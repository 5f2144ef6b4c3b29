"""The export-largefine stage: the LargeFine-style caption shards, every caption reject, and the
dataset card."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rde.common.dataset_cards import card_folder_note
from rde.largefine.card import dataset_card, write_card
from rde.largefine.tiered_captions import TIERS
from storage.schemas import REJECTS, TIER_CAPTIONS
from tasks.framework import accounting
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Report, Stage, StageRun, Work, Write


class ExportLargeFine(Stage):
    """The LargeFine-style shards (one row per image and tier, aligned with the captioning
    shards) and all caption rejects in one artifact; then the dataset card. Its input is counted
    from the chosen images (``neighbours``): each ends as one caption or one reject per tier."""

    name = "export-largefine"
    version = "2"
    reads = ("neighbours", "tier12_captions", "tier12_rejects", "adv_captions", "adv_rejects")
    writes = (Write("largefine", "tier_captions", TIER_CAPTIONS),
              Write("caption_rejects", "rejects", REJECTS, rejects=True))
    balance = True
    rejects_from_upstream = True  # the tier stages rejected them; counted there

    def shard_count(self, run: StageRun) -> int:
        return len(run.input("tier12_captions").manifest().shards)

    def process(self, run: StageRun, index: int) -> Work:
        order = {tier: i for i, tier in enumerate(TIERS)}
        caps = pa.concat_tables([run.input("tier12_captions").read_shard(index),
                                 run.input("adv_captions").read_shard(index)])
        rows = sorted(caps.to_pylist(), key=lambda r: (r["image_id"], order[r["tier"]]))
        rejects = pa.concat_tables([run.input("tier12_rejects").read_shard(index),
                                    run.input("adv_rejects").read_shard(index)])
        tables = {"largefine": pa.Table.from_pylist(rows, schema=TIER_CAPTIONS), "caption_rejects": rejects}
        images = run.input("neighbours").read_shard(index, ["image_id"]).num_rows
        return Work.one(tables, {**accounting.accepted_and_rejected(tables, "largefine", "caption_rejects"),
                                 "input_rows": images * len(TIERS), "images": images})

    def report(self, run: StageRun, result: StageResult) -> Report:
        """The dataset card, beside the artifact folders (``export-webdataset``, when it runs after
        this stage, writes it again with its tars' loading snippet)."""
        card, stats = dataset_card(run.ctx.artifact_url, run.profile_name, webdataset=False)
        if "://" not in run.ctx.root:
            write_card(Path(run.ctx.root), card, stats)
        return Report(markdown=[("dataset-card", card_folder_note(run.ctx.root) + card,
                                 "LargeFine-style dataset card (GTR+ Table 1 statistics)")])
