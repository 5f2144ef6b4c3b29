"""The memory CGDS holds at its peak, measured in an interpreter of its own.

``tests/test_streaming_memory.py`` starts ``python tests/held_memory.py <warm base> <base>
<profile overrides as JSON>`` and, once the pool under ``<base>`` is written, sends a line on its
stdin. This process runs CGDS of build-secmm once over the tiny pool under ``<warm base>``
(unmeasured: the stage's lazy imports, scikit-learn's and SciPy's ~80 MB, and one-time
allocations), waits for that line, then runs it over ``<base>``'s ``distinct`` pool, consuming its
output one shard at a time as the runner does, and prints one JSON line: the peak bytes held on
Python's heap (tracemalloc: ``bytes`` objects, rows, decoded pixels, vectors) and in Arrow's
default memory pool (tables, arrays, the Parquet reader's buffers, which tracemalloc does not
see), from the stage's start to its last output shard, and what the stage did.

Why an interpreter of its own:

* Arrow's ``max_memory`` is process-wide and only grows (pyarrow has no reset), so in the test
  process it holds the peak of whatever ran before; here only the warm-up ran through the pool
  (``arrow_before``, next to nothing). Not a proxy set with ``pyarrow.set_memory_pool`` instead:
  the Parquet reader's C++ side takes its buffers from Arrow's C++ default pool itself (reading
  one 0.49 MB shard: 1.48 MB through a proxy, 1.96 MB in the pool).
* tracemalloc on Python 3.11 races with threads that take the GIL from outside Python
  (CPython gh-128679, fixed in 3.12.9 and 3.13.2): Arrow's I/O threads do, to read the fsspec
  file objects ``Artifact.read_shard`` hands to Parquet, and ``tracemalloc.stop()`` then crashed
  5 of 22 runs of this process (SIGSEGV in such a thread), as it once crashed suite runs. So it
  is started once and never stopped: the process ends with ``os._exit`` (0 crashes in 45 runs),
  and a crash would be this process's, with its stack (faulthandler) in the test's failure.
* Not a fork of the test process: scikit-learn's OpenMP threads do not survive one (k-means hangs
  in the child when the parent ran k-means before).

``tasks.secmm`` is imported as a bare package (its ``__init__`` imports every secmm stage, and
through the reports Prefect: 1.6 of this process's ~3 CPU s); ``tasks.secmm.cgds`` is the stage's
own module, unchanged.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import tracemalloc
import types

import cv2
import numpy as np
import pyarrow as pa


class MeanEmbedder:
    """A 3-d embedding (the channel means): real decoding, no model, deterministic."""

    model_id, preprocessing, dim = "channel-means", "none", 3

    def __init__(self) -> None:
        self.calls = 0
        self.largest_call = 0  # the most images decoded and handed over in one call

    def embed(self, images: list[np.ndarray]) -> np.ndarray:
        self.calls += len(images)
        self.largest_call = max(self.largest_call, len(images))
        # cv2.mean: the channel means in float64 as numpy's mean gives them, 20 times faster (0.03 ms an image)
        means = np.array([cv2.mean(im)[:3] for im in images], np.float64).reshape(len(images), 3)
        return (means / 255.0).astype(np.float32)


def cgds(base: str, overrides: dict, embedder: MeanEmbedder) -> int:
    """CGDS over ``base``'s pool with ``embedder``, its output consumed as the runner does (one
    output shard alive at a time); the gallery's size."""
    import tasks

    if "tasks.secmm" not in sys.modules:
        package = types.ModuleType("tasks.secmm")
        package.__path__ = [os.path.join(tasks.__path__[0], "secmm")]
        sys.modules["tasks.secmm"] = package
    from models.backends.registry import ModelRegistry
    from rde.profile import load_profile
    from tasks.framework.context import RunContext
    from tasks.framework.stage import StageRun
    from tasks.secmm.cgds import Cgds

    ModelRegistry.image_embedder = lambda self: embedder  # type: ignore[method-assign]
    stage = Cgds()
    run = StageRun(stage, RunContext(load_profile("demo", overrides), "build-secmm", base))
    stage.lineage(run)  # as the runner does before ``run``
    return sum(t["gallery"].num_rows for t in stage.run(run).shards)


def main(warm: str, base: str, overrides: dict) -> dict[str, int | str]:
    cgds(warm, overrides, MeanEmbedder())
    sys.stdin.readline()  # the measured pool is written
    arrow = pa.default_memory_pool()
    arrow_held, arrow_before = arrow.bytes_allocated(), arrow.max_memory()
    embedder = MeanEmbedder()
    tracemalloc.start()  # never stopped: this process ends with os._exit (see the module)
    gallery = cgds(base, overrides, embedder)
    python_peak = tracemalloc.get_traced_memory()[1]
    return {"python_peak": python_peak, "arrow_peak": arrow.max_memory() - arrow_held,
            "arrow_before": arrow_before, "arrow_backend": arrow.backend_name, "gallery": gallery,
            "embedded": embedder.calls, "largest_call": embedder.largest_call}


if __name__ == "__main__":
    faulthandler.enable()  # a crash shows its stack in the test's failure
    print(json.dumps(main(sys.argv[1], sys.argv[2], json.loads(sys.argv[3]))), flush=True)
    os._exit(0)  # no teardown: tracemalloc is still tracing (see the module), and nothing is left to do
