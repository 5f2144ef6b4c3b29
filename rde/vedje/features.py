"""Frozen inputs of the cached reranker: backbone patch features per frame (X_t), stage-1 item
embeddings (a clip's = the normalised mean of its frames') and stage-1 query embeddings; with the
Parquet tables that hold them between stages (features in float16 to halve the bytes)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models.backends.interfaces import ImageEmbedder, TextImageExpert, l2_normalize
from rde.vedje.data import ItemSet
from rde.vedje.training import VedjeTensors

VEC = pa.list_(pa.float32())
FRAME_FEATURES = pa.schema([pa.field("frame_key", pa.string(), nullable=False),
                            pa.field("patches", pa.int32(), nullable=False),
                            pa.field("dim", pa.int32(), nullable=False),
                            pa.field("features", pa.binary(), nullable=False),  # float16, patches × dim
                            pa.field("stage1", VEC, nullable=False)])  # stage-1 image embedding of the frame
ITEMS = pa.schema([pa.field("item_id", pa.string(), nullable=False), pa.field("group", pa.string(), nullable=False),
                   pa.field("split", pa.string(), nullable=False),
                   pa.field("frame_keys", pa.list_(pa.string()), nullable=False),
                   pa.field("embedding", VEC, nullable=False)])
QUERIES = pa.schema([pa.field("query_id", pa.int32(), nullable=False), pa.field("item_id", pa.string(), nullable=False),
                     pa.field("split", pa.string(), nullable=False), pa.field("text", pa.string(), nullable=False),
                     pa.field("embedding", VEC, nullable=False)])


def frame_feature_rows(keys: list[str], images: list[np.ndarray], backbone: ImageEmbedder,
                       stage1: TextImageExpert) -> pa.Table:
    """Backbone feature maps and stage-1 embeddings of these frames."""
    maps = backbone.feature_maps(images).astype(np.float16)
    emb = stage1.encode_image(images)
    return pa.Table.from_pylist([{"frame_key": k, "patches": int(m.shape[0]), "dim": int(m.shape[1]),
                                  "features": m.tobytes(), "stage1": e.tolist()}
                                 for k, m, e in zip(keys, maps, emb, strict=True)], schema=FRAME_FEATURES)


def item_embeddings(frames: Sequence[Sequence[str]], frame_stage1: dict[str, np.ndarray]) -> np.ndarray:
    """Stage-1 item embeddings: the normalised mean of each item's frame embeddings (one row per
    item). The mean adds the frames in key order, not in the item's frame order: a float sum depends
    on its order, and a frame average must not, so a clip and its time-reversed copy get the same bits."""
    return l2_normalize(np.stack([np.mean([frame_stage1[k] for k in sorted(f)], axis=0) for f in frames]))


def item_and_query_rows(items: ItemSet, frame_stage1: dict[str, np.ndarray], stage1: TextImageExpert
                        ) -> tuple[pa.Table, pa.Table]:
    """Item rows (with ``item_embeddings``) and query rows."""
    emb = item_embeddings(items.frames, frame_stage1)
    item_tb = pa.Table.from_pylist([{"item_id": i, "group": g, "split": s, "frame_keys": f, "embedding": e.tolist()}
                                    for i, g, s, f, e in zip(items.item_ids, items.groups, items.splits, items.frames,
                                                             emb, strict=True)], schema=ITEMS)
    q = stage1.encode_text(items.query_texts)
    pairs = enumerate(zip(items.query_texts, items.query_items, strict=True))
    query_tb = pa.Table.from_pylist([{"query_id": k, "item_id": items.item_ids[i], "split": items.splits[i],
                                      "text": t, "embedding": q[k].tolist()} for k, (t, i) in pairs], schema=QUERIES)
    return item_tb, query_tb


def tensors_from_tables(frames: pa.Table, item_tb: pa.Table, query_tb: pa.Table,
                        load_frames: Callable | None = None) -> VedjeTensors:
    """Rebuild the in-memory training inputs from the three tables."""
    fr = frames.to_pylist()
    index = {r["frame_key"]: k for k, r in enumerate(fr)}
    p, d = fr[0]["patches"], fr[0]["dim"]
    feats = torch.from_numpy(np.stack([np.frombuffer(r["features"], np.float16).reshape(p, d) for r in fr]))
    it, qs = item_tb.to_pylist(), query_tb.to_pylist()
    item_index = {r["item_id"]: k for k, r in enumerate(it)}
    items = ItemSet([r["item_id"] for r in it], [r["group"] for r in it], [r["split"] for r in it],
                    [r["frame_keys"] for r in it], [r["text"] for r in qs], [item_index[r["item_id"]] for r in qs],
                    load_frames or (lambda keys: {}))
    return VedjeTensors(items, feats, torch.tensor([[index[k] for k in r["frame_keys"]] for r in it]),
                        torch.tensor([r["embedding"] for r in it]), torch.tensor([r["embedding"] for r in qs]))


def build_tables(items: ItemSet, backbone: ImageEmbedder, stage1: TextImageExpert, batch: int = 64,
                 on_batch: Callable[[int, int], None] | None = None) -> tuple[pa.Table, pa.Table, pa.Table]:
    """(frame features, items, queries) for an item set, frames decoded and encoded ``batch`` at a time;
    ``on_batch(frames done, frames in all)`` after each batch."""
    keys = items.frame_keys()
    parts = []
    for s in range(0, len(keys), batch):
        chunk = keys[s:s + batch]
        images = items.load_frames(chunk)
        parts.append(frame_feature_rows(chunk, [images[k] for k in chunk], backbone, stage1))
        if on_batch is not None:
            on_batch(min(s + batch, len(keys)), len(keys))
    frames = pa.concat_tables(parts)
    first = {r["frame_key"]: np.asarray(r["stage1"], np.float32)
             for r in frames.select(["frame_key", "stage1"]).to_pylist()}
    return (frames, *item_and_query_rows(items, first, stage1))


def cached_tensors(profile: Any, stage1_backend: str | None = None) -> VedjeTensors:
    """The frozen inputs of the profile's ``vedje.source`` under its models, with the stage-1 expert of
    that backend name (default: ``vedje.first_stage`` or the first expert), computed once and kept in
    ``.rde/cache/vedje_<source>_<backend>/`` (experiments and benchmarks share them). The caller loads
    the profile (``rde.profile.load_profile(name, {"vedje": {"source": source}})``): pipeline logic
    never imports the profile module, which sits above it."""
    import pyarrow.parquet as pq

    from models.backends.registry import ModelRegistry
    from rde.vedje.data import load_items
    from storage.locations import flow_root, state_dir

    names = ("frames", "items", "queries")
    source = profile.vedje.source
    stage1 = profile.vedje.first_stage or profile.models.experts[0]
    if stage1_backend is not None:
        stage1 = next(s for s in profile.models.experts if s.backend == stage1_backend)
    folder = state_dir() / "cache" / f"vedje_{source}_{stage1.backend}"
    source_root = flow_root(profile.artifacts_root, profile.vedje.source_flow, profile.name)
    items = load_items(profile, source_root if source == "largefine" else None)
    if not all((folder / f"{n}.parquet").exists() for n in names):
        reg = ModelRegistry.of(profile)
        tables = build_tables(items, reg.image_embedder(), reg.expert(stage1))
        folder.mkdir(parents=True, exist_ok=True)
        for n, t in zip(names, tables, strict=True):
            pq.write_table(t, folder / f"{n}.parquet")
    return tensors_from_tables(*(pq.read_table(folder / f"{n}.parquet") for n in names), load_frames=items.load_frames)
