"""A process that runs only the pool stages (ingest, measure, denoise) never loads torch.

Every CLI run up to ``denoise``, every deployment run of it on a worker and every Dask worker of it
used to import torch (2-3 CPU s each) through the auto-batch module, though the detector (OpenCV)
and the blur measure need none. Checked in a fresh interpreter, as such a process starts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

_SCRIPT = """
import sys
import numpy as np
import flows.build_secmm, flows.build_largefine, tasks.pool.denoise, tasks.pool.ingest
from flows.run_shards import pipeline_stage

pipeline_stage("build-largefine", "qa-tiers")  # a fanned-out shard range of a pool or caption stage
pipeline_stage("build-secmm", "measure")
from models.backends.registry import ModelRegistry
from rde.common.denoise import laplacian_variance
from rde.profile import load_profile

detector = ModelRegistry.of(load_profile("demo")).detector()
image = np.zeros((128, 64, 3), np.uint8)
detector.detect([image])
laplacian_variance(image)
print("torch" in sys.modules)
"""


def test_the_pool_stages_do_not_load_torch() -> None:
    done = subprocess.run([sys.executable, "-c", _SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "False", "torch was imported by the flows or the pool stages"
