"""What a captioning shard reads and writes: its images (and hard negatives) decoded with their
track facts, read by row group from the accepted pool; its tables and GTR+ Table 1 sums."""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa

from models.backends.track_facts import motion_facts
from models.domains import DomainSet
from rde.common import caption_stats
from rde.common.image_decoding import decode_rgb
from rde.common.pool_config import TrackFactsSpec
from rde.common.track_context import motion_options
from rde.largefine.tiered_captions import TIERS, TierImage, TierOutputs
from storage import Artifact
from storage.schemas import QA_PAIRS, REJECTS, TIER_CAPTIONS


def accepted_rows(accepted_url: str, wanted: dict[int, set[str]], columns: list[str]) -> dict[str, dict[str, Any]]:
    """The accepted rows of the ``wanted`` ids (by accepted shard), ``columns`` of each, reading only the
    row groups that hold them (a caption shard's hard negatives are spread over the pool: whole shards
    would be read for one image each); a duplicate image once."""
    found: dict[str, dict[str, Any]] = {}
    accepted = Artifact(accepted_url)
    for shard, ids in wanted.items():
        for rec in accepted.read_matching(shard, "image_id", ids, ["image_id", *columns]).to_pylist():
            found.setdefault(rec["image_id"], rec)
    return found


def tier_images(accepted_url: str, rows: list[dict[str, Any]], with_negatives: bool,
                 track: TrackFactsSpec, domains: DomainSet) -> list[TierImage]:
    """The shard's images (and hard negatives), decoded, each with its video-track facts."""
    wanted: dict[int, set[str]] = defaultdict(set)
    for r in rows:
        wanted[r["accepted_shard"]].add(r["image_id"])
        if with_negatives and r["hard_negative_id"]:
            wanted[r["hard_negative_shard"]].add(r["hard_negative_id"])
    found = accepted_rows(accepted_url, wanted, ["image_bytes", "domain", "source_meta"])
    options = motion_options(track)
    images = {i: decode_rgb(rec["image_bytes"]) for i, rec in found.items()}
    facts = {i: motion_facts(rec["source_meta"], domains.get(rec["domain"]), options) for i, rec in found.items()}
    negative = [r["hard_negative_id"] if with_negatives and r["hard_negative_id"] else None for r in rows]
    return [TierImage(r["image_id"], r["source"], r["domain"], images[r["image_id"]], r["generator_index"],
                      neg, images.get(neg) if neg else None, facts[r["image_id"]], facts.get(neg, {}) if neg else {})
            for r, neg in zip(rows, negative, strict=True)]


def tier_tables(out: TierOutputs, images: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """A captioning shard's tables (``captions``, ``qa``, ``rejects``) and its stats with its Table 1 sums."""
    return ({"captions": pa.Table.from_pylist(out.captions, schema=TIER_CAPTIONS),
             "qa": pa.Table.from_pylist(out.qa, schema=QA_PAIRS),
             "rejects": pa.Table.from_pylist(out.rejects, schema=REJECTS)},
            {**out.stats(images), **table1_counts(out.captions)})


def table1_counts(captions: list[dict[str, Any]]) -> dict[str, int]:
    """The shard's GTR+ Table 1 sums per tier (spaCy, where the shard is written: on the pool's
    worker), as flat ``table1.<tier>.<count>`` stats; the manifest sums them over the shards and the
    dataset card divides (``table1_from_stats``), so no process reads every caption for it."""
    out: dict[str, int] = {}
    for tier in TIERS:
        texts = [c["text"] for c in captions if c["tier"] == tier]
        if texts:
            counts = caption_stats.text_counts(texts, caption_stats.load_tagger())
            out.update({f"table1.{tier}.{name}": value for name, value in counts.items()})
    return out


def table1_from_stats(manifests: list[dict[str, Any]]) -> dict[str, dict[str, float]] | None:
    """Table 1 per tier and overall from the tier stages' summed ``table1.*`` stats; None when a
    manifest has none (written before the counts were kept: the card then counts the texts itself)."""
    if not all(any(k.startswith("table1.") for k in stats) for stats in manifests):
        return None
    sums = {tier: {name: sum(int(m.get(f"table1.{tier}.{name}", 0)) for m in manifests)
                   for name in caption_stats.TABLE1_COUNTS} for tier in TIERS}
    out = {tier: caption_stats.means_from_counts(c) for tier, c in sums.items() if c["texts"]}
    out["all"] = caption_stats.means_from_counts({name: sum(c[name] for c in sums.values())
                                                  for name in caption_stats.TABLE1_COUNTS})
    return out
