"""The adv-tier stage: T_adv per image from a drawn template and its T_base + T_inter."""

from __future__ import annotations

from rde.largefine.template_gallery import load_gallery
from rde.largefine.tier_inputs import tier_images, tier_tables
from rde.largefine.tiered_captions import TierCaptioner, TierOutputs
from storage.schemas import REJECTS, TIER_CAPTIONS
from tasks.framework.stage import StageRun, Work, Write
from tasks.largefine.tier_stage import TierStage


class AdvTier(TierStage):
    """T_adv per image from a drawn template and its T_base + T_inter; one task per shard."""

    name = "adv-tier"
    version = "4"  # 3: each image's video-track facts go with it into the requests; 4: garbled texts rejected
    reads = ("neighbours", "tier12_captions", "template_gallery", "accepted")
    writes = (Write("adv_captions", "tier_captions", TIER_CAPTIONS),
              Write("adv_rejects", "rejects", REJECTS, rejects=True))

    def process(self, run: StageRun, index: int) -> Work:
        rows = self.neighbour_rows(run, index)
        earlier = run.input("tier12_captions").read_shard(index, ["image_id", "tier", "text"]).to_pylist()
        texts = {tier: {r["image_id"]: r["text"] for r in earlier if r["tier"] == tier} for tier in ("base", "inter")}
        captioner = TierCaptioner(run.registry().generators(), run.prepared, run.section("largefine"), run.domains)
        items = tier_images(run.input("accepted").url, rows, False, run.section("track_facts"), run.domains)
        for item, row in zip(items, rows, strict=True):
            item.negative_id = row["hard_negative_id"]  # recorded on the T_adv row; the image is not needed
        out = TierOutputs()
        captioner.advanced_tier(items, texts["base"], texts["inter"], load_gallery(run.input("template_gallery").url),
                                out)
        tables, stats = tier_tables(out, len(items))
        return Work.one({"adv_captions": tables["captions"], "adv_rejects": tables["rejects"]}, stats)
