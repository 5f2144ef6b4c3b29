"""Profiles: bundled ones load; unknown keys and wrong types are rejected naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from rde.profile import PROFILE_DIR, ProfileError, load_profile, parse_profile


def _demo() -> dict:
    return yaml.safe_load((PROFILE_DIR / "demo.yaml").read_text())


def test_bundled_profiles_load() -> None:
    demo = load_profile("demo")
    prod = load_profile("production")
    assert demo.name == "demo" and demo.models.detector.backend == "ssd_mobilenet"
    assert prod.sampling.clusters_per_domain == 100
    assert (prod.sampling.min_per_cluster, prod.sampling.max_per_cluster) == (100, 1000)
    assert prod.retrieval.top_k == 1000 and prod.queries.per_domain == 100
    assert prod.models.detector.backend == "yolo"
    # GTR+ denoising defaults (paper Sec. 3.3)
    for p in (demo, prod):
        assert (p.denoise.min_width, p.denoise.min_height, p.denoise.min_laplacian_variance) == (32, 64, 80.0)
        assert p.denoise.required_target_count == 1
        # per-domain size rule: people keep GTR+'s 32x64, vehicles the same area with the axes swapped
        assert p.denoise.size_rule("pedestrian").model_dump() == {"min_width": 32, "min_height": 64}
        assert p.denoise.size_rule("vehicle").model_dump() == {"min_width": 64, "min_height": 32}


def test_unknown_key_is_named() -> None:
    data = _demo()
    data["denoise"]["min_widht"] = 10
    with pytest.raises(ProfileError, match=r"denoise\.min_widht: unknown key"):
        parse_profile(data, "x.yaml")


def test_wrong_type_is_named_with_value() -> None:
    data = _demo()
    data["ingest"]["shard_size"] = "many"
    with pytest.raises(ProfileError, match=r"ingest\.shard_size: .*integer.*'many'"):
        parse_profile(data, "x.yaml")


def test_semantic_checks() -> None:
    data = _demo()
    data["models"]["detector"] = {"backend": "yolo"}
    with pytest.raises(ProfileError, match=r"needs detector\.weights"):
        parse_profile(data)
    data = _demo()
    data["sampling"].update(min_per_cluster=50, max_per_cluster=10)
    with pytest.raises(ProfileError, match="min_per_cluster must not exceed"):
        parse_profile(data)
    data = _demo()
    data["domains"].append("pedestrian")
    with pytest.raises(ProfileError, match="names must be unique"):
        parse_profile(data)
    data = _demo()
    data["input"]["default_domain"] = "boats"
    with pytest.raises(ProfileError, match="'boats' is not one of domains"):
        parse_profile(data)
    data = _demo()
    data["denoise"]["size_by_domain"] = {"boats": {"min_width": 64, "min_height": 32}}
    with pytest.raises(ProfileError, match=r"denoise\.size_by_domain \['boats'\] are not among domains"):
        parse_profile(data)


def test_load_errors_are_user_messages(tmp_path: Path) -> None:
    with pytest.raises(ProfileError, match="bundled profiles: demo, production"):
        load_profile("nope")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(str(bad))
    bad.write_text("- a list\n")
    with pytest.raises(ProfileError, match="expected a mapping"):
        load_profile(str(bad))


def test_overrides_merge_and_validate() -> None:
    prof = load_profile("demo", {"denoise": {"min_laplacian_variance": 120}})
    assert prof.denoise.min_laplacian_variance == 120 and prof.denoise.min_width == 32
    with pytest.raises(ProfileError, match=r"denoise\.min_laplacian_variance"):
        load_profile("demo", {"denoise": {"min_laplacian_variance": -1}})


def test_section_hash_tracks_only_named_sections() -> None:
    a = load_profile("demo")
    b = load_profile("demo", {"sampling": {"seed": 5}})
    assert a.section_hash("denoise") == b.section_hash("denoise")
    assert a.section_hash("sampling") != b.section_hash("sampling")


def test_a_gpu_profile_names_its_text_llms_or_says_so_at_load() -> None:
    """Production names Qwen3 for DAP and the template gallery (SecMM App. A: the DAP prompts "are
    fed into Qwen3"); a GPU profile that leaves either unset would fall back to the bundled 135M CPU
    model, so it does not load: one line naming the key and a value. CPU profiles may leave them."""
    from rde.profile import BUNDLED_TEXT_LLM, GPU_TEXT_LLM

    production = yaml.safe_load((PROFILE_DIR / "production.yaml").read_text())
    for role in ("query_generator", "template_generator"):
        assert production["models"][role] == GPU_TEXT_LLM  # the suggestion is what production runs
    assert GPU_TEXT_LLM["model_id"].startswith("Qwen/Qwen3-")
    unset = copy.deepcopy(production)
    del unset["models"]["query_generator"]
    with pytest.raises(ProfileError) as err:
        parse_profile(unset, "gpu.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith(
        "invalid profile gpu.yaml: models.query_generator is unset on a GPU profile (models.detector.device: cuda)")
    assert "model_id: Qwen/Qwen3-4B-Instruct-2507" in message and "template_generator" not in message
    del unset["models"]["template_generator"]
    with pytest.raises(ProfileError, match=r"models\.query_generator and models\.template_generator are unset"):
        parse_profile(unset, "gpu.yaml")
    # a vLLM backend is a GPU too, with every device cpu
    demo = _demo()
    del demo["models"]["template_generator"]
    parse_profile(demo)  # a CPU profile may fall back
    demo["models"]["generators"] = [{"backend": "vllm", "model_id": "Qwen/Qwen2-VL-7B-Instruct"}]
    with pytest.raises(ProfileError, match=r"models\.template_generator is unset .*models\.generators\[0\]"
                                           r"\.backend: vllm"):
        parse_profile(demo)
    # the bundled model written out is a choice, and passes
    unset["models"]["query_generator"] = unset["models"]["template_generator"] = BUNDLED_TEXT_LLM
    assert parse_profile(unset).models.query_generator.model_id == "bundled:SmolLM2-135M-Instruct"
