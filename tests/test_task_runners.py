"""The Dask task runner option (RDE_TASK_RUNNER=dask, prefect-dask): the same flow, its shard tasks
executed by a local cluster of worker processes, with the same accounting."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rde.common.task_runners import default_task_runner

ROOT = Path(__file__).resolve().parent.parent


def test_runner_is_chosen_by_environment(monkeypatch) -> None:
    from prefect.task_runners import ThreadPoolTaskRunner
    from prefect_dask import DaskTaskRunner

    monkeypatch.delenv("RDE_TASK_RUNNER", raising=False)
    assert isinstance(default_task_runner(), ThreadPoolTaskRunner)
    monkeypatch.setenv("RDE_TASK_RUNNER", "dask")
    assert isinstance(default_task_runner(), DaskTaskRunner)
    monkeypatch.setenv("RDE_TASK_RUNNER", "spark")
    with pytest.raises(RuntimeError, match="one of"):
        default_task_runner()


@pytest.mark.slow
def test_build_secmm_on_a_local_dask_cluster(tmp_path: Path, tiny_pool_url: str,
                                             shared_server_env: dict[str, str]) -> None:
    env = {**shared_server_env, "RDE_TASK_RUNNER": "dask", "RDE_TASK_WORKERS": "2",
           "RDE_STATE_DIR": str(tmp_path / "s")}
    rde = ROOT / ".venv" / "bin" / "rde"
    done = subprocess.run([str(rde) if rde.exists() else "rde", "build-secmm", "--until", "denoise", "--input",
                           tiny_pool_url, "--set", "ingest.shard_size=4", "--output", str(tmp_path / "out"),
                           "--json"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    summary = json.loads(done.stdout[done.stdout.index("{"):])
    assert summary["balanced"] and summary["inputs"] == 24
    assert {s["stage"]: s["shards"] for s in summary["stages"]}["measure"] == 6
    assert "distributed.scheduler" in done.stdout + done.stderr  # the shards went through a Dask cluster
