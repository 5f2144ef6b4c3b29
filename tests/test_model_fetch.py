"""``rde models fetch``: a profile's Hugging Face ids downloaded into the cache (then loadable offline
by the same id), YOLO weights written to their path, what cannot be fetched reported as missing.

No hub is reachable here: ``tests/hub_standin.py`` serves the Hub's routes on loopback
(``HF_ENDPOINT``), with a tiny BERT built from config as the repo's files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from hub_standin import HubStandIn
from typer.testing import CliRunner

from entry.cli import app
from rde.profile import PROFILE_DIR

REPO = "tiny-org/tiny-bert"


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HubStandIn]:
    from transformers import BertConfig, BertModel

    files = tmp_path / "repo"
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                         vocab_size=99)).save_pretrained(files)
    stand_in = HubStandIn({REPO: files}, {"yolov8n.pt": b"stand-in weights " * 64})
    monkeypatch.setenv("HF_ENDPOINT", stand_in.url)
    monkeypatch.setenv("RDE_YOLO_ASSETS_URL", f"{stand_in.url}/assets")
    try:
        yield stand_in
    finally:
        stand_in.close()


def _profile(tmp_path: Path, text_encoder: str, teacher: str) -> Path:
    """The demo profile with a hub id as text encoder, a YOLO detector and a teacher of the given id."""
    data = yaml.safe_load((PROFILE_DIR / "demo.yaml").read_text())
    data["models"]["text_encoder"] = {"backend": "sentence-transformers", "model_id": text_encoder}
    data["models"]["detector"] = {"backend": "yolo", "weights": str(tmp_path / "weights" / "yolov8n.pt")}
    data["models"]["teacher"] = {"backend": "vlm-embedding", "model_id": teacher}
    path = tmp_path / "profile.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _fetch(profile: Path, cache: Path) -> tuple[int, dict[str, dict]]:
    result = CliRunner().invoke(app, ["models", "fetch", "--profile", str(profile), "--cache-dir", str(cache),
                                      "--json"])
    return result.exit_code, {r["role"]: r for r in json.loads(result.output)}


def test_fetch_downloads_hub_ids_and_yolo_weights_and_a_second_fetch_finds_them(
        hub: HubStandIn, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    code, rows = _fetch(_profile(tmp_path, REPO, REPO), cache)
    assert code == 0, rows
    assert rows["text_encoder"]["status"] == "fetched" and rows["text_encoder"]["size"] > 0
    snapshot = Path(rows["text_encoder"]["where"])
    assert snapshot.is_relative_to(cache) and {p.name for p in snapshot.iterdir()} == {"config.json",
                                                                                       "model.safetensors"}
    assert rows["teacher"]["status"] == "present"  # the same repo: fetched once, then found in the cache
    assert (tmp_path / "weights" / "yolov8n.pt").read_bytes() == b"stand-in weights " * 64
    assert rows["detector"]["status"] == "fetched"
    assert rows["image_embedder"]["status"] == "present"  # bundled: nothing to download
    downloads = [r for r in hub.requests if r.startswith("GET /tiny-org/tiny-bert/resolve/")]
    assert len(downloads) == 2  # config.json and the weights, once each

    # what a run does: the same id, loaded offline from the cache the fetch wrote
    from huggingface_hub import constants
    from transformers import AutoModel

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert AutoModel.from_pretrained(REPO, cache_dir=cache).config.hidden_size == 32

    hub.requests.clear()
    code, rows = _fetch(_profile(tmp_path, REPO, REPO), cache)
    assert code == 0 and {rows[r]["status"] for r in ("text_encoder", "teacher", "detector")} == {"present"}
    assert hub.requests == []  # nothing asked of the hub the second time


def test_what_cannot_be_fetched_is_missing_with_the_reason(hub: HubStandIn, tmp_path: Path) -> None:
    code, rows = _fetch(_profile(tmp_path, "tiny-org/no-such-model", "models/weights/UniME-local"),
                        tmp_path / "cache")
    assert code == 1
    assert rows["text_encoder"]["status"] == "missing" and "download failed" in rows["text_encoder"]["note"]
    assert "RepositoryNotFound" in rows["text_encoder"]["note"] or "404" in rows["text_encoder"]["note"]
    assert rows["teacher"]["status"] == "missing" and "local path models/weights/UniME-local not found" in \
        rows["teacher"]["note"]
    assert rows["detector"]["status"] == "fetched"  # the others still fetched
    assert not list((tmp_path / "cache").rglob("*.incomplete"))


def test_fetch_downloads_an_open_vocabulary_detector_by_hub_id(tmp_path: Path) -> None:
    """detector.backend owl names a Hugging Face id (production: an OWLv2): fetched like the other
    hub models, and then found in the cache by `rde models` and by the next fetch."""
    from tiny_models import build_tiny_owl

    stand_in = HubStandIn({"tiny-org/tiny-owl": build_tiny_owl(tmp_path / "owl")}, {})
    data = yaml.safe_load((PROFILE_DIR / "demo.yaml").read_text())
    data["models"]["detector"] = {"backend": "owl", "model_id": "tiny-org/tiny-owl"}
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(data))
    cache = tmp_path / "cache"
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", stand_in.url)
        try:
            code, rows = _fetch(profile, cache)
            again_code, again = _fetch(profile, cache)
        finally:
            stand_in.close()
    assert code == 0 and rows["detector"]["status"] == "fetched", rows["detector"]
    snapshot = Path(rows["detector"]["where"])
    assert {"config.json", "model.safetensors", "preprocessor_config.json"} <= {p.name for p in snapshot.iterdir()}
    assert again_code == 0 and again["detector"]["status"] == "present"


def test_fetch_downloads_the_production_text_llm_once_for_both_roles(tmp_path: Path) -> None:
    """production.yaml's query_generator and template_generator (one Qwen3 id): fetched through the
    hub stand-in (a tiny Qwen3 as that repo), once; the second role finds it in the cache."""
    from tiny_models import build_tiny_qwen3

    production = yaml.safe_load((PROFILE_DIR / "production.yaml").read_text())["models"]
    spec = production["query_generator"]
    assert production["template_generator"] == spec and spec["backend"] == "vllm"
    stand_in = HubStandIn({spec["model_id"]: build_tiny_qwen3(tmp_path / "qwen3")}, {})
    data = yaml.safe_load((PROFILE_DIR / "demo.yaml").read_text())
    data["models"].update(query_generator=spec, template_generator=spec)
    profile = tmp_path / "profile.yaml"
    profile.write_text(yaml.safe_dump(data))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_ENDPOINT", stand_in.url)
        try:
            code, rows = _fetch(profile, tmp_path / "cache")
        finally:
            stand_in.close()
    assert code == 0, rows
    first, second = rows["query_generator"], rows["template_generator"]
    assert (first["model"], first["status"]) == (spec["model_id"], "fetched") and first["size"] > 0
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in Path(first["where"]).iterdir()}
    assert second["status"] == "present" and first["where"] in second["where"]
    weights = [r for r in stand_in.requests if r.startswith("GET ") and r.endswith("/model.safetensors")]
    assert len(weights) == 1
