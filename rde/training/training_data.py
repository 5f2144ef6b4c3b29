"""What a training stage reads and builds: the features artifact as training data (in memory or
streamed), the model, its training config and its evaluation rows. ``profile``: the run's profile
(as the stage sees it: its ``training`` and ``evaluation`` sections)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.backends.torch_runtime import resolve_device
from models.retrieval.dual_encoder import FeatureDualEncoder, HFClipDualEncoder
from rde.common.expert_check import (
    CheckSet,
    gallery_pool_ids,
    load_check_set,
    load_check_yaml,
    relevance_lists,
)
from rde.common.metrics import mean_ap_at_k, person_search_over_vectors
from rde.training.pair_batches import StreamedTraining, held_out_embeddings, to_device
from rde.training.pair_selection import LAYOUTS
from rde.training.pair_stream import PairIndex, StreamedPairs
from rde.training.retrieval_features import image_features
from rde.training.retrieval_training import (
    TrainConfig,
    TrainingPairs,
)
from storage import Artifact
from storage.locations import resolve_location


def load_training_data(url: str, profile: Any) -> dict[str, Any]:
    """The features artifact as training pairs, held-out pairs and check sets: in memory (the CPU
    model's ``features`` layout), or streamed (``streamed_training_data``)."""
    if Artifact(url).manifest().kind != LAYOUTS["features"][0]:
        return streamed_training_data(url, profile)
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
                                             [r["vector"] for r in qs], profile)
    return data


def _cached_check(name: str, gallery: list, identities: list, queries: list, profile: Any) -> tuple:
    """A check set over cached features: (gallery features, query vectors, its labels, query domains).
    The labels are all the evaluation needs: the cached gallery's identities, relevant sets per query."""
    spec = load_check_yaml(Path(resolve_location(name)))
    labels = CheckSet(queries=[q["text"] for q in spec["queries"]],
                      relevant=[set(q.get("relevant_identities", [])) | set(q.get("relevant_crops", []))
                                for q in spec["queries"]], gallery_images=[], gallery_identities=identities,
                      gallery_domains=[],
                      gallery_pool_ids=gallery_pool_ids(resolve_location(profile.evaluation.check_set_pool), spec))
    return torch.tensor(gallery), torch.tensor(queries), labels, _check_domains(name)


def streamed_training_data(url: str, profile: Any) -> dict[str, Any]:
    """Streamed pairs: the training pairs as a ``StreamedTraining`` source (a CLIP-like student's
    preprocessing is set once the model exists, ``for_model``), the held-out pairs' index, and the
    check sets: the cached features' rows of them, or their images (bundled, small)."""
    t = profile.training
    index = PairIndex.scan(url, "train")
    dataset = StreamedPairs(index, batch_size=t.batch_size, window=t.shuffle_window, seed=t.seed, preprocess=None)
    data: dict[str, Any] = {"streamed": True, "checks": {}, "held": PairIndex.scan(url, "heldout"),
                            "pairs": StreamedTraining(dataset, workers=t.loader_workers)}
    if not index.features:
        for name in profile.evaluation.check_sets:
            check = load_check_set(resolve_location(profile.evaluation.check_set_pool),
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
                                             [r["text_vector"] for r in qs], profile)
    first = next(r for r in artifact.read_shard(index.shards[0], ["image_views", "text_vector"]).to_pylist())
    data["dims"] = (len(first["image_views"][0]), len(first["text_vector"]))
    return data


def _check_domains(name: str) -> list[str]:
    return [q["domain"] for q in load_check_yaml(Path(resolve_location(name)))["queries"]]


def new_model(data: dict[str, Any], profile: Any) -> torch.nn.Module:
    """The student: the configured CLIP-like model, or the CPU feature model sized to the features."""
    t = profile.training
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


def train_config(profile: Any, **overrides: Any) -> TrainConfig:
    t = profile.training
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
                      "domain": "all", "metric": k, "value": v, "queries": int(m["queries"])}
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


def check_set_features(profile: Any, bridge: Any, embedder: Any) -> Iterator[tuple[str, np.ndarray, list, np.ndarray,
                                                                             list[str]]]:
    """Per check set of the profile: (its name, the gallery's tower features (one view), the gallery's
    identities, the queries' bridge vectors, the queries)."""
    for f in profile.evaluation.check_sets:
        check = load_check_set(resolve_location(profile.evaluation.check_set_pool), Path(resolve_location(f)))
        gallery = image_features(check.gallery_images, [str(i) for i in range(len(check.gallery_images))],
                                 bridge, embedder, None, views=1).stacked()[0]
        yield f, gallery, list(check.gallery_identities), bridge.encode_text(check.queries), list(check.queries)
