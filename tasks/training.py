"""Training stages shared by ``train-saft`` and ``train-gtr``: cached features of the training pairs
(from a ``build-largefine`` run), training with per-epoch checkpoints, evaluation, loss curves."""

from __future__ import annotations

import io
import json
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from models.backends.registry import models_lineage
from models.backends.torch_runtime import resolve_device
from models.retrieval.dual_encoder import FeatureDualEncoder, HFClipDualEncoder
from rde.common.caption_source import finished_captions
from rde.common.expert_check import (
    CheckSet,
    gallery_pool_ids,
    held_out_identities,
    load_check_set,
    load_check_yaml,
    relevance_lists,
)
from rde.common.image_decoding import decode_rgb, decoded_images
from rde.common.metrics import mean_ap_at_k, person_search_over_vectors
from rde.common.reasons import Reason
from rde.common.seeds import draw_seed
from rde.training.pair_stream import (
    FEATURE_PAIRS_KIND,
    PairIndex,
    StreamedPairs,
    StreamedTraining,
    held_out_embeddings,
    to_device,
)
from rde.training.retrieval_features import image_features
from rde.training.retrieval_training import (
    EpochRecord,
    TrainConfig,
    TrainingPairs,
    TrainResult,
    train,
    train_data_parallel,
)
from storage import Artifact
from storage.filesystem import join
from storage.locations import resolve_location
from storage.schemas import EVALUATION, TRAINING_FEATURE_PAIRS, TRAINING_PAIRS
from tasks import sharded
from tasks.context import RunContext
from tasks.reporting import Progress, accounting_line, inline_png, publish_markdown, rounded_rows, split_name
from tasks.runner import run_pipeline
from tasks.sharded import StageResult
from tasks.stage import Lineage, Pipeline, Report, Resources, Stage, StageRun, Work, Write

VEC = pa.list_(pa.float32())
FEATURES = pa.schema([pa.field("kind", pa.string(), nullable=False),  # pair | image | gallery | query
                      pa.field("key", pa.string(), nullable=False), pa.field("index", pa.int32(), nullable=False),
                      pa.field("identity", pa.string()), pa.field("q_txt", pa.float64()), pa.field("text", pa.string()),
                      pa.field("vector", VEC, nullable=False), pa.field("teacher", VEC)])
LOG = pa.schema([pa.field("step", pa.int32(), nullable=False), pa.field("epoch", pa.int32(), nullable=False),
                 pa.field("terms", pa.string(), nullable=False)])


@contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Train on ``count`` torch threads (the float sums, and so the steps, do not depend on the
    machine's core count), then give the process back the count it had: later stages and other
    flows in the same process keep theirs."""
    before = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def step_log_table(step_losses: Sequence[dict[str, Any]]) -> pa.Table:
    """A training run's per-step losses as ``LOG`` rows (the loss terms as JSON), for SAFT, GTR+ and VEDJE."""
    return pa.Table.from_pylist([{"step": int(s["step"]), "epoch": int(s["epoch"]),
                                  "terms": json.dumps({k: v for k, v in s.items() if k not in ("step", "epoch")})}
                                 for s in step_losses], schema=LOG)


def _source_root(ctx: RunContext) -> str:
    """Where the source flow's artifacts are: same artifacts root (or --output) as this run."""
    return RunContext(ctx.profile, ctx.profile.training.source_flow, ctx.output_root).root


def _decoded_images(source_root: str, image_ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The source run's accepted images with these ids, decoded (``decoded_images``: ids first, then
    the bytes of only the shards holding one of them)."""
    return decoded_images(Artifact(f"{source_root}/accepted"), image_ids)


@dataclass(frozen=True)
class PairSelection:
    """Which captions train, decided in passes over the captions that keep scalars and identities,
    never the captions: a caption of a check-set identity is rejected (``check_set_identity``); with
    ``training.max_pairs`` the pairs with the smallest seeded keys are kept (``over_max_pairs`` for
    the rest); a seeded share of the kept pairs' identities is held out for the person search."""

    identity: dict[str, str | None]
    check_ids: set[str]
    cutoff: int | None  # keep a pair whose key is at most this (None: every pair)
    held: set[str]
    seed: int

    def key(self, image_id: str, text: str) -> int:
        return draw_seed(self.seed, image_id + text)

    def verdict(self, image_id: str, text: str) -> str:
        """train | heldout | a reason."""
        person = self.identity.get(image_id)
        if person in self.check_ids:
            return str(Reason.CHECK_SET_IDENTITY)
        if self.cutoff is not None and self.key(image_id, text) > self.cutoff:
            return str(Reason.OVER_MAX_PAIRS)
        return "heldout" if person in self.held else "train"

    @classmethod
    def of(cls, run: StageRun, captions: Artifact) -> PairSelection:
        p, t, src = run.ctx.profile, run.section("training"), run.prepared["src"]
        identity = {r["image_id"]: r["identity"] for r in Artifact(f"{src}/neighbours").rows(["image_id", "identity"])}
        check_ids = {i for f in p.evaluation.check_sets
                     for i in held_out_identities(load_check_yaml(Path(resolve_location(f))))}

        def candidates() -> Iterator[tuple[str, str]]:
            for _, table in captions.iter_shards(["image_id", "text"]):
                yield from zip(table.column("image_id").to_pylist(), table.column("text").to_pylist(), strict=True)

        selection = cls(identity, check_ids, None, set(), t.seed)
        if t.max_pairs is not None:  # the seeded keys of the candidates, 8 bytes each
            keys = np.fromiter((selection.key(i, text) for i, text in candidates() if identity.get(i) not in check_ids),
                               dtype=np.uint64)
            if len(keys) > t.max_pairs:
                cutoff = int(np.partition(keys, t.max_pairs - 1)[t.max_pairs - 1])
                selection = cls(identity, check_ids, cutoff, set(), t.seed)
        people = sorted({identity[i] for i, text in candidates()
                         if selection.verdict(i, text) == "train" and identity.get(i)})
        rng = np.random.default_rng(t.seed)
        held = set(rng.choice(people, size=max(1, int(t.held_out_share * len(people))), replace=False).tolist()) \
            if len(people) > 1 else set()
        return cls(identity, check_ids, selection.cutoff, held, t.seed)


class PairCounts:
    """The captions a pass read, by verdict: the stage's input, splits and rejects."""

    def __init__(self) -> None:
        self.read, self.splits, self.rejected = 0, {"train": 0, "held_out": 0}, Counter()

    def add(self, verdict: str) -> int | None:
        """Count one caption: its pair id within its split (0, 1, ... in reading order) when it
        trains or is held out, else None."""
        self.read += 1
        if verdict in ("train", "heldout"):
            split = "train" if verdict == "train" else "held_out"
            self.splits[split] += 1
            return self.splits[split] - 1
        self.rejected[verdict] += 1
        return None

    def stats(self) -> dict[str, Any]:
        return {"input_rows": self.read, "accepted": sum(self.splits.values()), "splits": dict(self.splits),
                "rejected": dict(self.rejected)}


def image_key(image_id: str) -> int:
    """A 63-bit key equal for the pairs of one image (the ITM hard negative skips them)."""
    return draw_seed(0, image_id)


Layout = Literal["features", "feature_pairs", "pairs"]
LAYOUTS: dict[str, tuple[str, pa.Schema]] = {  # layout → the artifact's kind and schema
    "features": ("training_features", FEATURES), "feature_pairs": (FEATURE_PAIRS_KIND, TRAINING_FEATURE_PAIRS),
    "pairs": ("training_pairs", TRAINING_PAIRS)}


def features_layout(ctx: RunContext, captions: int) -> Layout:
    """How the training-features stage writes (``TrainingFeatures``): images for a CLIP-like student;
    the CPU model's features in memory, or streamed above ``training.stream_above`` captions."""
    t = ctx.profile.training
    if t.model is not None:
        return "pairs"
    return "feature_pairs" if t.stream_above is not None and captions > t.stream_above else "features"


@dataclass
class CaptionShard:
    """One shard of captions that train or are held out (each with its ``split`` and its ``pair`` id
    within the split), with their images' encoded bytes."""

    caps: list[dict[str, Any]]
    encoded: dict[str, bytes]


class TrainingFeatures(Stage):
    """The training pairs of the profile's ``training.source_flow`` run (``build-largefine``) with the
    teacher's vectors, split into training pairs and pairs held out for person search, in one of
    three layouts (``features_layout``). ``features``, the CPU model's: cached tower features of
    every image's views and of the check sets' galleries and queries, one in-memory artifact with
    rows by ``kind``. ``feature_pairs``: the same features, streamed: a shard per shard of captions,
    a row per caption with its image's views (``TRAINING_FEATURE_PAIRS``). ``pairs``, a CLIP-like
    student's: a row per caption with its image's bytes (``TRAINING_PAIRS``). The streamed layouts
    hold one shard of captions and its images at a time."""

    name = "training-features"
    version = "3"  # 3: the streamed layouts; max_pairs keeps the captions' order
    config = ("training.source_flow", "training.views", "training.max_pairs", "training.model",
              "training.held_out_share", "training.seed", "evaluation.check_sets")
    resources = Resources(device="gpu", hold_slot=False)
    balance = True
    def __init__(self, layout: Layout = "features") -> None:
        self.layout = layout
        kind, schema = LAYOUTS[layout]
        self.writes = (Write("features", kind, schema, folder="training_features", shared=True),)

    def lineage(self, run: StageRun) -> Lineage:
        src = _source_root(run.ctx)
        captions = finished_captions(src, f"training (profile {run.profile_name})")
        run.prepared.update(src=src, captions=captions)
        return Lineage(models={"models": models_lineage(run.models)}, upstream=[captions],
                       extra={"captions": captions.manifest().fingerprint, "layout": self.layout})

    def run(self, run: StageRun) -> Work:
        selection = PairSelection.of(run, run.prepared["captions"])
        return self._in_memory(run, selection) if self.layout == "features" else self._streamed(run, selection)

    def _towers(self, run: StageRun, cpu_model: bool = True) -> tuple[Any, Any, Any]:
        """The semantic bridge and the image embedder (the CPU model's towers; None for a CLIP-like
        student) and the teacher."""
        p, registry = run.ctx.profile, run.registry()
        towers = (registry.expert(p.models.experts[0]), registry.image_embedder()) if cpu_model else (None, None)
        return (*towers, registry.expert(p.models.teacher or p.models.experts[-1]))

    def _in_memory(self, run: StageRun, selection: PairSelection) -> Work:
        p, t, src, captions = run.ctx.profile, run.section("training"), run.prepared["src"], run.prepared["captions"]
        bridge, embedder, teacher = self._towers(run)
        identity, counts = selection.identity, PairCounts()
        caps = [dict(r, split=v) for r in captions.rows(["image_id", "text", "q_txt"])
                if counts.add(v := selection.verdict(r["image_id"], r["text"])) is not None]
        image_ids = sorted({c["image_id"] for c in caps})
        images = _decoded_images(src, image_ids)
        feats = image_features([images[i] for i in image_ids], image_ids, bridge, embedder,
                               teacher, views=t.views, seed=t.seed)
        stacked = feats.stacked()
        rows = [{"kind": "image", "key": i, "index": v, "identity": identity.get(i), "q_txt": None, "text": None,
                 "vector": stacked[v, k].tolist(), "teacher": feats.teacher[k].tolist() if v == 0 else None}
                for k, i in enumerate(image_ids) for v in range(t.views)]
        text_vecs, teacher_txt = bridge.encode_text([c["text"] for c in caps]), teacher.encode_text(
            [c["text"] for c in caps])
        rows += [{"kind": "pair" if c["split"] == "train" else "heldout", "key": c["image_id"],
                  "index": k, "identity": identity.get(c["image_id"]), "q_txt": c["q_txt"], "text": c["text"],
                  "vector": text_vecs[k].tolist(), "teacher": teacher_txt[k].tolist()} for k, c in enumerate(caps)]
        for f, gallery, identities, queries, _ in check_set_features(p, bridge, embedder):
            rows += [{"kind": "gallery", "key": f, "index": k, "identity": ident, "q_txt": None, "text": None,
                      "vector": gallery[k].tolist(), "teacher": None} for k, ident in enumerate(identities)]
            rows += [{"kind": "query", "key": f, "index": k, "identity": None, "q_txt": None, "text": None,
                      "vector": v.tolist(), "teacher": None} for k, v in enumerate(queries)]
        return Work.one({"features": pa.Table.from_pylist(rows, schema=FEATURES)},
                        counts.stats() | {"images": len(image_ids), "views": t.views,
                                          "held_out_identities": len(selection.held)})

    def _caption_shards(self, run: StageRun, selection: PairSelection, stats: dict[str, Any]) -> Iterator[CaptionShard]:
        """The captions shard by shard, counted as read (into ``stats``), with their images' bytes
        read from the accepted shards that hold them."""
        accepted, counts = Artifact(f"{run.prepared['src']}/accepted"), PairCounts()
        where = {i: index for index, table in accepted.iter_shards(["image_id"])
                 for i in table.column("image_id").to_pylist()}
        for _, table in run.prepared["captions"].iter_shards(["image_id", "text", "q_txt"]):
            caps = [dict(r, split=v, pair=pair) for r in table.to_pylist()
                    if (pair := counts.add(v := selection.verdict(r["image_id"], r["text"]))) is not None]
            stats.update(counts.stats() | {"images": stats.get("images", 0) + len({c["image_id"] for c in caps})})
            if not caps:
                continue
            wanted: dict[int, set[str]] = {}
            for c in caps:
                wanted.setdefault(where[c["image_id"]], set()).add(c["image_id"])
            encoded = {i: b for index, ids in sorted(wanted.items())
                       for i, b in zip(*accepted.read_matching(index, "image_id", ids, ["image_id", "image_bytes"])
                                       .to_pydict().values(), strict=True)}
            yield CaptionShard(caps, encoded)

    def _streamed(self, run: StageRun, selection: PairSelection) -> Work:
        """A shard per shard of captions: its images decoded once, for the teacher (and the towers)."""
        p, t = run.ctx.profile, run.section("training")
        cached = self.layout == "feature_pairs"
        bridge, embedder, teacher = self._towers(run, cpu_model=cached)
        stats: dict[str, Any] = {"held_out_identities": len(selection.held)}
        schema = LAYOUTS[self.layout][1]
        if cached:
            stats["views"] = t.views

        def shards() -> Iterator[dict[str, pa.Table]]:
            for shard in self._caption_shards(run, selection, stats):
                image_ids = sorted(shard.encoded)
                decoded = [decode_rgb(shard.encoded[i]) for i in image_ids]
                texts = [c["text"] for c in shard.caps]
                if cached:
                    feats = image_features(decoded, image_ids, bridge, embedder, teacher, views=t.views, seed=t.seed)
                    stacked, teacher_vectors = feats.stacked(), feats.teacher
                    text_vectors = bridge.encode_text(texts)
                else:
                    teacher_vectors = teacher.encode_image(decoded)
                at = {i: k for k, i in enumerate(image_ids)}
                teacher_text = teacher.encode_text(texts)
                rows = []
                for k, c in enumerate(shard.caps):
                    i = c["image_id"]
                    row = {"split": c["split"], "pair": c["pair"], "image_id": i, "image_key": image_key(i),
                           "identity": selection.identity.get(i), "text": c["text"], "q_txt": c["q_txt"],
                           "teacher_image": teacher_vectors[at[i]].tolist(), "teacher_text": teacher_text[k].tolist()}
                    if cached:
                        row |= {"image_views": stacked[:, at[i]].tolist(), "text_vector": text_vectors[k].tolist()}
                    else:
                        row["image"] = shard.encoded[i]
                    rows.append(row)
                yield {"features": pa.Table.from_pylist(rows, schema=schema)}
            if cached:  # the check sets' gallery and queries, as one last shard
                rows = []
                for f, gallery, identities, queries, texts in check_set_features(p, bridge, embedder):
                    rows += [{"split": "gallery", "pair": k, "image_id": f, "image_key": 0, "identity": ident,
                              "image_views": [gallery[k].tolist()]} for k, ident in enumerate(identities)]
                    rows += [{"split": "query", "pair": k, "image_id": f, "image_key": 0, "text": texts[k],
                              "text_vector": v.tolist()} for k, v in enumerate(queries)]
                if rows:
                    yield {"features": pa.Table.from_pylist(rows, schema=schema)}

        return Work(shards(), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        return Report(log=f"training-features: {result.splits.get('train', 0)} training pairs, "
                          f"{result.splits.get('held_out', 0)} held out for person search, "
                          f"{sum(result.rejected.values())} not used {result.rejected or ''}")


def check_set_features(p: Any, bridge: Any, embedder: Any) -> Iterator[tuple[str, np.ndarray, list, np.ndarray,
                                                                             list[str]]]:
    """Per check set of the profile: (its name, the gallery's tower features (one view), the gallery's
    identities, the queries' bridge vectors, the queries)."""
    for f in p.evaluation.check_sets:
        check = load_check_set(resolve_location(p.evaluation.check_set_pool), Path(resolve_location(f)))
        gallery = image_features(check.gallery_images, [str(i) for i in range(len(check.gallery_images))],
                                 bridge, embedder, None, views=1).stacked()[0]
        yield f, gallery, list(check.gallery_identities), bridge.encode_text(check.queries), list(check.queries)


def load_training_data(url: str, ctx: RunContext) -> dict[str, Any]:
    """The features artifact as training pairs, held-out pairs and check sets: in memory (the CPU
    model's ``features`` layout), or streamed (``streamed_training_data``)."""
    if Artifact(url).manifest().kind != LAYOUTS["features"][0]:
        return streamed_training_data(url, ctx)
    rows = Artifact(url).rows()
    images = sorted({r["key"] for r in rows if r["kind"] == "image"})
    index = {i: k for k, i in enumerate(images)}
    first_teacher = next(r["teacher"] for r in rows if r["kind"] == "image" and r["teacher"] is not None)
    teacher_img = torch.zeros(len(images), len(first_teacher))
    for r in rows:
        if r["kind"] == "image" and r["teacher"] is not None:
            teacher_img[index[r["key"]]] = torch.tensor(r["teacher"])
    pairs = [r for r in rows if r["kind"] == "pair"]
    held = [r for r in rows if r["kind"] == "heldout"]
    q = torch.tensor([np.nan if r["q_txt"] is None else r["q_txt"] for r in pairs], dtype=torch.float32)
    pair_image = torch.tensor([index[r["key"]] for r in pairs])
    teacher_txt = torch.tensor([r["teacher"] for r in pairs])
    data: dict[str, Any] = {"images": images, "index": index, "held_identity": [r["identity"] for r in held],
                            "held_images": sorted({r["key"] for r in held}), "checks": {}, "streamed": False,
                            "image_identity": {r["key"]: r["identity"] for r in rows if r["kind"] == "image"}}
    views = 1 + max(r["index"] for r in rows if r["kind"] == "image")
    dim = len(next(r for r in rows if r["kind"] == "image")["vector"])
    img = torch.zeros(views, len(images), dim)
    for r in rows:
        if r["kind"] == "image":
            img[r["index"], index[r["key"]]] = torch.tensor(r["vector"])
    data["pairs"] = TrainingPairs(img, pair_image, torch.tensor([r["vector"] for r in pairs]), teacher_img,
                                  teacher_txt, q)
    data["held_texts"] = torch.tensor([r["vector"] for r in held]) if held else None
    for name in sorted({r["key"] for r in rows if r["kind"] == "gallery"}):
        gal = sorted((r for r in rows if r["kind"] == "gallery" and r["key"] == name), key=lambda r: r["index"])
        qs = sorted((r for r in rows if r["kind"] == "query" and r["key"] == name), key=lambda r: r["index"])
        data["checks"][name] = _cached_check(name, [r["vector"] for r in gal], [r["identity"] for r in gal],
                                             [r["vector"] for r in qs], ctx)
    return data


def _cached_check(name: str, gallery: list, identities: list, queries: list, ctx: RunContext) -> tuple:
    """A check set over cached features: (gallery features, query vectors, its labels, query domains).
    The labels are all the evaluation needs: the cached gallery's identities, relevant sets per query."""
    spec = load_check_yaml(Path(resolve_location(name)))
    labels = CheckSet(queries=[q["text"] for q in spec["queries"]],
                      relevant=[set(q.get("relevant_identities", [])) | set(q.get("relevant_crops", []))
                                for q in spec["queries"]], gallery_images=[], gallery_identities=identities,
                      gallery_domains=[],
                      gallery_pool_ids=gallery_pool_ids(resolve_location(ctx.profile.evaluation.check_set_pool), spec))
    return torch.tensor(gallery), torch.tensor(queries), labels, _check_domains(name)


def streamed_training_data(url: str, ctx: RunContext) -> dict[str, Any]:
    """Streamed pairs: the training pairs as a ``StreamedTraining`` source (a CLIP-like student's
    preprocessing is set once the model exists, ``for_model``), the held-out pairs' index, and the
    check sets: the cached features' rows of them, or their images (bundled, small)."""
    t = ctx.profile.training
    index = PairIndex.scan(url, "train")
    dataset = StreamedPairs(index, batch_size=t.batch_size, window=t.shuffle_window, seed=t.seed, preprocess=None)
    data: dict[str, Any] = {"streamed": True, "checks": {}, "held": PairIndex.scan(url, "heldout"),
                            "pairs": StreamedTraining(dataset, workers=t.loader_workers)}
    if not index.features:
        for name in ctx.profile.evaluation.check_sets:
            check = load_check_set(resolve_location(ctx.profile.evaluation.check_set_pool),
                                   Path(resolve_location(name)))
            data["checks"][name] = (check.gallery_images, check.queries, check, _check_domains(name))
        return data
    artifact, checks = Artifact(url), {}
    for index_, table in artifact.iter_shards(["split"]):
        if {"gallery", "query"} & set(table.column("split").to_pylist()):
            for r in artifact.read_shard(index_, ["split", "pair", "image_id", "identity", "image_views",
                                                  "text_vector"]).to_pylist():
                if r["split"] in ("gallery", "query"):
                    checks.setdefault(r["image_id"], {"gallery": [], "query": []})[r["split"]].append(r)
    for name, parts in sorted(checks.items()):
        gal, qs = (sorted(parts[k], key=lambda r: r["pair"]) for k in ("gallery", "query"))
        data["checks"][name] = _cached_check(name, [r["image_views"][0] for r in gal], [r["identity"] for r in gal],
                                             [r["text_vector"] for r in qs], ctx)
    first = next(r for r in artifact.read_shard(index.shards[0], ["image_views", "text_vector"]).to_pylist())
    data["dims"] = (len(first["image_views"][0]), len(first["text_vector"]))
    return data


def _check_domains(name: str) -> list[str]:
    return [q.get("domain", "pedestrian") for q in load_check_yaml(Path(resolve_location(name)))["queries"]]


def new_model(data: dict[str, Any], ctx: RunContext) -> torch.nn.Module:
    """The student: the configured CLIP-like model, or the CPU feature model sized to the features."""
    t = ctx.profile.training
    if t.model is not None:
        model = HFClipDualEncoder(t.model.model_id, t.train_text, t.model.revision).to(resolve_device(t.model.device))
        data["pairs"] = data["pairs"].for_model(model)
        return model
    image_dim, d = data["dims"] if data["streamed"] else (data["pairs"].images.shape[2], data["pairs"].texts.shape[1])
    return FeatureDualEncoder(bridge_dim=d, cnn_dim=image_dim - d, text_dim=d, train_text=t.train_text)


def _encode_images(model: torch.nn.Module, items: Any, batch: int = 64) -> np.ndarray:
    """Cached features (a tensor) or raw images (a list) → normalised vectors."""
    if isinstance(items, torch.Tensor):
        return model.encode_image(items).numpy()
    device = next(model.parameters()).device
    return np.concatenate([model.encode_image(to_device(model.pixel_values(items[i:i + batch]), device))
                           .float().cpu().numpy() for i in range(0, len(items), batch)])


def _encode_texts(model: torch.nn.Module, items: Any, batch: int = 256) -> np.ndarray:
    if isinstance(items, torch.Tensor):
        return model.encode_text(items).numpy()
    device = next(model.parameters()).device
    return np.concatenate([model.encode_text(to_device(model.tokens(items[i:i + batch]), device))
                           .float().cpu().numpy() for i in range(0, len(items), batch)])


def train_config(ctx: RunContext, **overrides: Any) -> TrainConfig:
    t = ctx.profile.training
    return TrainConfig(**{"epochs": t.epochs, "batch_size": t.batch_size, "lr_start": t.lr_start,
                          "lr_peak": t.lr_peak, "warmup_frac": t.warmup_frac, "weight_decay": t.weight_decay,
                          "tau_teacher": t.tau_teacher, "alpha": t.alpha, "beta": t.beta, "gamma": t.gamma,
                          "confidence_beta": t.confidence_beta, "gmm_components": t.gmm_components,
                          "gmm_min_fit_pairs": t.gmm_min_fit_pairs,
                          "seed": t.seed, "checkpoint_every": t.checkpoint_every, **overrides})


def evaluation_rows(model: torch.nn.Module, data: dict[str, Any], label: str) -> list[dict]:
    """mAP@10/20/30 per domain on each check set; R@1/5/10, mAP, mINP on the held-out identities."""
    rows: list[dict[str, Any]] = []
    model.eval()
    with torch.no_grad():
        for name, (gallery, queries, check, domains) in data["checks"].items():
            sims = _encode_texts(model, queries) @ _encode_images(model, gallery).T
            ranked = np.argsort(-sims, axis=1, kind="stable")[:, :30]
            rankings, counts = relevance_lists(check, ranked)
            for domain in sorted(set(domains)):
                sel = [i for i, d in enumerate(domains) if d == domain]
                for k in (10, 20, 30):
                    rows.append({"benchmark": Path(name).stem, "labels": "verified", "expert": label, "domain": domain,
                                 "metric": f"mAP@{k}", "queries": len(sel),
                                 "value": mean_ap_at_k([rankings[i] for i in sel], [counts[i] for i in sel], k)})
        held = _held_out(model, data)
        if held is not None:
            m = person_search_over_vectors(held[0], held[1], held[2], held[3])
            rows += [{"benchmark": "held-out-identities", "labels": "track identities", "expert": label,
                      "domain": "pedestrian", "metric": k, "value": v, "queries": int(m["queries"])}
                     for k, v in m.items() if k != "queries"]
    return rows


def _held_out(model: torch.nn.Module, data: dict[str, Any]) -> tuple[np.ndarray, list, np.ndarray, list] | None:
    """(query vectors, their identities, gallery vectors, their identities) of the held-out pairs."""
    if data["streamed"]:
        return held_out_embeddings(model, data["held"], data["pairs"].dataset.preprocess)
    if data["held_texts"] is None:
        return None
    gallery_ids = data["held_images"]
    g = _encode_images(model, data["pairs"].images[0, [data["index"][i] for i in gallery_ids]])
    return (_encode_texts(model, data["held_texts"]), data["held_identity"], g,
            [data["image_identity"][i] for i in gallery_ids])


def loss_plot(result: TrainResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    for term in sorted({k for s in result.step_losses for k in s} - {"step", "epoch"}):
        ax.plot([s["step"] for s in result.step_losses if term in s], [s[term] for s in result.step_losses
                                                                         if term in s], label=term)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.legend()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(buf.getvalue())


class LiveLoss:
    """The loss curve of a training run while it runs: every step's terms are kept, and the curve
    (with a table of the last steps) is republished as one markdown artifact under a stable key at
    most every ``every_s`` seconds, and once more at the end, so the Prefect UI shows it growing."""

    def __init__(self, key: str, title: str, every_s: float = 30.0) -> None:
        self.key, self.title, self.every_s = key, title, every_s
        self.records: list[dict[str, float]] = []
        self.published_at = time.monotonic()
        self.publications = 0

    def add(self, record: dict[str, float]) -> None:
        self.records.append(record)
        if time.monotonic() - self.published_at >= self.every_s:
            self.publish()

    def publish(self) -> None:
        if not self.records:
            return
        with tempfile.TemporaryDirectory() as tmp:
            plot = Path(tmp) / "loss.png"
            loss_plot(TrainResult(self.records, [], 0), plot, self.title)
            picture = inline_png(plot, "training loss so far")
        last = self.records[-5:]
        terms = [k for k in last[-1] if k not in ("step", "epoch")]
        table = ["| step | epoch | " + " | ".join(terms) + " |", "|---|---|" + "---|" * len(terms),
                 *[f"| {int(r['step'])} | {int(r['epoch'])} | " + " | ".join(f"{r.get(t, float('nan')):.4f}"
                                                                            for t in terms) + " |" for r in last]]
        count = f"{len(self.records)} step{'s' if len(self.records) != 1 else ''} so far."
        publish_markdown(self.key, "\n".join([f"# {self.title}: loss so far", "", count, "", picture, "", *table]),
                         f"{self.title}: the loss curve while training runs")
        self.published_at, self.publications = time.monotonic(), self.publications + 1


class Train(Stage):
    """Train (resuming from the last checkpoint of the same configuration), evaluate zero-shot and
    trained, write the step log, the evaluation rows, the final weights and the loss plot. One stage
    per method: its folders are ``train_<method>`` (weights, plots), ``_log`` and ``_evaluation``.
    Its input is the features artifact's training pairs, counted from its ``kind`` column; accepted
    are the pairs the trainer was given: a pair its loader drops fails the stage."""

    version = "2"
    reads = ("training_features",)
    config = ("training", "evaluation")
    resources = Resources(device="gpu", hold_slot=False, batch_size="training.batch_size")
    main = "log"
    balance = True

    def __init__(self, method: str, cfg: TrainConfig) -> None:
        self.method, self.cfg = method, cfg
        self.name = f"train_{method}"
        self.writes = (Write("log", "training_log", LOG, folder=f"{self.name}_log"),
                       Write("evaluation", "evaluation", EVALUATION, folder=f"{self.name}_evaluation"))

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(extra={"cfg": self.cfg.__dict__})

    def run(self, run: StageRun) -> Work:
        with torch_threads(2):
            return self._train(run)

    def _train(self, run: StageRun) -> Work:
        ctx, folder = run.ctx, Path(run.output_url(self.name))
        (folder / "s_hat.png").unlink(missing_ok=True)  # a previous configuration's histograms must not show
        features = run.input("training_features")
        data = load_training_data(features.url, ctx)
        torch.manual_seed(self.cfg.seed)
        model = new_model(data, ctx)
        rows = evaluation_rows(model, data, "zero-shot")
        with Progress(f"{ctx.flow_name}-train-progress", f"{self.name}: training steps done", stage=self.name,
                      total=None, unit="steps") as progress:
            checkpoints = join(run.output_url(self.name), "checkpoints", run.key[:16])
            processes = run.section("training").processes
            live = LiveLoss(f"{ctx.flow_name}-{self.name.replace('_', '-')}-live-loss", self.method)
            if processes > 1:
                with tempfile.TemporaryDirectory(prefix="rde-train-group-") as group:
                    result = train_data_parallel(model, data["pairs"], self.cfg, processes, Path(group), checkpoints,
                                                 progress.update, live.add)
            else:
                result = train(model, data["pairs"], self.cfg, checkpoint_dir=checkpoints, on_step=progress.update,
                               on_loss=live.add)
            live.publish()
        rows += evaluation_rows(model, data, self.method)
        torch.save(model.state_dict(), folder / "model.pt")
        loss_plot(result, folder / "loss.png", f"{self.method} ({len(data['pairs'])} pairs)")
        run.prepared["result"] = result
        counted = features.count_equal("split", "train") if data["streamed"] else features.count_equal("kind", "pair")
        stats = {"input_rows": counted, "accepted": len(data["pairs"]), "rejected": {},
                 "data_stall_share": round(result.loader.stall_share, 4), "batches": result.loader.batches,
                 "resumed_from_epoch": result.resumed_from, "resumed_from_step": result.resumed_step,
                 "epoch_loss": [round(e.mean_loss, 5) for e in result.epochs],
                 "gmm": [gmm_epoch_stats(e) for e in result.epochs if e.confidence is not None]}
        return Work.one({"log": step_log_table(result.step_losses),
                         "evaluation": pa.Table.from_pylist(rows, schema=EVALUATION)}, stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        folder = Path(run.output_url(self.name))
        evaluation = run.output_artifact("evaluation").rows()
        epoch_loss = result.stats.get("epoch_loss", [])
        trained = run.prepared.get("result")
        if trained is not None and trained.epochs and trained.epochs[-1].s_hat is not None:
            gmm_plot(trained, folder / "s_hat.png")
        plots = [inline_png(folder / png, alt) for png, alt in (("loss.png", "training loss per step"),
                                                                ("s_hat.png", "ŝ of pairs judged clean vs noisy"))
                 if (folder / png).exists()]
        loss = "\n".join([
            f"# {self.method}: training loss", "", "| epoch | mean loss |", "|---|---|",
            *[f"| {i} | {v:.4f} |" for i, v in enumerate(epoch_loss)], "", *[f"{p}\n" for p in plots],
            f"Loss curve `{folder / 'loss.png'}`; weights `{folder / 'model.pt'}`; checkpoints (every "
            f"`training.checkpoint_every` steps and at each epoch's end, keyed by the stage key) "
            f"`{folder / 'checkpoints'}`."])
        return Report(tables=[("evaluation", rounded_rows(evaluation, 4),
                               f"{self.method}: zero-shot vs trained (check set mAP@K per domain; held-out person "
                               "search)")],
                      markdown=[("loss", loss, "Training loss per epoch with the loss curve (and for GTR+ the ŝ "
                                               "histograms) shown inline")],
                      log=f"{self.name}: {len(evaluation)} evaluation rows; artifacts in {folder}")


def gmm_epoch_stats(e: EpochRecord) -> dict[str, Any]:
    """What the GMM refit after an epoch decided (kept in the log manifest): its means, the share
    judged clean, the range of confidences, and the mean weight the epoch itself trained with."""
    return {"epoch": e.epoch, "means": [round(m, 5) for m in e.gmm_means], "em_iterations": e.gmm_iterations,
            "clean_share": e.clean_share,
            "confidence_min": float(e.confidence.min()), "confidence_max": float(e.confidence.max()),
            "weight_mean_during_epoch": e.weight_mean}


def gmm_plot(result: TrainResult, path: Path) -> None:
    """Per epoch: ŝ histograms of pairs assigned clean vs noisy, and the gap of their means (GTR+ Fig. 7)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [e for e in result.epochs if e.s_hat is not None]
    fig, axes = plt.subplots(1, len(epochs), figsize=(3 * len(epochs), 2.8), squeeze=False)
    for ax, e in zip(axes[0], epochs, strict=True):
        clean = e.confidence > 0.5
        ax.hist(e.s_hat[clean], bins=30, alpha=0.6, label="clean")
        ax.hist(e.s_hat[~clean], bins=30, alpha=0.6, label="noisy")
        gap = (e.s_hat[clean].mean() - e.s_hat[~clean].mean()) if clean.any() and (~clean).any() else float("nan")
        ax.set_title(f"epoch {e.epoch}: gap {gap:.3f}", fontsize=9)
        ax.set_xlabel("ŝ")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_training(ctx: RunContext, until: str | None, method: str, cfg: TrainConfig) -> dict[str, Any]:
    """The body of both training flows: features, then (unless ``until='features'``) training —
    a pipeline of two stages, the second named after the method."""
    train_stage = Train(method, cfg)
    captions = Artifact(f"{_source_root(ctx)}/largefine")
    layout = features_layout(ctx, captions.count_rows()) if captions.is_complete() else "features"
    pipeline = Pipeline(ctx.flow_name, (TrainingFeatures(layout), train_stage),
                        until={"features": "training-features", "train": train_stage.name})
    results = run_pipeline(ctx, pipeline, until)
    return training_summary(ctx, results, captions.count_rows())


def training_summary(ctx: RunContext, results: list[sharded.StageResult],
                     counted_inputs: int | None = None) -> dict[str, Any]:
    """The run summary of a training flow (stages, artifacts), also as a markdown artifact. The first
    stage's rows are reported as splits (train, held-out or test: evaluation data, not rejects) and
    rejected rows by reason; ``balanced`` compares ``counted_inputs`` (the source counted on its own;
    default the first stage's input) with splits + rejected, and every stage's input with its
    accepted + rejected rows."""
    first = results[0]
    splits = dict(first.splits)
    total_rejected = sum(first.rejected.values())
    inputs = first.input_rows if counted_inputs is None else counted_inputs
    kept = sum(splits.values()) if splits else first.accepted
    balanced = (inputs == kept + total_rejected and kept == first.accepted
                and all(r.input_rows == r.accepted + sum(r.rejected.values()) for r in results))
    summary = {"flow": ctx.flow_name, "profile": ctx.profile.name, "output_root": ctx.root,
               "stages": [r.summary_row() for r in results],
               "artifacts": {f"{r.stage}.{n}": {"url": u} for r in results for n, u in r.artifacts.items()},
               "balanced": balanced, "inputs": inputs, "accepted": first.accepted, "splits": splits,
               "rejected": {f"{r.stage}:{k}": v for r in results for k, v in r.rejected.items()},
               "total_rejected": total_rejected}
    lines = [f"# {ctx.flow_name} ({ctx.profile.name})", "",
             f"{accounting_line(summary)}; balanced: **{balanced}**", "",
             "| stage | skipped | input | kept | seconds |", "|---|---|---|---|---|"]
    lines += [f"| {s['stage']} | {s['skipped']} | {s['input']} | {s['accepted']} | {s['seconds']} |"
              for s in summary["stages"]]
    if splits:
        lines += ["", f"| {first.stage} split | rows |", "|---|---|",
                  *[f"| {split_name(k)} | {v} |" for k, v in splits.items()]]
    if summary["rejected"]:
        lines += ["", "| rejected rows by stage:reason | count |", "|---|---|",
                  *[f"| {k} | {v} |" for k, v in sorted(summary["rejected"].items(), key=lambda kv: -kv[1])]]
    lines += ["", *[f"- `{k}`: `{v['url']}`" for k, v in summary["artifacts"].items()]]
    publish_markdown(f"{ctx.flow_name}-summary", "\n".join(lines), f"{ctx.flow_name} run summary")
    return summary
