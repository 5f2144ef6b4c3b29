"""Test settings: an isolated state folder (Prefect home, YOLO config) per test session.

The environment is set before anything imports Prefect, so the ephemeral server and its
database live in a temporary folder, never in the developer's ``.rde``.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

_STATE = Path(tempfile.mkdtemp(prefix="rde-test-state-"))
# removed when this process ends (the controller's last: the xdist workers read its caches), unless
# RDE_KEEP_TEST_STATE is set to look at a failed run's Prefect database; left behind, each session's
# folder (~7 MB) piled up in /tmp
if not os.environ.get("RDE_KEEP_TEST_STATE"):
    atexit.register(shutil.rmtree, _STATE, ignore_errors=True)
os.environ["RDE_STATE_DIR"] = str(_STATE)
# one batch-size measurement per backend for the whole session, shared with the CLI subprocesses
# the end-to-end tests start (each of those has a state folder of its own) and, through setdefault,
# with the other pytest-xdist workers (each inherits the controller's value instead of measuring again)
os.environ.setdefault("RDE_AUTO_BATCH_CACHE", str(_STATE / "auto_batch.json"))
# the semantic bridge's class-prompt vectors, encoded once for the whole session: setdefault, so the
# xdist workers (and every process they start) inherit the controller's folder instead of each paying
# the 10-17 CPU s of encoding them (models.backends.text_vectors)
os.environ.setdefault("RDE_TEXT_VECTOR_CACHE", str(_STATE / "text_vectors"))
# the detector's answers per image, kept for the whole session: the suite's runs measure slices of the
# demo pool again and again (each CLI run, stack worker and flow in a process of its own), and SSD
# costs ~80 CPU ms an image on these cores; each distinct image is still detected once per session
# (models/backends/disk_memo.py)
os.environ.setdefault("RDE_DETECTION_CACHE", str(_STATE / "detections"))
for _key in ("PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH", "PREFECT_API_URL", "YOLO_CONFIG_DIR"):
    os.environ.pop(_key, None)
# Threads of torch's OpenMP pool sleep while they wait instead of spinning (libgomp spins by
# default). The suite's workers and the processes they start share two cores; spinning threads burn
# the CPU another worker needs (measured: 3 concurrent EfficientNet loops use 25 % less CPU time and
# wall time under PASSIVE), and the results are bit-identical (the thread count is unchanged).
# Inherited by every subprocess the tests start (CLI runs, stack servers, workers, flow runs).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# Two threads per process for torch, OpenBLAS and MKL, whatever the machine's core count (the
# count a 2-core machine gets by default): a float sum split over more threads may round otherwise,
# so a many-core machine would run the models on other last bits than the 2-core machines the suite
# is developed on. Tests do not depend on those bits (a CPU with other kernels rounds otherwise
# too), but fewer differences are fewer near-ties that could flip.
for _key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_key, "2")

from rde.common.runtime import configure_prefect_env  # noqa: E402

configure_prefect_env()

import pytest  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TEST_ARTIFACTS = ROOT / "test-artifacts"  # screenshots and reports kept by tests (git-ignored)


# Modules in the order their measured cost says to start them (seconds in one process,
# 2026-12-01), so under ``make test`` (pytest-xdist ``--dist loadfile --no-loadscope-reorder``: a
# module runs whole on one worker, in its written order, with its module fixtures) the long ones
# do not end up last. CPU seconds of each module under ``make test`` (three workers, 2026-12-01):
# the demo build 398 (the longest chain), the SQLite stack 318, the PostgreSQL stack 157, the VEDJE
# and largefine flows 113 and 104, the CLI 87, Dask 44, then the rest; they keep collection order.
LONG_FIRST = ("test_flow_build_secmm", "test_deployment_stack", "test_pool_fanout", "test_deployment_stack_postgres",
              "test_task_runners",
              "test_cli", "test_faults", "test_tiny_production", "test_flow_vedje", "test_flow_build_largefine",
              "test_flow_training",
              "test_auto_batch", "test_lost_rows")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: each module's order kept


@pytest.fixture(scope="session")
def demo_pool_url() -> str:
    return str(ROOT / "data" / "demo_pool")


@pytest.fixture(scope="session")
def test_artifacts_dir() -> Path:
    TEST_ARTIFACTS.mkdir(exist_ok=True)
    return TEST_ARTIFACTS


@pytest.fixture(scope="session", autouse=True)
def prefect_server(request: pytest.FixtureRequest):
    """One temporary Prefect server (SQLite) for the whole session, started only if a test needs
    Prefect, and stopped inside the session so its shutdown logs reach an open stream."""
    needs = any(item.get_closest_marker("slow") for item in request.session.items)
    if not needs:
        yield None
        return
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield True


@pytest.fixture(scope="session")
def shared_server_env(prefect_server) -> dict[str, str]:
    """The environment for a CLI subprocess that runs its flow against this session's Prefect server.
    Without ``PREFECT_API_URL`` each such process starts an ephemeral server of its own: 12-20 CPU
    seconds (migrations on a new state folder), measured, for each of the suite's CLI runs. The
    tty progress test keeps that default path (``make demo``'s)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert prefect_server and url, "the session's Prefect server is not up"
    return {**os.environ, "PREFECT_API_URL": str(url)}


# The demo's recordings (`make videos` fetches them); a test that reads them is skipped where they
# are missing, except in CI (CI=true), where `make test` fetched them and their absence is a failure.
DEMO_VIDEOS = ROOT / ".rde" / "demo-videos"
needs_demo_videos = pytest.mark.skipif(
    not ((DEMO_VIDEOS / "vtest.avi").exists() and (DEMO_VIDEOS / "street.mp4").exists()) and not os.environ.get("CI"),
    reason="the demo videos are missing: run `make videos`")



def require_module(name: str) -> ModuleType:
    """``pytest.importorskip`` for a package the project pins (pyproject.toml): where it is missing
    the test is skipped with a message, except under CI (``CI`` set), where a pinned package that
    does not import is a broken install and fails the test (as a missing browser does: browser.py)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI must install {name}, a pinned dependency (make setup): {exc}")
        pytest.skip(f"{name} does not import ({exc}); the project pins it: make setup installs it")


# Two sharp single-person crops of the demo pool (checked: SSD finds exactly one person in each,
# score > 0.95, and two when they stand side by side on a canvas).
PERSON_A = "vtest.avi#pedestrian-s000-0027:f0000147"
PERSON_B = "vtest.avi#pedestrian-s000-0004:f0000016"


@pytest.fixture(scope="session")
def pool_rows(demo_pool_url: str) -> dict[str, dict]:
    from storage import Artifact

    return {r["pool_id"]: r for r in Artifact(demo_pool_url).read_shard(0).to_pylist()}


@pytest.fixture(scope="session")
def person_crop(pool_rows: dict[str, dict]):
    from rde.common.image_decoding import decode_rgb

    return decode_rgb(pool_rows[PERSON_A]["image_bytes"])


def _pool_slice(tmp_path_factory: pytest.TempPathFactory, demo_pool_url: str, name: str, step: int, count: int,
                shard_rows: int) -> str:
    """Every ``step``-th row of the demo pool, ``count`` rows, written as a pool artifact of
    ``shard_rows``-row shards (crops and filter exercises alike)."""
    from entry.demo_pool import write_pool_slice

    return write_pool_slice(demo_pool_url, str(tmp_path_factory.mktemp(name) / "pool"), step, count, shard_rows, name)


@pytest.fixture(scope="session")
def small_pool_url(tmp_path_factory: pytest.TempPathFactory, demo_pool_url: str) -> str:
    """A 96-image slice of the demo pool (every 5th row: crops and filter exercises), written as a
    pool artifact of six 16-row shards, for end-to-end tests that need a real run but not all 548."""
    return _pool_slice(tmp_path_factory, demo_pool_url, "small-pool", 5, 96, 16)


@pytest.fixture(scope="session")
def tiny_pool_url(tmp_path_factory: pytest.TempPathFactory, demo_pool_url: str) -> str:
    """The small pool's first 24 images (two 12-row shards): for runs whose subject is the path
    (a deployment through a worker), not the pool; a quarter of the small pool's measuring."""
    return _pool_slice(tmp_path_factory, demo_pool_url, "tiny-pool", 5, 24, 12)


@pytest.fixture
def one_thread():
    """One torch thread for a test whose numbers were measured so; the worker's setting restored after."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
