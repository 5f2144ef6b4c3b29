"""The vedje-features stage: frame features, items and queries of the motion clips."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from models.backends.registry import spec_lineage
from models.specs import ModelSpec
from rde.vedje.data import ItemSet
from rde.vedje.features import FRAME_FEATURES, ITEMS, QUERIES, build_tables
from rde.vedje.model_store import backbone_spec, source_items, source_rejects, stage1_spec
from storage.schemas import REJECTS
from tasks.framework.reporting import Progress
from tasks.framework.stage import Lineage, Resources, Stage, StageRun, Work, Write


@dataclass(frozen=True)
class VedjeSource:
    """The items ``lineage`` read, and the backbone and stage-1 expert that encode them."""

    items: ItemSet
    backbone: ModelSpec
    stage1: ModelSpec


class VedjeFeatures(Stage):
    """Frozen backbone patch features per frame, stage-1 item and query embeddings of the profile's
    ``vedje.source`` items (clips, or a build-largefine run's captions)."""

    name = "vedje-features"
    version = "1"
    writes = (Write("vedje_frames", "vedje_frames", FRAME_FEATURES), Write("vedje_items", "vedje_items", ITEMS),
              Write("vedje_queries", "vedje_queries", QUERIES),
              Write("vedje_rejects", "rejects", REJECTS, rejects=True))
    config = ("vedje.source", "vedje.clips_path", "vedje.source_flow", "vedje.test_share", "vedje.seed",
              "vedje.backbone", "vedje.first_stage")
    resources = Resources(device="gpu", hold_slot=False)
    balance = True
    main = "vedje_items"
    prepares = VedjeSource
    title = "Items with frozen features (accepted) and items left out with their reason"

    def lineage(self, run: StageRun) -> Lineage:
        items, upstream = source_items(run.ctx.profile, run.ctx.output_root)
        backbone, stage1 = backbone_spec(run.ctx.profile), stage1_spec(run.ctx.profile)
        run.prepared = VedjeSource(items, backbone, stage1)
        return Lineage(models={"backbone": spec_lineage(backbone), "stage1": run.registry().lineage(stage1)},
                       extra={"source": [a.manifest().fingerprint for a in upstream]}, upstream=upstream)

    def run(self, run: StageRun) -> Work:
        source: VedjeSource = run.prepared
        items = source.items
        reg = run.registry()
        with Progress(f"{run.ctx.flow_name}-features-progress", "vedje-features: frames encoded",
                      stage="vedje-features", total=len(items.frame_keys()), unit="frames") as progress:
            frames, item_tb, query_tb = build_tables(items, reg.image_embedder(source.backbone),
                                                     reg.expert(source.stage1), on_batch=progress.update)
        stats = {"input_rows": items.input_rows, "accepted": len(items.item_ids),
                 "rejected": dict(items.rejected), "splits": dict(Counter(items.splits)),
                 "frames": frames.num_rows, "queries": query_tb.num_rows}
        return Work.one({"vedje_frames": frames, "vedje_items": item_tb, "vedje_queries": query_tb,
                         "vedje_rejects": source_rejects(items)}, stats)
