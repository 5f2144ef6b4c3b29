"""scripts/gpu_check.py, the one-GPU throughput check, run with ``--tiny`` on the CPU: the code path
of the GPU run on random-weight tiny DINOv2, CLIP and Qwen2-VL built from config (image-conditioned
generate, the 1.2M-image projection, and the production path on tiny models: here build-secmm only,
against the session's Prefect server). Where CUDA is there, the same tiny run goes on the GPU too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

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


def test_tiny_cpu_run_embedders_report_positive_throughput(report: dict) -> None:
    assert report["meta"]["tiny"] is True and report["meta"]["device"] == "cpu" and report["meta"]["dtype"] == "fp32"
    assert report["meta"]["weights"] == "random, built from config"
    assert report["dinov2"]["status"] == "ok" and report["dinov2"]["images_per_s"] > 0
    assert report["clip"]["image"]["status"] == "ok" and report["clip"]["image"]["images_per_s"] > 0
    assert report["clip"]["text"]["status"] == "ok" and report["clip"]["text"]["texts_per_s"] > 0


def test_tiny_cpu_run_generator_makes_exactly_the_requested_tokens(report: dict) -> None:
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


def test_tiny_cpu_run_projects_hours_from_the_measured_rates(report: dict) -> None:
    """Hours of the 1.2M-image build, derived here from the run's own measured rates and the tier
    shape the script documents (its defaults): per image one DINOv2 and one CLIP image embedding,
    no CLIP text; base = 2 requests of 1 image, 180 tokens; inter = 2 requests of 2 images, 200
    tokens; adv = 1 request of 1 image, 60 tokens. A request's prefill also yields its first token,
    every later token is one decode step; both are shared by the batch (the largest measured, 4).
    Rel. tolerance 1e-9 (the same float inputs, summed in another order)."""
    proj = report["projection"]
    assert proj["images"] == 1_200_000 and len(proj["assumptions"]) >= 5
    assert proj["generation_batch"] == max(BATCHES) and sorted(proj["gpus"], key=int) == ["1", "8", "32"]
    assert proj["requests_per_image"] == 2 + 2 + 1 and proj["generated_tokens_per_image"] == 180 + 200 + 60
    gen = report["generator"]["batches"][str(max(BATCHES))]
    prefill, step, batch = gen["prefill_s"], gen["decode_step_s"], max(BATCHES)
    seconds = {"dinov2": 1 / report["dinov2"]["images_per_s"],
               "clip_image": 1 / report["clip"]["image"]["images_per_s"], "clip_text": 0.0,
               "caption_base": (2 * 1 * prefill + (180 - 2) * step) / batch,
               "caption_inter": (2 * 2 * prefill + (200 - 2) * step) / batch,
               "caption_adv": (1 * 1 * prefill + (60 - 1) * step) / batch}
    assert proj["per_image_gpu_seconds"] == pytest.approx(seconds, rel=1e-9)
    for n in (1, 8, 32):
        hours = {part: s * 1_200_000 / n / 3600 for part, s in seconds.items()}
        hours["captions_total"] = hours["caption_base"] + hours["caption_inter"] + hours["caption_adv"]
        hours["total"] = sum(h for part, h in hours.items() if part != "captions_total")
        assert proj["gpus"][str(n)] == pytest.approx(hours, rel=1e-9), n
    # the intermediate tier costs more than the base one (twice the images per prefill, more tokens)
    assert proj["gpus"]["1"]["caption_inter"] > proj["gpus"]["1"]["caption_base"] > 0


def test_tiny_cpu_run_path_check_runs_build_secmm_on_the_tiny_production_profile(report: dict) -> None:
    path = report["path"]
    assert path["status"] == "ok" and path["device"] == "cpu" and path["generator_backend"] == "transformers-vlm"
    assert list(path["flows"]) == ["build-secmm"]
    secmm = path["flows"]["build-secmm"]
    assert secmm["balanced"] and secmm["inputs"] == SLICE_IMAGES
    stages = {s["stage"]: s for s in secmm["stages"]}
    assert stages["denoise"]["accepted"] > 0 and stages["cgds"]["accepted"] > 0
    assert (Path(path["workdir"]) / "artifacts" / "build-secmm" / "tiny-production" / "gallery").is_dir()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the GPU run of the check is skipped")
def test_tiny_run_on_cuda(tmp_path: Path) -> None:
    """The same tiny check on the GPU (bf16, CUDA synchronisation and peak memory), without the
    path check: what a GPU machine runs before the full-size ``python scripts/gpu_check.py``."""
    out = tmp_path / "gpu-check.json"
    cmd = [sys.executable, str(SCRIPT), "--tiny", "--device", "cuda", "--json", str(out), "--no-path",
           "--new-tokens", str(NEW_TOKENS), "--batches", ",".join(map(str, BATCHES))]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["meta"]["device"] == "cuda" and report["meta"]["dtype"] == "bf16"
    assert report["meta"]["device_name"] == torch.cuda.get_device_name(0) and "path" not in report
    for entry in (report["dinov2"], report["clip"]["image"], report["clip"]["text"]):
        assert entry["status"] == "ok" and entry["peak_memory_gib"] is not None  # read on the device (None on a CPU)
    for key, entry in report["generator"]["batches"].items():
        assert entry["status"] == "ok" and entry["generated_lengths"] == [NEW_TOKENS] * int(key), entry
        assert entry["peak_memory_gib"] is not None
    assert report["projection"]["gpus"]["1"]["total"] > 0
