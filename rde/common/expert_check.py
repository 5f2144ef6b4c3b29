"""The labelled check set: do the configured experts retrieve the right demo-pool crops?

Gallery: the demo pool's crops (persons and vehicles) minus 'junk' identities. Queries and their relevant identities:
``data/check_set/queries.yaml`` (hand-labelled). Reports mAP@K per expert against the expected
score of a random ranking.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from models.backends.interfaces import TextImageExpert
from rde.common.image_decoding import decode_rgb
from rde.common.metrics import mean_ap_at_k
from rde.common.topk import topk_exact
from storage import Artifact
from storage.hashing import sha256_bytes
from storage.locations import project_root


@dataclass
class CheckSet:
    queries: list[str]
    relevant: list[set[str]]  # identities per query
    gallery_images: list[np.ndarray]
    gallery_identities: list[str]
    gallery_domains: list[str]
    gallery_ids: list[str] | None = None  # content hashes of the images (image_id), where known


def load_check_yaml(path: Path | None = None) -> dict:
    return yaml.safe_load((path or project_root() / "data" / "check_set" / "queries.yaml").read_text())


def load_check_set(pool_url: str | None = None, queries_file: Path | None = None) -> CheckSet:
    data = load_check_yaml(queries_file)
    table = Artifact(pool_url or str(project_root() / "data" / "demo_pool")).read_shard(0).to_pylist()
    junk = set(data.get("junk_identities", []))
    crops = [r for r in table if r["variant"] == "crop" and r["identity"] not in junk]
    return CheckSet([q["text"] for q in data["queries"]], [set(q["relevant_identities"]) for q in data["queries"]],
                    [decode_rgb(r["image_bytes"]) for r in crops], [r["identity"] for r in crops],
                    [r["domain"] for r in crops], [sha256_bytes(r["image_bytes"]) for r in crops])


def relevance_lists(check: CheckSet, ranked: np.ndarray) -> tuple[list[list[bool]], list[int]]:
    ids = np.array(check.gallery_identities)
    rankings = [[ids[j] in rel for j in row] for row, rel in zip(ranked, check.relevant, strict=True)]
    counts = [int(np.isin(ids, list(rel)).sum()) for rel in check.relevant]
    return rankings, counts


def expert_map(expert: TextImageExpert, check: CheckSet, k: int = 10,
               image_vecs: np.ndarray | None = None) -> float:
    """mAP@k of one expert on the check set."""
    gallery = expert.encode_image(check.gallery_images) if image_vecs is None else image_vecs
    ranked, _ = topk_exact(expert.encode_text(check.queries), gallery, k)
    return mean_ap_at_k(*relevance_lists(check, ranked), k=k)


def random_map(check: CheckSet, k: int = 10, trials: int = 500, seed: int = 0) -> float:
    """Expected mAP@k of a uniformly random ranking (Monte Carlo over ``trials`` permutations)."""
    rng = np.random.default_rng(seed)
    n = len(check.gallery_identities)
    scores = []
    for _ in range(trials):
        ranked = np.stack([rng.permutation(n)[:k] for _ in check.queries])
        scores.append(mean_ap_at_k(*relevance_lists(check, ranked), k=k))
    return float(np.mean(scores))
