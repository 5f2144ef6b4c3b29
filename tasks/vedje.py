"""Stages of the cached joint reranker: ``train-vedje`` (frozen features → trained compressor +
reranker), ``index-cache`` (backbone + trained compressor → per-item caches and the stage-1 index)
and ``rerank`` (stage-1 search → cache fetch → joint scoring)."""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from models.backends.registry import BUNDLED_IMAGE_EMBEDDER, spec_lineage
from models.reranker.cache_store import CACHE, CacheIndex, cache_rows
from models.reranker.vedje import Vedje
from models.specs import ModelSpec
from rde.common.reasons import rejected_row
from rde.vedje.data import ItemSet, clip_spans, load_items
from rde.vedje.features import FRAME_FEATURES, ITEMS, QUERIES, build_tables, item_embeddings, tensors_from_tables
from rde.vedje.training import (
    VedjeTensors,
    build_model,
    evaluate_rerank,
    joint_scores,
    recall_at,
    stored_caches,
    train_config,
    train_vedje,
)
from storage import Artifact
from storage.schemas import REJECTS
from tasks import sharded
from tasks.context import RunContext
from tasks.reporting import Progress, log, rounded_rows
from tasks.sharded import StageResult
from tasks.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write
from tasks.training import LOG, step_log_table

RECALL = pa.schema([pa.field("ranking", pa.string(), nullable=False), pa.field("n_candidates", pa.int32()),
                    pa.field("metric", pa.string(), nullable=False), pa.field("value", pa.float64(), nullable=False),
                    pa.field("queries", pa.int32()), pa.field("gallery", pa.int32()),
                    pa.field("precision", pa.string())])
STAGE1_INDEX = pa.schema([pa.field("item_id", pa.string(), nullable=False), pa.field("group", pa.string()),
                          pa.field("split", pa.string()),
                          pa.field("embedding", pa.list_(pa.float32()), nullable=False)])
RERANKED = pa.schema([pa.field("query_id", pa.int32(), nullable=False), pa.field("text", pa.string(), nullable=False),
                      pa.field("rank", pa.int32(), nullable=False), pa.field("item_id", pa.string(), nullable=False),
                      pa.field("stage1_rank", pa.int32(), nullable=False),
                      pa.field("stage1_score", pa.float64(), nullable=False),
                      pa.field("score", pa.float64(), nullable=False), pa.field("relevant", pa.bool_())])


def _backbone_spec(ctx: RunContext):
    return ctx.profile.vedje.backbone or ctx.profile.models.image_embedder or BUNDLED_IMAGE_EMBEDDER


def _stage1_spec(ctx: RunContext):
    p = ctx.profile
    if p.vedje.first_stage is None and not p.models.experts:
        raise ValueError("vedje needs a stage-1 expert: set vedje.first_stage or models.experts")
    return p.vedje.first_stage or p.models.experts[0]


def _source(ctx: RunContext) -> tuple[ItemSet, list[Artifact]]:
    v = ctx.profile.vedje
    if v.source == "clips":
        from storage.locations import resolve_location

        root = resolve_location(v.clips_path)
        return load_items(ctx.profile), [Artifact(f"{root}/clips")]
    root = RunContext(ctx.profile, v.source_flow, ctx.output_root).root
    return load_items(ctx.profile, root), [Artifact(f"{root}/largefine")]


def _rejects(items: ItemSet) -> pa.Table:
    detail = {"split_gap": "clip between the train and test periods (so no test frame is trained on)"}
    return pa.Table.from_pylist([rejected_row(f"{reason}:{k}", "vedje-features", reason, kind="item",
                                              detail=detail.get(reason))
                                 for reason, n in items.rejected.items() for k in range(n)], schema=REJECTS)


class VedjeFeatures(Stage):
    """Frozen backbone patch features per frame, stage-1 item and query embeddings of the profile's
    ``vedje.source`` items (clips, or a build-largefine run's captions)."""

    name = "vedje-features"
    version = "1"
    writes = (Write("frames", "vedje_frames", FRAME_FEATURES, folder="vedje_frames"),
              Write("items", "vedje_items", ITEMS, folder="vedje_items"),
              Write("queries", "vedje_queries", QUERIES, folder="vedje_queries"),
              Write("rejects", "rejects", REJECTS, folder="vedje_rejects", rejects=True))
    config = ("vedje.source", "vedje.clips_path", "vedje.source_flow", "vedje.test_share", "vedje.seed")
    resources = Resources(device="gpu", hold_slot=False)
    balance = True
    main = "items"
    title = "Items with frozen features (accepted) and items left out with their reason"

    def lineage(self, run: StageRun) -> Lineage:
        items, upstream = _source(run.ctx)
        backbone, stage1 = _backbone_spec(run.ctx), _stage1_spec(run.ctx)
        run.prepared.update(items=items, backbone=backbone, stage1=stage1)
        return Lineage(models={"backbone": spec_lineage(backbone), "stage1": run.registry().lineage(stage1)},
                       extra={"source": [a.manifest().fingerprint for a in upstream]}, upstream=upstream)

    def run(self, run: StageRun) -> Work:
        items: ItemSet = run.prepared["items"]
        reg = run.registry()
        with Progress(f"{run.ctx.flow_name}-features-progress", "vedje-features: frames encoded",
                      stage="vedje-features", total=len(items.frame_keys()), unit="frames") as progress:
            frames, item_tb, query_tb = build_tables(items, reg.image_embedder(run.prepared["backbone"]),
                                                     reg.expert(run.prepared["stage1"]), on_batch=progress.update)
        stats = {"input_rows": items.input_rows, "accepted": len(items.item_ids),
                 "rejected": dict(items.rejected), "splits": dict(Counter(items.splits)),
                 "frames": frames.num_rows, "queries": query_tb.num_rows}
        return Work.one({"frames": frames, "items": item_tb, "queries": query_tb, "rejects": _rejects(items)}, stats)


def load_tensors(urls: dict[str, str]) -> VedjeTensors:
    """The features artifacts (``frames``, ``items``, ``queries`` → their URLs) as training tensors."""
    return tensors_from_tables(*(pa.concat_tables([t for _, t in Artifact(urls[n]).iter_shards()])
                                 for n in ("frames", "items", "queries")))


def model_folder(ctx: RunContext) -> Path:
    """Where ``train-vedje`` keeps the weights (``model.pt``) and their description (``model.json``)."""
    return Path(RunContext(ctx.profile, "train-vedje", ctx.output_root).artifact_url("vedje_model"))


def save_model(model: Vedje, folder: Path, ctx: RunContext, item_dim: int) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    spec = ctx.profile.vedje
    meta = {"shape": asdict(model.shape), "item_dim": item_dim, "joint_encoder": spec.joint_encoder.model_dump(),
            "max_text_tokens": spec.max_text_tokens, "cache_lineage": cache_lineage(model, ctx)}
    tmp = folder / "model.pt.tmp"
    torch.save(model.state_dict(), tmp)
    tmp.replace(folder / "model.pt")
    (folder / "model.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


def cache_lineage(model: Vedje, ctx: RunContext) -> dict[str, Any]:
    """What a cache written by this model depends on: backbone, compressor weights, layout."""
    return {"backbone": spec_lineage(_backbone_spec(ctx)), "compressor": model.compressor_fingerprint(),
            "frames": model.shape.frames, "tokens_per_frame": model.shape.tokens_per_frame, "dim": model.reranker.d}


def load_model(ctx: RunContext) -> tuple[Vedje, dict[str, Any]]:
    """The trained model of this profile's ``train-vedje`` run (clear error when there is none)."""
    folder = model_folder(ctx)
    if not (folder / "model.json").exists():
        raise FileNotFoundError(f"no trained reranker at {folder}: run `rde train-vedje --profile "
                                f"{ctx.profile.name}` first")
    meta = json.loads((folder / "model.json").read_text())
    shape = {"compressor_norm": "post"} | meta["shape"]  # models saved before the option were post-norm
    trained = ModelSpec(**{**meta["joint_encoder"], "device": ctx.profile.vedje.joint_encoder.device})
    spec = ctx.profile.vedje.model_copy(update={"joint_encoder": trained, "max_text_tokens": meta["max_text_tokens"]})
    model = build_model(spec, shape["d_v"], shape["patches"], shape["frames"], meta["item_dim"],
                        **{k: v for k, v in shape.items() if k not in ("d_v", "patches", "frames")}
                        | {"horizons": tuple(shape["horizons"])})
    model.load_state_dict(torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    return model, meta


class VedjeTrain(Stage):
    """Train (resuming per epoch), evaluate stage 1 vs rerank on the test split, save the model. Its
    input is the training split's queries, counted from the ``vedje_queries`` artifact's ``split``
    column; accepted are those the trainer was given: a query its loader drops fails the stage."""

    name = "vedje-train"
    version = "1"
    reads = ("vedje_frames", "vedje_items", "vedje_queries")
    writes = (Write("log", "training_log", LOG, folder="vedje_log"),
              Write("evaluation", "evaluation", RECALL, folder="vedje_evaluation"))
    config = ("vedje",)
    resources = Resources(device="gpu", hold_slot=False, batch_size="vedje.batch_size")
    main = "log"
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        frozen = None  # the compressor kept from the previous run is an input when it is not retrained
        if not run.section("vedje").train_compressor:
            meta_file = model_folder(run.ctx) / "model.json"
            if not meta_file.exists():
                raise FileNotFoundError(f"vedje.train_compressor=false keeps the previous compressor, but there is "
                                        f"no trained model at {meta_file.parent}: run `rde train-vedje` once first")
            frozen = json.loads(meta_file.read_text())["cache_lineage"]["compressor"]
        return Lineage(extra={"frozen_compressor": frozen})

    def run(self, run: StageRun) -> Work:
        ctx, spec = run.ctx, run.section("vedje")
        cfg, folder = train_config(spec), model_folder(ctx)
        data = load_tensors({n: run.input(f"vedje_{n}").url for n in ("frames", "items", "queries")})
        torch.manual_seed(spec.seed)
        model = build_model(spec, data.frame_features.shape[2], data.frame_features.shape[1],
                            data.item_frames.shape[1], data.item_emb.shape[1])
        run_cfg = cfg
        if not spec.train_compressor:
            previous, _ = load_model(ctx)
            model.compressor.load_state_dict(previous.compressor.state_dict())
            model.compressor.requires_grad_(False)
            run_cfg = replace(cfg, losses=tuple(t for t in cfg.losses if t != "delta"))
            log(f"vedje-train: compressor {model.compressor_fingerprint()[:12]} kept frozen (caches stay valid)")
        with Progress(f"{ctx.flow_name}-train-progress", "vedje-train: training steps done", stage="vedje-train",
                      total=None, unit="steps") as progress:
            result = train_vedje(model, data, run_cfg, folder / "checkpoints" / run.key[:16],
                                 on_epoch=lambda e, loss: log(f"vedje-train: epoch {e} mean loss {loss:.4f}"),
                                 on_step=progress.update)
        meta = save_model(model, folder, ctx, data.item_emb.shape[1])
        rows = []
        for precision in ("bf16", "fp8", "fp4"):
            rows += [{**r, "precision": precision} for r in evaluate_rerank(
                model, data, stored_caches(model, data, precision), spec.candidates, batch=spec.score_batch)]
        n_train = len(data.rows("train")[1])
        stats = {"input_rows": run.input("vedje_queries").count_equal("split", "train"), "accepted": n_train,
                 "rejected": {}, "resumed_from_epoch": result.resumed_from,
                 "epoch_loss": [round(v, 5) for v in result.epoch_loss], "seconds": round(result.seconds, 1),
                 "vtm_share": round(result.vtm_share, 4),
                 "compressor": meta["cache_lineage"]["compressor"]}
        return Work.one({"log": step_log_table(result.step_losses),
                         "evaluation": pa.Table.from_pylist(rows, schema=RECALL)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        folder = model_folder(run.ctx)
        evaluation = run.output_artifact("evaluation").rows()
        losses = result.stats.get("epoch_loss", [])
        loss = "\n".join(["# train-vedje: loss per epoch", "", "| epoch | loss |", "|---|---|",
                          *[f"| {i} | {v:.4f} |" for i, v in enumerate(losses)], "",
                          f"Weights: `{folder / 'model.pt'}`"])
        return Report(tables=[("evaluation", rounded_rows(evaluation, 2),
                               "Stage-1 vs VEDJE rerank on the test split: R@1/5/10 per N_c and cache precision")],
                      markdown=[("loss", loss, "VEDJE training loss")],
                      log=f"vedje-train: {len(evaluation)} evaluation rows; model in {folder}")


class IndexCache(Stage):
    """Offline indexing (Alg. 1, lines 2–5), one Prefect task per shard of items: frames → frozen
    backbone → trained compressor → encoded cache rows; plus the items' stage-1 index rows."""

    name = "index-cache"
    version = "1"
    writes = (Write("cache", "vedje_cache", CACHE), Write("index", "stage1_index", STAGE1_INDEX, folder="stage1_index"))
    config = ("vedje.source", "vedje.clips_path", "vedje.source_flow", "vedje.test_share", "vedje.seed",
              "vedje.precision", "vedje.shard_size")
    resources = Resources(device="gpu")
    balance = True

    def lineage(self, run: StageRun) -> Lineage:
        model, _meta = load_model(run.ctx)
        lineage = cache_lineage(model, run.ctx)
        items, upstream = _source(run.ctx)
        backbone, stage1 = _backbone_spec(run.ctx), _stage1_spec(run.ctx)
        run.prepared.update(model=model, lineage=lineage, items=items, backbone=backbone, stage1=stage1)
        return Lineage(models={"backbone": spec_lineage(backbone), "stage1": run.registry().lineage(stage1)},
                       extra={"source": [a.manifest().fingerprint for a in upstream], "cache_lineage": lineage},
                       upstream=upstream)

    def shard_count(self, run: StageRun) -> int:
        return max(1, -(-len(run.prepared["items"].item_ids) // run.section("vedje").shard_size))

    def process(self, run: StageRun, index: int) -> Work:
        spec, items, model = run.section("vedje"), run.prepared["items"], run.prepared["model"]
        rows = range(index * spec.shard_size, min(len(items.item_ids), (index + 1) * spec.shard_size))
        keys = sorted({k for r in rows for k in items.frames[r]})
        images = items.load_frames(keys)
        reg = run.registry()
        start = time.perf_counter()
        maps = torch.from_numpy(reg.image_embedder(run.prepared["backbone"]).feature_maps([images[k] for k in keys]))
        where = {k: i for i, k in enumerate(keys)}
        x = maps[torch.tensor([[where[k] for k in items.frames[r]] for r in rows])]
        caches = model.index(x).numpy()
        seconds = time.perf_counter() - start
        emb = dict(zip(keys, reg.expert(run.prepared["stage1"]).encode_image([images[k] for k in keys]), strict=True))
        ids = [items.item_ids[r] for r in rows]
        item_emb = item_embeddings([items.frames[r] for r in rows], emb)
        index_rows = [{"item_id": items.item_ids[r], "group": items.groups[r], "split": items.splits[r],
                       "embedding": e.tolist()} for r, e in zip(rows, item_emb, strict=True)]
        cache_tb = cache_rows(ids, caches, model.shape.frames, model.shape.tokens_per_frame, spec.precision)
        # input: the items of this shard; accepted: the cache rows written for them
        return Work.one({"cache": cache_tb, "index": pa.Table.from_pylist(index_rows, schema=STAGE1_INDEX)},
                        {"input_rows": len(rows), "accepted": cache_tb.num_rows, "rejected": {},
                         "index_seconds": seconds})

    def report(self, run: StageRun, result: StageResult) -> Report:
        spec, model, lineage = run.section("vedje"), run.prepared["model"], run.prepared["lineage"]
        art = run.output_artifact("cache")
        per_item = art.read_shard(0, ["payload_bytes"]).column("payload_bytes")[0].as_py() if art.count_rows() else 0
        items = run.prepared["items"]
        return Report(tables=[("cache", [{"items": art.count_rows(), "precision": spec.precision,
                                          "tokens": model.cache_tokens, "dim": model.reranker.d,
                                          "payload_bytes_per_item": per_item,
                                          "compressor": lineage["compressor"][:12]}],
                               "Per-item cache: T·M tokens of width d, payload bytes per item (BF16 = 2·T·M·d)")],
                      log="" if result.skipped else f"index-cache: {result.accepted} caches of {per_item} bytes "
                      f"each ({sum(items.rejected.values())} items not indexed: {items.rejected})")


class Rerank(Stage):
    """Online reranking (Alg. 1, lines 6–13) for the given queries, or for the test split's captions
    (then with R@K of stage 1 vs rerank at each N_c); the caches must match the model's lineage."""

    name = "rerank"
    version = "1"
    writes = (Write("reranked", "reranked", RERANKED),
              Write("evaluation", "evaluation", RECALL, folder="rerank_evaluation"))
    config = ("vedje.candidates", "vedje.score_batch", "vedje.score_path")
    balance = True

    def __init__(self, queries: list[str] | None = None) -> None:
        self.queries = queries

    def lineage(self, run: StageRun) -> Lineage:
        ctx = run.ctx
        model, meta = load_model(ctx)
        idx_ctx = RunContext(ctx.profile, "index-cache", ctx.output_root)
        cache = CacheIndex(idx_ctx.artifact_url("cache"), meta["cache_lineage"])
        index_art = Artifact(idx_ctx.artifact_url("stage1_index"))
        indexed_with = index_art.manifest().models.get("stage1")
        if indexed_with != run.registry().lineage(_stage1_spec(ctx)):
            raise ValueError(f"the stage-1 index at {index_art.url} was built with another stage-1 expert "
                             f"({(indexed_with or {}).get('model_id')!r}, profile now "
                             f"{_stage1_spec(ctx).model_id!r}): run `rde index-cache` again")
        run.prepared.update(model=model, cache=cache, index_art=index_art)
        return Lineage(extra={"cache": cache.fingerprint, "model": meta, "queries": self.queries},
                       upstream=[index_art])

    def run(self, run: StageRun) -> Work:
        ctx, spec = run.ctx, run.section("vedje")
        model, cache, index_art = run.prepared["model"], run.prepared["cache"], run.prepared["index_art"]
        n_max = max(spec.candidates)
        index_rows = index_art.rows()
        labelled = self.queries is None
        if labelled:
            train_ctx = RunContext(ctx.profile, "train-vedje", ctx.output_root)
            q_rows = [r for r in Artifact(train_ctx.artifact_url("vedje_queries")).rows(["item_id", "split", "text"])
                      if r["split"] == "test"]
            index_rows = [r for r in index_rows if r["split"] == "test"]
            texts = [r["text"] for r in q_rows]
        else:
            texts = list(self.queries or [])
        ids = [r["item_id"] for r in index_rows]
        emb = torch.tensor([r["embedding"] for r in index_rows])
        group = {r["item_id"]: r["group"] for r in index_rows}
        stage1 = run.registry().expert(_stage1_spec(ctx))
        out, latencies = [], []
        with Progress(f"{ctx.flow_name}-progress", "rerank: queries done", stage="rerank", total=len(texts),
                      unit="queries") as progress:
            for qi, text in enumerate(texts):
                start = time.perf_counter()
                q = torch.from_numpy(stage1.encode_text([text]))
                sims = (q @ emb.T)[0]
                top = torch.argsort(sims, descending=True, stable=True)[:n_max]
                cand = [ids[int(i)] for i in top]
                caches = cache.fetch(cand)
                s = joint_scores(model, [text], [(0, k) for k in range(len(cand))], caches, sims[top],
                                 spec.score_batch, spec.score_path)
                latencies.append(time.perf_counter() - start)
                order = np.argsort(-s, kind="stable")
                truth = group[q_rows[qi]["item_id"]] if labelled else None
                out += [{"query_id": qi, "text": text, "rank": r, "item_id": cand[j], "stage1_rank": int(j),
                         "stage1_score": float(sims[top[j]]), "score": float(s[j]),
                         "relevant": None if truth is None else group[cand[j]] == truth} for r, j in enumerate(order)]
                progress.update(qi + 1)
        evaluation = []
        if labelled and texts:
            evaluation = _recall_rows(out, len(texts), len(ids), spec.candidates)
        # input: the queries asked; accepted: the queries that got a ranked list
        stats = {"input_rows": len(texts), "accepted": len({r["query_id"] for r in out}), "rejected": {},
                 "median_query_ms": round(1000 * float(np.median(latencies)), 2) if latencies else None,
                 "cache_bytes_per_query": cache.stats.bytes // max(len(texts), 1)}
        return Work.one({"reranked": pa.Table.from_pylist(out, schema=RERANKED),
                         "evaluation": pa.Table.from_pylist(evaluation, schema=RECALL)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        evaluation = run.output_artifact("evaluation").rows()
        stats = result.stats
        tables = [("evaluation", rounded_rows(evaluation, 2),
                   "Stage-1 vs VEDJE rerank (R@K, test split) from the stored caches")] if evaluation else []
        return Report(tables=tables, log=f"rerank: {result.accepted} queries, median {stats.get('median_query_ms')} "
                                         f"ms/query, {stats.get('cache_bytes_per_query')} cache bytes read per query")


def _recall_rows(out: list[dict], n_queries: int, gallery: int, n_candidates: list[int]) -> list[dict[str, Any]]:
    """R@1/5/10 over the top-N_c lists (stage 1 order vs reranked) from the written rows."""
    by_q: dict[int, list[dict]] = {}
    for r in out:
        by_q.setdefault(r["query_id"], []).append(r)
    rows = []
    for n in sorted(set(n_candidates)):
        for name, key in (("stage-1", "stage1_rank"), ("rerank", None)):
            ranked = [[r["relevant"] for r in sorted((r for r in rs if r["stage1_rank"] < n),
                                                     key=lambda r: r["stage1_rank"] if key else -r["score"])]
                      for rs in by_q.values()]
            rows += [{"ranking": name, "n_candidates": min(n, gallery), "metric": f"R@{k}",
                      "value": recall_at(ranked, [True] * len(ranked), k), "queries": n_queries, "gallery": gallery,
                      "precision": None} for k in (1, 5, 10)]
    return rows


def top_results(ctx: RunContext, reranked_url: str, top: int) -> list[dict[str, Any]]:
    """Per query of a ``rerank`` run, its best ``top`` items (ranks 1-based): item id, score, stage-1
    rank and score, and for clips the time span (seconds when the clip set records its frame rate)."""
    spans = clip_spans(ctx.profile.vedje.clips_path) if ctx.profile.vedje.source == "clips" else {}
    queries: dict[int, dict[str, Any]] = {}
    for r in sorted(Artifact(reranked_url).rows(), key=lambda r: (r["query_id"], r["rank"])):
        entry = queries.setdefault(r["query_id"], {"query": r["text"], "results": []})
        if len(entry["results"]) < top:
            entry["results"].append({"rank": r["rank"] + 1, "item_id": r["item_id"], "score": r["score"],
                                     "stage1_rank": r["stage1_rank"] + 1, "stage1_score": r["stage1_score"],
                                     "span": spans.get(r["item_id"])})
    return list(queries.values())


def _source_count(ctx: RunContext) -> int:
    """The profile's items counted from the source artifact itself (the input of the balance check)."""
    v = ctx.profile.vedje
    if v.source == "clips":
        from storage.locations import resolve_location

        return Artifact(f"{resolve_location(v.clips_path)}/clips").count_rows()
    root = RunContext(ctx.profile, v.source_flow, ctx.output_root).root
    return len({r["image_id"] for r in Artifact(f"{root}/largefine").rows(["image_id"])})


def summary(ctx: RunContext, results: list[sharded.StageResult]) -> dict[str, Any]:
    """The run summary; for ``train-vedje`` the balance counts the source's items independently."""
    from tasks.training import training_summary

    counted = _source_count(ctx) if results[0].stage == "vedje-features" else None
    return training_summary(ctx, results, counted)
