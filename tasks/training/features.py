"""The training-features stage: the source run's captions as training pairs and held-out pairs
with the teacher's vectors, in one of three layouts (``features_layout``)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from models.backends.registry import models_lineage
from rde.common.caption_source import finished_captions
from rde.common.image_decoding import decode_rgb, decoded_images
from rde.training.pair_selection import LAYOUTS, Layout, PairCounts, PairSelection, image_key
from rde.training.retrieval_features import image_features
from rde.training.training_data import check_set_features
from storage import Artifact
from storage.schemas import TRAINING_FEATURES
from tasks.framework.accounting import StageResult
from tasks.framework.context import RunContext
from tasks.framework.stage import Lineage, Report, Resources, Stage, StageRun, Work, Write


def _source_root(ctx: RunContext) -> str:
    """Where the source flow's artifacts are: same artifacts root (or --output) as this run."""
    return RunContext(ctx.profile, ctx.profile.training.source_flow, ctx.output_root).root


def _decoded_images(source_root: str, image_ids: Sequence[str]) -> dict[str, np.ndarray]:
    """The source run's accepted images with these ids, decoded (``decoded_images``: ids first, then
    the bytes of only the shards holding one of them)."""
    return decoded_images(Artifact(f"{source_root}/accepted"), image_ids)


@dataclass
class CaptionShard:
    """One shard of captions that train or are held out (each with its ``split`` and its ``pair`` id
    within the split), with their images' encoded bytes."""

    caps: list[dict[str, Any]]
    encoded: dict[str, bytes]


@dataclass(frozen=True)
class TrainingSource:
    """The source run ``lineage`` found: its folder and its finished captions."""

    root: str
    captions: Artifact


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
              "training.held_out_share", "training.seed", "evaluation.check_sets",
              "evaluation.check_set_pool")
    resources = Resources(device="gpu", hold_slot=False)
    prepares = TrainingSource
    balance = True

    def __init__(self, layout: Layout = "features") -> None:
        self.layout = layout
        kind, schema = LAYOUTS[layout]
        self.writes = (Write("training_features", kind, schema, shared=True),)

    def lineage(self, run: StageRun) -> Lineage:
        src = _source_root(run.ctx)
        captions = finished_captions(src, f"training (profile {run.profile_name})")
        run.prepared = TrainingSource(src, captions)
        return Lineage(models={"models": models_lineage(run.models)}, upstream=[captions],
                       extra={"captions": captions.manifest().fingerprint, "layout": self.layout})

    def run(self, run: StageRun) -> Work:
        selection = PairSelection.of(run.section("training"), run.section("evaluation").check_sets,
                                      run.prepared.root, run.prepared.captions)
        return self._in_memory(run, selection) if self.layout == "features" else self._streamed(run, selection)

    def _towers(self, run: StageRun, cpu_model: bool = True) -> tuple[Any, Any, Any]:
        """The semantic bridge and the image embedder (the CPU model's towers; None for a CLIP-like
        student) and the teacher."""
        p, registry = run.ctx.profile, run.registry()
        towers = (registry.expert(p.models.experts[0]), registry.image_embedder()) if cpu_model else (None, None)
        return (*towers, registry.expert(p.models.teacher or p.models.experts[-1]))

    def _in_memory(self, run: StageRun, selection: PairSelection) -> Work:
        source: TrainingSource = run.prepared
        t, src, captions = run.section("training"), source.root, source.captions
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
        for f, gallery, identities, queries, _ in check_set_features(run.ctx.profile, bridge, embedder):
            rows += [{"kind": "gallery", "key": f, "index": k, "identity": ident, "q_txt": None, "text": None,
                      "vector": gallery[k].tolist(), "teacher": None} for k, ident in enumerate(identities)]
            rows += [{"kind": "query", "key": f, "index": k, "identity": None, "q_txt": None, "text": None,
                      "vector": v.tolist(), "teacher": None} for k, v in enumerate(queries)]
        return Work.one({"training_features": pa.Table.from_pylist(rows, schema=TRAINING_FEATURES)},
                        counts.stats() | {"images": len(image_ids), "views": t.views,
                                          "held_out_identities": len(selection.held)})

    def _caption_shards(self, run: StageRun, selection: PairSelection, stats: dict[str, Any]) -> Iterator[CaptionShard]:
        """The captions shard by shard, counted as read (into ``stats``), with their images' bytes
        read from the accepted shards that hold them."""
        source: TrainingSource = run.prepared
        accepted, counts = Artifact(f"{source.root}/accepted"), PairCounts()
        where = {i: index for index, table in accepted.iter_shards(["image_id"])
                 for i in table.column("image_id").to_pylist()}
        for _, table in source.captions.iter_shards(["image_id", "text", "q_txt"]):
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
        t = run.section("training")
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
                yield {"training_features": pa.Table.from_pylist(rows, schema=schema)}
            if cached:  # the check sets' gallery and queries, as one last shard
                rows = []
                for f, gallery, identities, queries, texts in check_set_features(run.ctx.profile, bridge, embedder):
                    rows += [{"split": "gallery", "pair": k, "image_id": f, "image_key": 0, "identity": ident,
                              "image_views": [gallery[k].tolist()]} for k, ident in enumerate(identities)]
                    rows += [{"split": "query", "pair": k, "image_id": f, "image_key": 0, "text": texts[k],
                              "text_vector": v.tolist()} for k, v in enumerate(queries)]
                if rows:
                    yield {"training_features": pa.Table.from_pylist(rows, schema=schema)}

        return Work(shards(), stats)

    def report(self, run: StageRun, result: StageResult) -> Report:
        return Report(log=f"training-features: {result.splits.get('train', 0)} training pairs, "
                          f"{result.splits.get('held_out', 0)} held out for person search, "
                          f"{sum(result.rejected.values())} not used {result.rejected or ''}")
