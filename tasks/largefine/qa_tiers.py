"""The qa-tiers stage: GTR+ base and intermediate tiers per neighbours shard."""

from __future__ import annotations

from rde.largefine.tier_inputs import tier_images, tier_tables
from rde.largefine.tiered_captions import TierCaptioner, TierOutputs
from storage.schemas import QA_PAIRS, REJECTS, TIER_CAPTIONS
from tasks.framework.stage import StageRun, Work, Write
from tasks.largefine.tier_stage import TierStage


class QaTiers(TierStage):
    """Base and intermediate tiers, one task per neighbours shard holding a GPU slot."""

    name = "qa-tiers"
    version = "4"  # 3: each image's video-track facts go with it into the requests; 4: garbled texts rejected
    reads = ("neighbours", "accepted")
    writes = (Write("tier12_captions", "tier_captions", TIER_CAPTIONS), Write("qa_pairs", "qa_pairs", QA_PAIRS),
              Write("tier12_rejects", "rejects", REJECTS, rejects=True))

    def process(self, run: StageRun, index: int) -> Work:
        rows = self.neighbour_rows(run, index)
        captioner = TierCaptioner(run.registry().generators(), run.prepared, run.section("largefine"), run.domains)
        items = tier_images(run.input("accepted").url, rows, True, run.section("track_facts"), run.domains)
        out = TierOutputs()
        captioner.qa_tier(items, "base", out)
        captioner.qa_tier(items, "inter", out)
        tables, stats = tier_tables(out, len(items))
        return Work.one({"tier12_captions": tables["captions"], "qa_pairs": tables["qa"],
                         "tier12_rejects": tables["rejects"]}, stats)
