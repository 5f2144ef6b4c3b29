"""``rde labels import``: merge reviewed decisions into the run's ``decisions`` artifact."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rde.secmm.labels import Decision, import_decisions
from storage import Artifact, ArtifactWriter, content_key
from storage.schemas import QRELS


def merge_decisions(decisions_url: str, candidates_url: str, decisions_file: Path, code_version: str) -> dict[str, int]:
    """Validate ``decisions_file`` against the candidates and merge it into the decisions artifact
    (a later decision on the same pair replaces the earlier one). Returns counts."""
    pairs = [(r["query_id"], r["image_id"]) for _, t in Artifact(candidates_url).iter_shards(["query_id", "image_id"])
             for r in t.to_pylist()]
    new: list[Decision] = import_decisions(decisions_file, pairs)
    existing = Artifact(decisions_url)
    merged = {}
    if existing.is_complete():
        for _, t in existing.iter_shards():
            for r in t.to_pylist():
                merged[(r["query_id"], r["image_id"])] = r
    before = len(merged)
    for d in new:
        merged[(d.query_id, d.image_id)] = {"query_id": d.query_id, "image_id": d.image_id, "relevant": d.relevant,
                                            "verified": True, "annotator": d.annotator, "decided_at": d.decided_at}
    rows = sorted(merged.values(), key=lambda r: (r["query_id"], r["image_id"]))
    writer = ArtifactWriter(decisions_url, "decisions", QRELS, content_key(kind="decisions", rows=rows))
    writer.begin()
    shard = writer.write_shard(0, pa.Table.from_pylist(rows, schema=QRELS))
    writer.finalize([shard], code_version=code_version, upstream=[Artifact(candidates_url)],
                    config={"imported_from": str(decisions_file)})
    return {"imported": len(new), "new_pairs": len(merged) - before, "total": len(merged),
            "relevant": sum(r["relevant"] for r in rows)}
