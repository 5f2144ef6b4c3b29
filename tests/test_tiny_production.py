"""The production path end to end on tiny random-weight models (``profiles/tiny-production.yaml``).

Two runs over one 12-crop slice of the demo pool (11 pedestrians, a vehicle):

1. the profile's own models (the generators through ``transformers-vlm``: in-process vLLM needs a
   GPU): build-secmm and build-largefine account for every input and reject every random text with
   a reason; the training flows then stop with a message, not a traceback, since no caption is left;
2. the same path with the offline grounded captioner writing the captions, so that train-saft,
   train-gtr, train-vedje, index-cache and rerank run on the production training backends (the CLIP
   student, the Qwen2-VL teacher, the DINOv2 backbone, the BERT joint encoder); the student's
   data-parallel processes are tested in test_flow_training.py.

Every manifest names the tiny models (or the grounded captioner's bundled parts).
"""

from __future__ import annotations

import copy
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from entry.tiny_models import TINY_MODELS_FOLDER, TINY_PRODUCTION
from entry.tiny_production import (
    DEMO_POOL,
    FLOWS,
    SLICE_IMAGES,
    SLICE_STEP,
    FlowOutcome,
    PathRun,
)
from rde.common.caption_source import NoCaptionsError
from storage import Artifact

PROFILES = Path(__file__).resolve().parent.parent / "profiles"
TINY = str(TINY_MODELS_FOLDER)
# the grounded run's captioner phrases its facts with the bundled SmolLM2 and adds its own parts
# (production names every model, its text LLM included: no role falls back to a bundled one)
BUNDLED = {"bundled:SmolLM2-135M-Instruct"}
GROUNDED_PARTS = {"grounded-captioner-v1", "efficientnet-lite0"}
GROUNDED = {"backend": "grounded", "model_id": "grounded-captioner-v1",
            "options": {"llm": {"backend": "llama-cpp", "model_id": "bundled:SmolLM2-135M-Instruct",
                                "options": {"contexts": 2}}}}
SMALL_LARGEFINE = {"max_images": 6, "shard_size": 3, "tier_prompt": "gtr_tiers_small",
                   "templates": {"sample_captions": 4, "rounds": 1}}


# -- the profile against production.yaml -----------------------------------------------------------

def key_paths(node: Any, prefix: str = "") -> set[str]:
    """Every key path of a YAML tree; list items of mappings by position (``experts[1].backend``),
    lists of scalars as one leaf."""
    if isinstance(node, dict):
        out = set()
        for key, value in node.items():
            out |= {f"{prefix}{key}"} | key_paths(value, f"{prefix}{key}.")
        return out
    if isinstance(node, list) and any(isinstance(item, dict) for item in node):
        return set().union(*(key_paths(item, f"{prefix[:-1]}[{i}].") for i, item in enumerate(node)))
    return set()


def backends(profile: dict[str, Any]) -> dict[str, Any]:
    """Each model role's backend (a list for experts and generators), the student's and the reranker's."""
    models = profile["models"]
    out: dict[str, Any] = {role: [s["backend"] for s in spec] if isinstance(spec, list) else spec["backend"]
                           for role, spec in models.items()}
    out["training.model"] = profile["training"]["model"]["backend"]
    out |= {f"vedje.{part}": profile["vedje"][part]["backend"] for part in ("backbone", "joint_encoder")}
    return out


def drift(production: dict[str, Any], tiny: dict[str, Any]) -> list[str]:
    """What one profile has that the other lacks: keys and backends."""
    a, b = key_paths(production), key_paths(tiny)
    out = [f"only in production.yaml: {k}" for k in sorted(a - b)] + [f"only in tiny-production: {k}"
                                                                      for k in sorted(b - a)]
    pa_, pb = backends(production), backends(tiny)
    return out + [f"{role}: {pa_.get(role)} vs {pb.get(role)}" for role in sorted(set(pa_) | set(pb))
                  if pa_.get(role) != pb.get(role)]


def _load(name: str) -> dict[str, Any]:
    return yaml.safe_load((PROFILES / f"{name}.yaml").read_text())


def test_tiny_production_has_the_keys_and_backends_of_production() -> None:
    production, tiny = _load("production"), _load("tiny-production")
    assert drift(production, tiny) == []
    # and the comparison sees a key added to one side, or a backend changed, in any section
    for change in (lambda p: p["models"]["experts"][1].update(revision="main"),
                   lambda p: p["vedje"].update(first_stage=None),
                   lambda p: p["models"]["generators"][0].update(backend="transformers-vlm"),
                   lambda p: p["training"]["model"].update(backend="transformers"),
                   lambda p: p.pop("retrieval")):
        changed = copy.deepcopy(tiny)
        change(changed)
        assert drift(production, changed), change


def test_every_model_the_profile_names_is_a_tiny_one_it_builds() -> None:
    text = (PROFILES / "tiny-production.yaml").read_text()
    named = {line.split(f"{TINY}/", 1)[1].split()[0].rstrip(",}") for line in text.splitlines()
             if f"{TINY}/" in line and not line.lstrip().startswith("#")}
    assert named == set(TINY_PRODUCTION)


def test_models_tiny_builds_what_the_profile_names(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from entry.cli import app

    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["models", "--profile", "tiny-production", "--no-load"]).exit_code == 1  # none yet
    built = runner.invoke(app, ["models", "tiny"])
    assert built.exit_code == 0, built.output
    assert json.loads((tmp_path / TINY / "tiny-models.json").read_text()) == {
        name: f"{TINY}/{name}" for name in TINY_PRODUCTION}
    listed = runner.invoke(app, ["models", "--profile", "tiny-production", "--no-load"])
    assert listed.exit_code == 0 and "missing" not in listed.output, listed.output


# -- the path, run ----------------------------------------------------------------------------------

def _by_flow(outcomes: list[FlowOutcome]) -> dict[str, FlowOutcome]:
    return {o.flow: o for o in outcomes}


@pytest.fixture(scope="module")
def random_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[PathRun, dict[str, FlowOutcome]]:
    # four images captioned: the tiers' accounting needs no more
    run = PathRun(tmp_path_factory.mktemp("tiny-production"), extra={"largefine": {"max_images": 4, "shard_size": 2}})
    return run, _by_flow(run.run(FLOWS[:5], stop_on=(NoCaptionsError,)))


@pytest.fixture(scope="module")
def grounded_run(random_run: tuple[PathRun, dict[str, FlowOutcome]]) -> tuple[PathRun, dict[str, FlowOutcome]]:
    first, _ = random_run
    run = PathRun(first.workdir, artifacts="artifacts-grounded",
                  extra={"models": {"generators": [GROUNDED]}, "largefine": SMALL_LARGEFINE})
    return run, _by_flow(run.run(FLOWS[1:]))


def _root(run: PathRun, flow: str) -> Path:
    return Path(run.output_root, flow, "tiny-production")


def _slice_domains() -> Counter:
    rows = Artifact(str(DEMO_POOL)).rows(["domain"])[::SLICE_STEP][:SLICE_IMAGES]
    return Counter(r["domain"] for r in rows)


def _model_ids(node: Any) -> set[str]:
    """Every ``model_id`` and detector ``weights`` in a manifest's models or config."""
    if isinstance(node, dict):
        found = {v for k, v in node.items() if k in ("model_id", "weights") and isinstance(v, str)}
        return found.union(*(_model_ids(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(_model_ids(v) for v in node))
    return set()


def _manifest_model_ids(root: Path) -> dict[str, set[str]]:
    """Artifact folder → the model ids its manifest names (shared artifacts: each keyed copy)."""
    out = {}
    for manifest in root.rglob("_manifest.json"):
        data = json.loads(manifest.read_text())
        out[str(manifest.parent.relative_to(root))] = _model_ids(data.get("models")) | _model_ids(data.get("config"))
    return out


def _unprefixed(model_id: str) -> str:
    """An embedding cache names its model ``<role>:<model id>`` (``expert:.rde/tiny-models/siglip``)."""
    role, _, rest = model_id.partition(":")
    return rest if rest and role == "expert" else model_id


def _tiny(name: str) -> str:
    return f"{TINY}/{name}"


@pytest.mark.slow
def test_random_models_leave_every_input_accounted_for(random_run: tuple[PathRun, dict[str, FlowOutcome]]) -> None:
    run, outcomes = random_run
    domains = _slice_domains()
    assert domains["vehicle"] >= 1 and domains["pedestrian"] >= 8
    secmm = outcomes["build-secmm"].summary
    assert secmm and secmm["balanced"] and secmm["inputs"] == SLICE_IMAGES
    stages = {s["stage"]: s for s in secmm["stages"]}
    # the tiny detector sees one person in every crop: each vehicle has no target of its domain
    rejects = Artifact(str(_root(run, "build-secmm") / "denoise_rejects")).rows(["domain", "all_reasons"])
    assert stages["denoise"]["accepted"] + len(rejects) == SLICE_IMAGES
    vehicles = [r for r in rejects if r["domain"] == "vehicle"]
    assert len(vehicles) == domains["vehicle"] and all("no_target" in r["all_reasons"] for r in vehicles)
    assert all("no_target" not in r["all_reasons"] for r in rejects if r["domain"] == "pedestrian")
    # every random caption is rejected with a reason; byte soup is named as such
    pool = stages["caption-pool"]
    assert pool["accepted"] == 0 and pool["rejected"] == pool["input"] > 0
    reasons = Counter(r["reason"] for r in Artifact(str(_root(run, "build-secmm") / "caption_pool_rejects")).rows(
        ["reason"]))
    assert reasons["garbled"] > 0, reasons
    assert stages["dap"]["accepted"] == 0 and stages["dap"]["rejected"] == stages["dap"]["input"]
    # evaluate scored every expert on the check set, at auto batch sizes
    scored = {r["expert"] for r in Artifact(str(_root(run, "build-secmm") / "evaluation")).rows(["expert"])}
    for name in ("siglip", "qwen2vl-embedding-a", "qwen2vl-embedding-b"):
        assert any(_tiny(name) in expert for expert in scored), (name, scored)

    largefine = outcomes["build-largefine"].summary
    assert largefine and largefine["balanced"]
    root = _root(run, "build-largefine")
    neighbours = Artifact(str(root / "neighbours")).rows(["image_id", "generator_index"])
    captions = Artifact(str(root / "largefine"))
    rejected = Artifact(str(root / "caption_rejects")).rows(["image_id", "stage", "reason"])
    assert captions.count_rows() == 0 and len(rejected) == 3 * len(neighbours) > 0
    # random tokens give no two answered "Q:"/"A:" pairs, so the base and intermediate tiers end as
    # malformed_qa before a summary is asked for, and the advanced tier lacks both of its inputs
    tiers = {"tier-base": "malformed_qa", "tier-inter": "malformed_qa", "tier-adv": "missing_tier_input"}
    assert sorted((r["image_id"], r["stage"]) for r in rejected) == sorted(
        (n["image_id"], stage) for n in neighbours for stage in tiers)
    assert all(r["reason"] == tiers[r["stage"]] for r in rejected)
    # both generators caption some images; the manifest names both, through the CPU's backend
    assert {r["generator_index"] for r in neighbours} == {0, 1}
    generators = Artifact(str(root / "tier12_captions")).manifest().models["generators"]
    assert [(g["model_id"], g["backend"], g["batch_size"]) for g in generators] == [
        (_tiny("qwen2vl-generator-a"), "transformers-vlm", 8), (_tiny("qwen2vl-generator-b"), "transformers-vlm", 8)]


@pytest.mark.slow
def test_training_on_a_run_that_kept_no_caption_stops_with_a_message(
        random_run: tuple[PathRun, dict[str, FlowOutcome]]) -> None:
    _, outcomes = random_run
    for flow in ("train-saft", "train-gtr", "train-vedje"):
        error = outcomes[flow].error
        assert error and error.startswith("NoCaptionsError: ") and "kept no caption" in error, (flow, error)
        assert "malformed_qa" in error and "caption_rejects" in error


@pytest.mark.slow
def test_the_training_and_reranker_flows_run_on_the_production_backends(
        grounded_run: tuple[PathRun, dict[str, FlowOutcome]]) -> None:
    run, outcomes = grounded_run
    for flow in FLOWS[1:]:
        summary = outcomes[flow].summary
        assert summary is not None and summary["balanced"], (flow, summary)
    assert Artifact(str(_root(run, "build-largefine") / "largefine")).count_rows() > 0
    saft = {s["stage"]: s for s in outcomes["train-saft"].summary["stages"]}
    assert saft["train_saft"]["accepted"] > 0
    # streamed pairs for the CLIP student: a shard per shard of captions, each caption with its image's
    # encoded bytes and the teacher's vectors
    pairs = Artifact(outcomes["train-saft"].summary["artifacts"]["training_features"]["url"])
    caption_shards = len(Artifact(str(_root(run, "build-largefine") / "largefine")).manifest().shards)
    assert pairs.manifest().kind == "training_pairs" and len(pairs.manifest().shards) == caption_shards
    first = pairs.read_shard(0, ["image", "teacher_image"]).to_pylist()[0]
    assert first["image"][:2] == b"\xff\xd8" and len(first["teacher_image"]) > 0  # JPEG bytes, not pixels
    folder = _root(run, "train-saft") / "train_saft"
    stats = Artifact(str(folder) + "_log").manifest().stats
    assert stats["batches"] > 0 and 0.0 <= stats["data_stall_share"] <= 1.0
    evaluation = Artifact(str(folder) + "_evaluation").rows()
    assert {r["expert"] for r in evaluation} == {"zero-shot", "saft"} and {"R@1", "mAP"} <= {
        r["metric"] for r in evaluation}
    weights = __import__("torch").load(folder / "model.pt", weights_only=True)
    assert any(k.startswith("model.vision_model") for k in weights)
    features = _manifest_model_ids(Path(run.output_root, "shared", "tiny-production"))
    assert features and all({_tiny("qwen2vl-teacher"), _tiny("clip")} <= ids for ids in features.values())
    assert _tiny("clip") in set().union(*_manifest_model_ids(_root(run, "train-gtr")).values())
    vedje = set().union(*_manifest_model_ids(_root(run, "train-vedje")).values())
    assert {_tiny("dinov2"), _tiny("bert"), _tiny("siglip")} <= vedje
    ranked = Artifact(str(_root(run, "rerank") / "reranked")).rows(["query_id", "relevant"])
    assert ranked and any(r["relevant"] for r in ranked)


@pytest.mark.slow
def test_every_manifest_names_only_tiny_or_bundled_models(random_run: tuple[PathRun, dict[str, FlowOutcome]],
                                                          grounded_run: tuple[PathRun, dict[str, FlowOutcome]]) -> None:
    named: set[str] = set()
    # the random run names no bundled model: DAP and the template gallery ran the tiny Qwen3
    for run, allowed_extra in ((random_run[0], set()), (grounded_run[0], BUNDLED | GROUNDED_PARTS)):
        for folder, found in _manifest_model_ids(Path(run.output_root)).items():
            ids = {_unprefixed(i) for i in found}
            assert all(i.startswith(f"{TINY}/") or i in allowed_extra for i in ids), (folder, ids)
            named |= ids
    assert {i.removeprefix(f"{TINY}/") for i in named if i.startswith(TINY)} == set(TINY_PRODUCTION)
