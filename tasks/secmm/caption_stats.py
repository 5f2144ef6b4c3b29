"""The caption-stats stage: POS statistics of the caption pool per domain (DSMM-TBIR Sec. 3.1)."""

from __future__ import annotations

import pyarrow as pa

from rde.common import caption_stats
from storage.schemas import (
    CAPTION_STATS,
)
from tasks.framework.stage import Lineage, Stage, StageRun, Work, Write


class CaptionStats(Stage):
    """POS statistics of the caption pool per domain (DSMM-TBIR Sec. 3.1: what DAP samples from)."""

    name = "caption-stats"
    version = "3"
    reads = ("caption_pool",)
    writes = (Write("caption_stats", "caption_stats", CAPTION_STATS),)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(models={"pos_tagger": "en_core_web_sm 3.8.0"})

    def run(self, run: StageRun) -> Work:
        rows = run.input("caption_pool").rows(["domain", "text"])
        out = []
        for domain in sorted({r["domain"] for r in rows}):
            freqs = caption_stats.pos_frequencies([r["text"] for r in rows if r["domain"] == domain])
            out += [{"domain": domain, "pos": pos, "word": w, "count": c}
                    for pos, counter in freqs.items() for w, c in counter.most_common()]
        return Work.one({"caption_stats": pa.Table.from_pylist(out, schema=CAPTION_STATS)},
                        {"input_rows": len(rows), "accepted": len(out)})
