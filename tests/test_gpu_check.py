"""Smoke test of scripts/gpu_check.py: the --tiny CPU run goes through the same code path as the GPU check
(random-weight DINOv2, CLIP and Qwen2-VL built from config, image-conditioned generate, projection, and
the production path on tiny models: here build-secmm only, against the session's Prefect server)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from entry.tiny_production import SLICE_IMAGES

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
NEW_TOKENS = 8
BATCHES = (1, 2, 4)


pytestmark = pytest.mark.slow  # the path check runs a flow


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory, shared_server_env: dict[str, str]) -> dict:
    out = tmp_path_factory.mktemp("gpu_check") / "gpu-check.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cpu", "--json", str(out),
           "--new-tokens", str(NEW_TOKENS), "--batches", ",".join(map(str, BATCHES)), "--path-flows", "build-secmm",
           "--path-dir", str(out.parent / "path")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300, env=shared_server_env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Projection:" in proc.stdout and "assumptions:" in proc.stdout
    return json.loads(out.read_text())


def test_embedders_report_positive_throughput(report: dict) -> None:
    assert report["meta"]["tiny"] is True
    assert report["meta"]["weights"] == "random, built from config"
    assert report["dinov2"]["status"] == "ok" and report["dinov2"]["images_per_s"] > 0
    assert report["clip"]["image"]["status"] == "ok" and report["clip"]["image"]["images_per_s"] > 0
    assert report["clip"]["text"]["status"] == "ok" and report["clip"]["text"]["texts_per_s"] > 0


def test_generator_makes_exactly_the_requested_tokens(report: dict) -> None:
    gen = report["generator"]
    assert gen["new_tokens"] == NEW_TOKENS
    assert sorted(gen["batches"], key=int) == [str(b) for b in BATCHES]
    for key, entry in gen["batches"].items():
        assert entry["status"] == "ok", entry
        assert entry["tokens_per_s"] > 0 and entry["requests_per_s"] > 0
        assert entry["tokens_per_s"] == pytest.approx(entry["requests_per_s"] * NEW_TOKENS)
        # --tiny makes nearly every id an EOS id: only min_new_tokens keeps each request going to the end.
        assert entry["generated_lengths"] == [NEW_TOKENS] * int(key)
        assert entry["output_new_tokens"] == NEW_TOKENS
        assert entry["image_tokens_per_request"] == 64  # 224x224 -> 16x16 patches -> 2x2 merge


def test_projection_scales_linearly_with_gpus(report: dict) -> None:
    proj = report["projection"]
    assert proj["images"] == 1_200_000
    assert proj["generation_batch"] == max(BATCHES)
    assert len(proj["assumptions"]) >= 5
    one, eight = proj["gpus"]["1"], proj["gpus"]["8"]
    assert "32" in proj["gpus"]
    for part in ("dinov2", "clip_image", "caption_base", "caption_inter", "caption_adv", "captions_total", "total"):
        assert one[part] > 0 and eight[part] > 0, part
        assert eight[part] == pytest.approx(one[part] / 8), part


def test_the_path_check_runs_build_secmm_on_the_tiny_production_profile(report: dict) -> None:
    path = report["path"]
    assert path["status"] == "ok" and path["device"] == "cpu" and path["generator_backend"] == "transformers-vlm"
    assert list(path["flows"]) == ["build-secmm"]
    secmm = path["flows"]["build-secmm"]
    assert secmm["balanced"] and secmm["inputs"] == SLICE_IMAGES
    stages = {s["stage"]: s for s in secmm["stages"]}
    assert stages["denoise"]["accepted"] > 0 and stages["cgds"]["accepted"] > 0
    assert (Path(path["workdir"]) / "artifacts" / "build-secmm" / "tiny-production" / "gallery").is_dir()
