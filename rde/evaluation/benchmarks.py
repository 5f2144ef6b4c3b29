"""Where a benchmark comes from, read into one shape: queries, relevant items per query (qrels), and a
gallery read one shard at a time.

Four sources (``open_benchmark``):

- a ``build-secmm`` run's ``benchmark/`` folder (local or ``s3://``), or the dataset folder its card
  describes (the same ``queries/``, ``gallery/``, ``qrels/`` Parquet tables, with or without
  manifests). Labels: ``verified`` (people's decisions: relevant pairs), ``pending`` (the
  unreviewed MECF union, every candidate taken as relevant) or ``all`` (both);
- a check-set YAML (``data/check_set/queries.yaml``): hand-labelled queries over a pool's crops;
- a clip set (``rde clips build``: ``clips/`` and ``frames/``): text-to-video over its test split
  (what a model trained on the clips did not see), each caption relevant to its own clip; an
  image model sees a clip as its frames, their vectors averaged.

Each query ranks only the gallery of its own domain (SecMM-TBIR). A query's relevant items are those
its labels name that the gallery holds (R counts no id the gallery lacks); a query with none is not
scored (counted as ``unlabelled``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rde.evaluation.gallery_sources import (
    ArtifactGallery,
    CheckSetGallery,
    ClipGallery,
    GallerySource,
)
from rde.evaluation.tables import ShardedTable, open_table
from storage import Artifact
from storage.filesystem import join, resolve
from storage.hashing import sha256_json

LABELS = ("verified", "pending", "all")


class BenchmarkError(ValueError):
    """A benchmark that cannot be evaluated (no qrels, no gallery, labels it does not have): one line."""


@dataclass
class Benchmark:
    """One benchmark with its labels chosen. ``key`` fingerprints what the scores depend on (the
    tables' content and the labels), ``gallery_key`` what the gallery's vectors depend on (its items
    only: another label set or a label import embeds nothing again); ``upstream`` are the artifacts
    it was read from (manifests' lineage)."""

    name: str
    kind: str  # secmm | check-set | clips
    location: str
    labels: str
    key: str
    gallery_key: str
    queries: list[dict[str, str]]  # query_id, domain, text: the scored queries, in benchmark order
    qrels: dict[str, set[str]]
    gallery: GallerySource
    unlabelled: int = 0  # queries with no relevant item under these labels (not scored)
    pending_pairs: int = 0  # unreviewed candidate pairs in the benchmark
    review_links: dict[str, str] = field(default_factory=dict)
    upstream: list[Artifact] = field(default_factory=list)

    def describe(self) -> dict[str, Any]:
        """What a run summary says of the benchmark: where, which labels, how many queries were
        scored and left out, the gallery's size, the unreviewed pairs."""
        return {"benchmark": self.name, "kind": self.kind, "location": self.location, "labels": self.labels,
                "queries": len(self.queries), "gallery": self.gallery.size, "unlabelled_queries": self.unlabelled,
                "pending_pairs": self.pending_pairs}


def open_benchmark(location: str, labels: str | None = None, check_set_pool: str = "data/demo_pool",
                   track_facts: Any = None, domains: Any = None) -> Benchmark:
    """The benchmark at ``location`` with ``labels`` (None: verified when any exist, else pending);
    ``check_set_pool``: the pool a check-set YAML's identities refer to; ``track_facts`` and
    ``domains``: the profile's ``TrackFactsSpec`` and ``DomainSet`` (an expert with track slots
    compares motion with each item's track, in its domain's states)."""
    if labels is not None and labels not in LABELS:
        raise BenchmarkError(f"labels {labels!r}: use one of {', '.join(LABELS)}")
    if location.endswith((".yaml", ".yml")):
        return _check_set(location, labels, check_set_pool, track_facts, domains)
    fs, path = resolve(location)
    if not fs.exists(path):
        raise BenchmarkError(f"benchmark {location}: no such file or folder")
    if fs.exists(join(path, "clips")) and fs.exists(join(path, "frames")):
        return _clip_set(location, labels)
    return _secmm(location, labels, track_facts, domains)


def _table(location: str, name: str) -> ShardedTable:
    table = open_table(join(location, name))
    if table is None:
        what = {"qrels": "no qrels", "gallery": "no gallery", "queries": "no queries"}[name]
        raise BenchmarkError(f"benchmark {location}: {what} ({name}/ with a manifest or *.parquet files); a "
                             "build-secmm benchmark folder has queries/, gallery/ and qrels/ (`rde build-secmm "
                             "--until benchmark` writes them)")
    return table


def _secmm(location: str, labels: str | None, track_spec: Any, domains: Any) -> Benchmark:
    queries_t, gallery_t, qrels_t = (_table(location, n) for n in ("queries", "gallery", "qrels"))
    verified: dict[str, set[str]] = {}
    pending: dict[str, set[str]] = {}
    pending_pairs = 0
    for row in qrels_t.rows(["query_id", "image_id", "relevant", "verified"]):
        if row["verified"]:
            if row["relevant"]:
                verified.setdefault(row["query_id"], set()).add(row["image_id"])
        else:
            pending_pairs += 1
            pending.setdefault(row["query_id"], set()).add(row["image_id"])
    chosen = labels or ("verified" if verified else "pending")
    qrels = {"verified": verified, "pending": pending,
             "all": {q: verified.get(q, set()) | pending.get(q, set()) for q in {*verified, *pending}}}[chosen]
    all_queries = queries_t.rows(["query_id", "domain", "text"])
    gallery = ArtifactGallery(gallery_t, _accepted_facts(location, track_spec, domains))
    scored, kept = _labelled(location, all_queries, qrels, gallery.ids(), chosen)
    return Benchmark(_run_name(location), "secmm", location, chosen,
                     sha256_json({"kind": "secmm", "labels": chosen, "tables": [t.fingerprint for t in
                                                                                 (queries_t, gallery_t, qrels_t)]}),
                     sha256_json({"kind": "secmm", "gallery": gallery_t.fingerprint}), scored, kept, gallery,
                     len(all_queries) - len(scored), pending_pairs, _review_links(location),
                     [t.artifact for t in (queries_t, gallery_t, qrels_t) if t.artifact is not None])


def _labelled(location: str, queries: list[dict[str, str]], qrels: dict[str, set[str]], gallery_ids: list[str],
              labels: str) -> tuple[list[dict[str, str]], dict[str, set[str]]]:
    """The queries scored under these labels (those with a relevant item in the gallery, in
    benchmark order) and their relevant items in the gallery: an id the gallery does not hold
    cannot be ranked, so it is not counted in R. Two gallery items with one id are an error."""
    present = set(gallery_ids)
    if len(present) != len(gallery_ids):
        twice = sorted({i for i in gallery_ids if gallery_ids.count(i) > 1})[:3] if len(gallery_ids) < 10**5 else []
        raise BenchmarkError(f"benchmark {location}: gallery item ids repeat ({', '.join(twice) or 'several'}): "
                             "each item needs an id of its own")
    kept = {q: found & present for q, found in qrels.items() if found & present}
    scored = [q for q in queries if q["query_id"] in kept]
    if not scored:
        hint = " (no candidate has been reviewed yet: try --labels pending)" if labels == "verified" else ""
        raise BenchmarkError(f"benchmark {location}: no query has a {labels} relevant item in the gallery{hint}")
    return scored, {q["query_id"]: kept[q["query_id"]] for q in scored}


def _run_name(location: str) -> str:
    """``build-secmm/<profile>`` for a run's benchmark folder, else the folder's own name."""
    parts = location.rstrip("/").split("/")
    if len(parts) >= 3 and parts[-1] == "benchmark":
        return f"{parts[-3]}/{parts[-2]}"
    return parts[-1] or location


def _accepted_facts(location: str, track_spec: Any, domains: Any) -> Callable[[list[str]], list[dict]] | None:
    """Each gallery image's track facts from the run's ``accepted`` artifact next to the benchmark
    folder (where there is one: a copied dataset folder has none, and track slots then see none)."""
    parent = location.rstrip("/").rsplit("/", 1)[0]
    accepted = Artifact(join(parent, "accepted"))
    if track_spec is None or domains is None or not accepted.is_complete():
        return None
    from rde.common.track_context import track_facts

    def facts(ids: list[str]) -> list[dict]:
        found = track_facts(accepted, ids, track_spec, domains)
        return [found.get(i, {}) for i in ids]

    return facts


def _review_links(location: str) -> dict[str, str]:
    """Each query's page on the run's review site (``review/index.html#q/<n>/1``, n as the site
    numbers its queries: read from its ``data/index.js``), where the site is on a local disk."""
    site = Path(location) / "review"
    index = site / "data" / "index.js"
    if "://" in location or not index.exists():
        return {}
    text = index.read_text(encoding="utf-8").strip().removeprefix("RDE_REVIEW.index(").removesuffix(";")
    page = (site / "index.html").resolve().as_uri()
    return {q["id"]: f"{page}#q/{q['n']}/1" for q in json.loads(text.removesuffix(")"))["queries"]}


def _check_set(location: str, labels: str | None, pool: str, track_spec: Any, domains: Any) -> Benchmark:
    from rde.common.expert_check import check_pool, gallery_track_facts, load_check_set, load_check_yaml
    from rde.evaluation.check_sets import check_queries
    from storage.locations import resolve_location

    if labels not in (None, "verified"):
        raise BenchmarkError(f"check set {location}: its labels are hand-made (verified); --labels {labels} "
                             "does not apply")
    path = Path(location)
    if not path.exists():
        raise BenchmarkError(f"check set {location}: no such file")
    data = load_check_yaml(path)
    check = load_check_set(resolve_location(pool), path)
    queries, gallery_ids, _, qrels = check_queries(check)
    known = track_spec is not None and domains is not None
    gallery = CheckSetGallery(check, gallery_track_facts(check, domains, track_spec) if known else None)
    scored, kept = _labelled(location, queries, qrels, gallery_ids, "verified")
    pool_artifact = Artifact(check_pool(resolve_location(pool), data))
    pool_print = pool_artifact.manifest().fingerprint
    key = sha256_json({"kind": "check-set", "yaml": path.read_text(encoding="utf-8"), "pool": pool_print})
    junk = sorted(data.get("junk_identities") or [])
    gallery_key = sha256_json({"kind": "check-set", "pool": pool_print, "junk": junk})
    return Benchmark(f"check-set:{data.get('name', path.stem)}", "check-set", location, "verified", key, gallery_key,
                     scored, kept, gallery, len(queries) - len(scored), upstream=[pool_artifact])


def _clip_set(location: str, labels: str | None) -> Benchmark:
    if labels not in (None, "verified"):
        raise BenchmarkError(f"clip set {location}: each caption belongs to its clip (verified); --labels {labels} "
                             "does not apply")
    clips = Artifact(join(location, "clips"))
    frames = Artifact(join(location, "frames"))
    if not clips.is_complete() or not frames.is_complete():
        raise BenchmarkError(f"clip set {location}: clips/ and frames/ must be complete artifacts (`rde clips "
                             "build` writes them)")
    rows = [r for r in clips.rows(["clip_id", "split", "captions", "frame_indices"]) if r["split"] == "test"]
    empty = [r["clip_id"] for r in rows if not r["frame_indices"]]
    if empty:
        raise BenchmarkError(f"clip set {location}: clips without frames: {', '.join(empty[:3])}")
    queries, qrels = [], {}
    for r in rows:
        for n, text in enumerate(r["captions"]):
            qid = f"{r['clip_id']}#{n}"
            queries.append({"query_id": qid, "domain": "clips", "text": text})
            qrels[qid] = {r["clip_id"]}
    gallery = ClipGallery(clips, frames, [r["clip_id"] for r in rows])
    scored, kept = _labelled(location, queries, qrels, gallery.ids(), "verified")
    prints = {"clips": clips.manifest().fingerprint, "frames": frames.manifest().fingerprint}
    return Benchmark(f"clips:{location.rstrip('/').rsplit('/', 1)[-1]}", "clips", location, "verified",
                     sha256_json({"kind": "clips", **prints}), sha256_json({"kind": "clips", **prints}), scored, kept,
                     gallery, len(queries) - len(scored), upstream=[clips, frames])


def mean_of_frames(vectors: np.ndarray) -> np.ndarray:
    """A clip's vector for an image model: the mean of its frames' vectors, L2-normalised."""
    mean = np.asarray(vectors, dtype=np.float32).mean(axis=0)
    return mean / max(float(np.linalg.norm(mean)), 1e-12)
