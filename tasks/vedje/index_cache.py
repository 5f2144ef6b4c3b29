"""The index-cache stage: every item's cached reranker inputs and its stage-1 index row."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import torch

from models.backends.registry import spec_lineage
from models.reranker.cache_store import CACHE, cache_rows
from rde.vedje.features import item_embeddings
from rde.vedje.model_store import backbone_spec, cache_lineage, load_model, source_items, stage1_spec
from storage.schemas import STAGE1_INDEX
from tasks.framework.accounting import StageResult
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class CachePlan:
    """What ``lineage`` loaded: the trained model and its cache lineage, the items, the backbone and
    the stage-1 expert."""

    model: Any
    lineage: dict[str, Any]
    items: Any
    backbone: Any
    stage1: Any


class IndexCache(Stage):
    """Offline indexing (Alg. 1, lines 2–5), one Prefect task per shard of items: frames → frozen
    backbone → trained compressor → encoded cache rows; plus the items' stage-1 index rows."""

    name = "index-cache"
    version = "1"
    writes = (Write("cache", "vedje_cache", CACHE), Write("stage1_index", "stage1_index", STAGE1_INDEX))
    # the whole section: the trained model is rebuilt from its architecture fields (load_model)
    config = ("vedje",)
    resources = Resources(device="gpu")
    prepares = CachePlan
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        model, _meta = load_model(run.ctx.profile, run.ctx.output_root)
        lineage = cache_lineage(model, run.ctx.profile)
        items, upstream = source_items(run.ctx.profile, run.ctx.output_root)
        backbone, stage1 = backbone_spec(run.ctx.profile), stage1_spec(run.ctx.profile)
        run.prepared = CachePlan(model, lineage, items, backbone, stage1)
        return Lineage(models={"backbone": spec_lineage(backbone), "stage1": run.registry().lineage(stage1)},
                       extra={"source": [a.manifest().fingerprint for a in upstream], "cache_lineage": lineage},
                       upstream=upstream)

    def shard_count(self, run: StageRun) -> int:
        return max(1, -(-len(run.prepared.items.item_ids) // run.section("vedje").shard_size))

    def process(self, run: StageRun, index: int) -> Work:
        plan: CachePlan = run.prepared
        spec, items, model = run.section("vedje"), plan.items, plan.model
        rows = range(index * spec.shard_size, min(len(items.item_ids), (index + 1) * spec.shard_size))
        keys = sorted({k for r in rows for k in items.frames[r]})
        images = items.load_frames(keys)
        reg = run.registry()
        start = time.perf_counter()
        maps = torch.from_numpy(reg.image_embedder(plan.backbone).feature_maps([images[k] for k in keys]))
        where = {k: i for i, k in enumerate(keys)}
        x = maps[torch.tensor([[where[k] for k in items.frames[r]] for r in rows])]
        caches = model.index(x).numpy()
        seconds = time.perf_counter() - start
        emb = dict(zip(keys, reg.expert(plan.stage1).encode_image([images[k] for k in keys]), strict=True))
        ids = [items.item_ids[r] for r in rows]
        item_emb = item_embeddings([items.frames[r] for r in rows], emb)
        index_rows = [{"item_id": items.item_ids[r], "group": items.groups[r], "split": items.splits[r],
                       "embedding": e.tolist()} for r, e in zip(rows, item_emb, strict=True)]
        cache_tb = cache_rows(ids, caches, model.shape.frames, model.shape.tokens_per_frame, spec.precision)
        # input: the items of this shard; accepted: the cache rows written for them
        return Work.one({"cache": cache_tb, "stage1_index": pa.Table.from_pylist(index_rows, schema=STAGE1_INDEX)},
                        {"input_rows": len(rows), "accepted": cache_tb.num_rows, "rejected": {},
                         "index_seconds": seconds})

    def report(self, run: StageRun, result: StageResult) -> Report:
        plan: CachePlan = run.prepared
        spec, model, lineage = run.section("vedje"), plan.model, plan.lineage
        art = run.output_artifact("cache")
        per_item = art.read_shard(0, ["payload_bytes"]).column("payload_bytes")[0].as_py() if art.count_rows() else 0
        items = plan.items
        return Report(tables=[("cache", [{"items": art.count_rows(), "precision": spec.precision,
                                          "tokens": model.cache_tokens, "dim": model.reranker.d,
                                          "payload_bytes_per_item": per_item,
                                          "compressor": lineage["compressor"][:12]}],
                               "Per-item cache: T·M tokens of width d, payload bytes per item (BF16 = 2·T·M·d)")],
                      log="" if result.skipped else f"index-cache: {result.accepted} caches of {per_item} bytes "
                      f"each ({sum(items.rejected.values())} items not indexed: {items.rejected})")
