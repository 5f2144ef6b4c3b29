"""What the VEDJE stages share: the backbone and stage-1 expert a profile names, its source items,
and the trained model saved (weights + description) and loaded back."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from models.backends.registry import BUNDLED_IMAGE_EMBEDDER, spec_lineage
from models.reranker.vedje import Vedje
from models.specs import ModelSpec
from rde.common.reasons import rejected_row
from rde.vedje.data import ItemSet, load_items
from rde.vedje.features import tensors_from_tables
from rde.vedje.training import VedjeTensors, build_model
from storage import Artifact
from storage.filesystem import join
from storage.locations import flow_root, resolve_location
from storage.schemas import REJECTS


def backbone_spec(profile: Any) -> ModelSpec:
    """The frozen backbone: ``vedje.backbone``, else the profile's image embedder, else the bundled one."""
    return profile.vedje.backbone or profile.models.image_embedder or BUNDLED_IMAGE_EMBEDDER


def stage1_spec(profile: Any) -> ModelSpec:
    """The stage-1 retriever: ``vedje.first_stage``, else the profile's first expert."""
    p = profile
    if p.vedje.first_stage is None and not p.models.experts:
        raise ValueError("vedje needs a stage-1 expert: set vedje.first_stage or models.experts")
    return p.vedje.first_stage or p.models.experts[0]


def source_root(profile: Any, output_root: str | None) -> str:
    """The folder the profile's items come from: the clip set, or the build-largefine run (the
    ``vedje.source_flow``) under the same output."""
    v = profile.vedje
    if v.source == "clips":
        return resolve_location(v.clips_path)
    return flow_root(profile.artifacts_root, v.source_flow, profile.name, output_root)


def source_artifact(profile: Any, output_root: str | None) -> Artifact:
    """The artifact the items are read from: the clip set's ``clips``, or the run's ``largefine``."""
    name = "clips" if profile.vedje.source == "clips" else "largefine"
    return Artifact(join(source_root(profile, output_root), name))


def source_items(profile: Any, output_root: str | None) -> tuple[ItemSet, list[Artifact]]:
    """The profile's items and the artifact they come from."""
    root = None if profile.vedje.source == "clips" else source_root(profile, output_root)
    return load_items(profile, root), [source_artifact(profile, output_root)]


def source_rejects(items: ItemSet) -> pa.Table:
    detail = {"split_gap": "clip between the train and test periods (so no test frame is trained on)"}
    return pa.Table.from_pylist([rejected_row(f"{reason}:{k}", "vedje-features", reason, kind="item",
                                              detail=detail.get(reason))
                                 for reason, n in items.rejected.items() for k in range(n)], schema=REJECTS)


def load_tensors(urls: dict[str, str]) -> VedjeTensors:
    """The features artifacts (``frames``, ``items``, ``queries`` → their URLs) as training tensors."""
    return tensors_from_tables(*(pa.concat_tables([t for _, t in Artifact(urls[n]).iter_shards()])
                                 for n in ("frames", "items", "queries")))


def model_folder(profile: Any, output_root: str | None) -> Path:
    """Where ``train-vedje`` keeps the weights (``model.pt``) and their description (``model.json``)."""
    return Path(join(flow_root(profile.artifacts_root, "train-vedje", profile.name, output_root), "vedje_model"))


def save_model(model: Vedje, folder: Path, profile: Any, item_dim: int) -> dict[str, Any]:
    """The weights and their description (shape, joint encoder, the lineage of caches it writes)."""
    folder.mkdir(parents=True, exist_ok=True)
    spec = profile.vedje
    meta = {"shape": asdict(model.shape), "item_dim": item_dim, "joint_encoder": spec.joint_encoder.model_dump(),
            "max_text_tokens": spec.max_text_tokens, "cache_lineage": cache_lineage(model, profile)}
    tmp = folder / "model.pt.tmp"
    torch.save(model.state_dict(), tmp)
    tmp.replace(folder / "model.pt")
    (folder / "model.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
    return meta


def cache_lineage(model: Vedje, profile: Any) -> dict[str, Any]:
    """What a cache written by this model depends on: backbone, compressor weights, layout."""
    return {"backbone": spec_lineage(backbone_spec(profile)), "compressor": model.compressor_fingerprint(),
            "frames": model.shape.frames, "tokens_per_frame": model.shape.tokens_per_frame, "dim": model.reranker.d}


def load_model(profile: Any, output_root: str | None) -> tuple[Vedje, dict[str, Any]]:
    """The trained model of this profile's ``train-vedje`` run (clear error when there is none),
    rebuilt from the profile's ``vedje`` architecture fields and the saved shape."""
    folder = model_folder(profile, output_root)
    if not (folder / "model.json").exists():
        raise FileNotFoundError(f"no trained reranker at {folder}: run `rde train-vedje --profile "
                                f"{profile.name}` first")
    meta = json.loads((folder / "model.json").read_text())
    shape = {"compressor_norm": "post"} | meta["shape"]  # models saved before the option were post-norm
    trained = ModelSpec(**{**meta["joint_encoder"], "device": profile.vedje.joint_encoder.device})
    spec = profile.vedje.model_copy(update={"joint_encoder": trained, "max_text_tokens": meta["max_text_tokens"]})
    model = build_model(spec, shape["d_v"], shape["patches"], shape["frames"], meta["item_dim"],
                        **{k: v for k, v in shape.items() if k not in ("d_v", "patches", "frames")}
                        | {"horizons": tuple(shape["horizons"])})
    model.load_state_dict(torch.load(folder / "model.pt", map_location="cpu", weights_only=True))
    model.eval()
    return model, meta
