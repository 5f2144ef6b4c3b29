"""``rde labels import``: merge reviewed decisions into the run's ``decisions`` artifact."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from rde.secmm.labels import Decision, latest_per_pair, read_decisions
from storage import Artifact, ArtifactWriter, content_key
from storage.schemas import QRELS


def merge_decisions(decisions_url: str, candidates_url: str, decisions_file: Path, code_version: str) -> dict[str, int]:
    """Validate ``decisions_file`` against the candidates and merge it into the decisions artifact:
    per pair, the decisions already imported and the new ones are resolved by ``latest_per_pair``
    (the latest ``decided_at`` wins, ties to the new import). Returns counts: decisions read, new
    pairs, pairs whose decisions disagree (``conflicts``), new decisions that lost to a later one
    already imported (``older_than_kept``), total and relevant pairs."""
    pairs = [(r["query_id"], r["image_id"]) for _, t in Artifact(candidates_url).iter_shards(["query_id", "image_id"])
             for r in t.to_pylist()]
    new: list[Decision] = read_decisions(decisions_file, pairs)
    existing = Artifact(decisions_url)
    before: list[Decision] = []
    if existing.is_complete():
        for _, t in existing.iter_shards():
            for r in t.to_pylist():
                # imported before decisions kept their tool: which one made it is not known
                before.append(Decision(r["query_id"], r["image_id"], r["relevant"], r.get("annotator") or "unknown",
                                       r.get("decided_at") or "", r.get("tool") or "unknown"))
    kept, conflicts = latest_per_pair([*before, *new])
    kept_new = {(d.query_id, d.image_id): d for d in latest_per_pair(new)[0]}
    rows = sorted(({"query_id": d.query_id, "image_id": d.image_id, "relevant": d.relevant, "verified": True,
                    "annotator": d.annotator, "decided_at": d.decided_at, "tool": d.tool} for d in kept),
                  key=lambda r: (r["query_id"], r["image_id"]))
    writer = ArtifactWriter(decisions_url, "decisions", QRELS, content_key(kind="decisions", rows=rows))
    writer.begin()
    shard = writer.write_shard(0, pa.Table.from_pylist(rows, schema=QRELS))
    writer.finalize([shard], code_version=code_version, upstream=[Artifact(candidates_url)],
                    config={"imported_from": str(decisions_file)})
    old_pairs = {(d.query_id, d.image_id) for d in before}
    return {"imported": len(new), "new_pairs": len({(d.query_id, d.image_id) for d in new} - old_pairs),
            "conflicts": conflicts,
            "older_than_kept": sum(1 for d in kept if (d.query_id, d.image_id) in kept_new
                                   and d is not kept_new[(d.query_id, d.image_id)]),
            "total": len(rows), "relevant": sum(r["relevant"] for r in rows)}
