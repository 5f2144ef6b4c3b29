"""The labelled check set: do the configured experts retrieve the right demo-pool crops?

Gallery: the demo pool's crops (persons and vehicles) minus 'junk' identities. Queries and their relevant identities
or crops: ``data/check_set/queries.yaml`` (hand-labelled). Scored through ``rde evaluate``'s ranking
(``rde.evaluation.check_sets``: mAP@K per expert against the expected score of a random ranking).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import date
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from models.backends.interfaces import TextImageExpert
from models.backends.track_facts import motion_facts
from models.domains import DomainSet
from rde.common.image_decoding import decode_rgb
from rde.common.pool_config import TrackFactsSpec
from rde.common.track_context import motion_options
from rde.common.track_slots import fuse_track_slots
from storage import Artifact
from storage.hashing import sha256_bytes
from storage.locations import project_root


@dataclass
class CheckSet:
    """A check set read against a pool: per query its text and its relevant keys, which are track
    identities (every crop of the identity is relevant) or pool ids of single crops (a query about
    what a person does: "walking to the left" holds for some crops of a track, not all)."""

    queries: list[str]
    relevant: list[set[str]]  # identities and crop pool ids per query
    gallery_images: list[np.ndarray]
    gallery_identities: list[str]
    gallery_domains: list[str]
    gallery_ids: list[str] | None = None  # content hashes of the images (image_id), where known
    query_ids: list[str] | None = None  # the YAML's query ids, in query order, where known
    query_domains: list[str] | None = None  # each query's domain, where known
    gallery_meta: list[str] | None = None  # each crop's source_meta (JSON: its video track), where known
    gallery_pool_ids: list[str] | None = None  # each crop's pool id, where known

    def relevant_positions(self, query: int) -> set[int]:
        """Gallery positions relevant to query ``query``: its identities' crops and its listed crops."""
        keys = self.relevant[query]
        pool_ids = self.gallery_pool_ids or [""] * len(self.gallery_identities)
        return {j for j, (ident, pid) in enumerate(zip(self.gallery_identities, pool_ids, strict=True))
                if ident in keys or pid in keys}


_DOMAIN_NAME = re.compile(r"^[a-z][a-z0-9_]*$")  # a domain file's name rule
DEFAULT_CHECK_FILE = Path("data") / "check_set" / "queries.yaml"


def _fail(source: Path, where: str, problem: str) -> ValueError:
    return ValueError(f"check set {source}: {where}: {problem}")


def _identity_list(value: Any, source: Path, where: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(i, str) and i.strip() for i in value):
        raise _fail(source, where, f"{key} must be a list of non-empty identity strings, got {value!r}")
    return value


def validate_check_yaml(data: Any, source: Path) -> dict:
    """Check a parsed check-set file; raise ValueError naming the file and the query id at the first problem.

    Rules: a mapping with a non-empty ``queries`` list; unique query ids; non-empty text; domain in
    a domain name; at least one relevant identity or crop (``relevant_identities``, ``relevant_crops``:
    pool ids); ``labelled_by`` (non-empty) and ``labelled_on`` (an ISO date) on every query; no
    relevant identity listed in ``junk_identities``; ``pool``, where given, a path (the pool artifact
    the file's identities are crops of, relative to the project root; default: the profile's)."""
    if not isinstance(data, dict):
        raise _fail(source, "file", f"expected a mapping at the top level, got {type(data).__name__}")
    if "pool" in data and (not isinstance(data["pool"], str) or not data["pool"].strip()):
        raise _fail(source, "file", f"pool must be the path of a pool artifact, got {data['pool']!r}")
    queries = data.get("queries")
    if not isinstance(queries, list) or not queries:
        raise _fail(source, "file", "'queries' must be a non-empty list")
    junk = set(_identity_list(data.get("junk_identities") or [], source, "file", "junk_identities"))
    seen: set[str] = set()
    for n, q in enumerate(queries):
        if not isinstance(q, dict):
            raise _fail(source, f"query #{n + 1}", f"expected a mapping, got {type(q).__name__}")
        qid = q.get("id")
        if not isinstance(qid, str) or not qid.strip():
            raise _fail(source, f"query #{n + 1}", f"missing or empty id ({qid!r})")
        where = f"query {qid}"
        if qid in seen:
            raise _fail(source, where, "duplicate query id")
        seen.add(qid)
        if not isinstance(q.get("text"), str) or not q["text"].strip():
            raise _fail(source, where, "empty or missing text")
        if not isinstance(q.get("domain"), str) or not _DOMAIN_NAME.match(q["domain"]):
            raise _fail(source, where, f"domain must be a domain's name (lower case, digits, underscores), got "
                                       f"{q.get('domain')!r}")
        relevant = _identity_list(q.get("relevant_identities", []), source, where, "relevant_identities")
        crops = _identity_list(q.get("relevant_crops", []), source, where, "relevant_crops")
        if not relevant and not crops:
            raise _fail(source, where, "no relevant identities")
        if not isinstance(q.get("labelled_by"), str) or not q["labelled_by"].strip():
            raise _fail(source, where, "missing labelled_by (who labelled the query, and how)")
        labelled_on = q.get("labelled_on")
        if isinstance(labelled_on, str):
            try:
                date.fromisoformat(labelled_on)
            except ValueError:
                raise _fail(source, where, f"labelled_on must be an ISO date, got {labelled_on!r}") from None
        elif not isinstance(labelled_on, date):
            raise _fail(source, where, f"missing labelled_on (an ISO date), got {labelled_on!r}")
        if junk & set(relevant):
            raise _fail(source, where, f"relevant identities listed as junk: {', '.join(sorted(junk & set(relevant)))}")
    return data


def load_check_yaml(path: Path | None = None) -> dict:
    """The parsed check-set file (default ``data/check_set/queries.yaml``), validated by
    :func:`validate_check_yaml` (ValueError naming the file and the query id)."""
    source = path or project_root() / DEFAULT_CHECK_FILE
    try:
        data = yaml.safe_load(source.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"check set {source}: not valid YAML: {e}") from e
    return validate_check_yaml(data, source)


def crop_identity(pool_id: str) -> str:
    """The track identity of a video crop's pool id (``<identity>:f<frame>``, the videos stage's naming)."""
    return pool_id.rsplit(":f", 1)[0]


def held_out_identities(data: dict) -> set[str]:
    """Every identity a check set's queries use (listed, or owning a listed crop): training keeps
    their captions out, so the check set measures images the student never saw."""
    return {i for q in data["queries"] for i in q.get("relevant_identities", [])} | \
        {crop_identity(c) for q in data["queries"] for c in q.get("relevant_crops", [])}


def check_pool(pool_url: str | None, data: dict) -> str:
    """The pool a check set's identities are crops of: the file's own ``pool`` (a domain added as a
    file has its crops in a pool of its own), else ``pool_url``, else the demo pool."""
    if data.get("pool"):
        return str(project_root() / data["pool"])
    return pool_url or str(project_root() / "data" / "demo_pool")


def gallery_pool_ids(pool_url: str | None, data: dict) -> list[str]:
    """The pool ids of a check set's gallery in ``load_check_set``'s order, read without image bytes."""
    table = Artifact(check_pool(pool_url, data)).read_shard(
        0, ["pool_id", "identity", "variant"]).to_pylist()
    junk = set(data.get("junk_identities") or [])
    return [r["pool_id"] for r in table if r["variant"] == "crop" and r["identity"] not in junk]


def load_check_set(pool_url: str | None = None, queries_file: Path | None = None) -> CheckSet:
    """A check-set file's queries over its pool's crops (``check_pool``), junk identities left out."""
    data = load_check_yaml(queries_file)
    pool_url = check_pool(pool_url, data)
    table = Artifact(pool_url).read_shard(0).to_pylist()
    junk = set(data.get("junk_identities") or [])
    pool_crops = {r["identity"] for r in table if r["variant"] == "crop"}
    crop_ids = {r["pool_id"] for r in table if r["variant"] == "crop" and r["identity"] not in junk}
    missing = {q["id"]: sorted((set(q.get("relevant_identities", [])) - pool_crops)
                               | (set(q.get("relevant_crops", [])) - crop_ids)) for q in data["queries"]}
    if any(missing.values()):
        detail = "; ".join(f"query {qid}: {', '.join(ids)}" for qid, ids in missing.items() if ids)
        raise ValueError(f"check set {queries_file or project_root() / DEFAULT_CHECK_FILE}: relevant identities or "
                         f"crops with no (non-junk) crop in the pool {pool_url}: {detail}")
    crops = [r for r in table if r["variant"] == "crop" and r["identity"] not in junk]
    return CheckSet([q["text"] for q in data["queries"]],
                    [set(q.get("relevant_identities", [])) | set(q.get("relevant_crops", [])) for q in data["queries"]],
                    [decode_rgb(r["image_bytes"]) for r in crops], [r["identity"] for r in crops],
                    [r["domain"] for r in crops], [sha256_bytes(r["image_bytes"]) for r in crops],
                    [q["id"] for q in data["queries"]], [q["domain"] for q in data["queries"]],
                    [r["source_meta"] for r in crops], [r["pool_id"] for r in crops])


def restrict_to(check: CheckSet, domains: list[str]) -> CheckSet:
    """The check set's queries and crops of ``domains`` only (a profile scores the queries of its own
    domains: its experts know no other domain's words, slots or motion)."""
    keep_q = [n for n, d in enumerate(check.query_domains or []) if d in domains]
    keep_g = [j for j, d in enumerate(check.gallery_domains) if d in domains]
    if check.query_domains is None or (len(keep_q) == len(check.queries) and len(keep_g) == len(check.gallery_domains)):
        return check

    def pick(values: list | None, keep: list[int]) -> list | None:
        return None if values is None else [values[i] for i in keep]

    return CheckSet([check.queries[n] for n in keep_q], [check.relevant[n] for n in keep_q],
                    [check.gallery_images[j] for j in keep_g], [check.gallery_identities[j] for j in keep_g],
                    [check.gallery_domains[j] for j in keep_g], pick(check.gallery_ids, keep_g),
                    pick(check.query_ids, keep_q), pick(check.query_domains, keep_q), pick(check.gallery_meta, keep_g),
                    pick(check.gallery_pool_ids, keep_g))


def relevance_lists(check: CheckSet, ranked: np.ndarray) -> tuple[list[list[bool]], list[int]]:
    relevant = [check.relevant_positions(q) for q in range(len(check.relevant))]
    rankings = [[int(j) in rel for j in row] for row, rel in zip(ranked, relevant, strict=True)]
    return rankings, [len(rel) for rel in relevant]


def expert_vectors(expert: TextImageExpert, check: CheckSet, domains: DomainSet, image_vecs: np.ndarray | None = None,
                   track: TrackFactsSpec | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The query and gallery vectors an expert ranks the check set with, as MECF and the evaluation
    rank: an expert with track slots (the attribute expert) also compares the queries' motion and
    direction with each crop's video track (``rde.common.track_slots``; ``track``: the thresholds,
    the profile default when None)."""
    gallery = expert.encode_image(check.gallery_images) if image_vecs is None else image_vecs
    queries = expert.encode_text(check.queries)
    if getattr(expert, "track_slots", False):
        queries, gallery = fuse_track_slots(queries, gallery, check.queries,
                                            gallery_track_facts(check, domains, track), expert.track_slots)
    return queries, gallery


def gallery_track_facts(check: CheckSet, domains: DomainSet, track: TrackFactsSpec | None = None
                        ) -> list[dict[str, list[str]]]:
    """Each gallery crop's track facts (motion in its domain's states, direction, place), from its
    source_meta; empty where the check set carries no metadata."""
    if check.gallery_meta is None:
        return [{} for _ in check.gallery_identities]
    options = motion_options(track or TrackFactsSpec())
    return [motion_facts(meta, domains.get(domain), options)
            for meta, domain in zip(check.gallery_meta, check.gallery_domains, strict=True)]
