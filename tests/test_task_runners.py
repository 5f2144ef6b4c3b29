"""The Dask task runner option (RDE_TASK_RUNNER=dask, prefect-dask): the same flow, its shard tasks
executed by a local cluster of worker processes, with the same accounting."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tasks.framework.task_runners import default_task_runner

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


def test_a_worker_reaped_late_when_the_cluster_closes_is_a_warning_other_errors_propagate(caplog) -> None:
    """distributed raises TimeoutError when a killed worker process is not joined within its fixed
    5 s close timeout (seen on a loaded machine after a complete run); the run's exit warns instead.
    The exit stack stands in for the cluster: the error is what distributed's close raises."""
    from tasks.framework.dask_runner import ReapingDaskTaskRunner

    def closing_with(error: BaseException) -> ReapingDaskTaskRunner:
        runner = ReapingDaskTaskRunner(cluster_kwargs={"n_workers": 1})
        runner._started = True

        def close() -> None:
            raise error

        runner._exit_stack.callback(close)
        return runner

    runner = closing_with(TimeoutError())
    with caplog.at_level("WARNING", logger="tasks.framework.dask_runner"):
        runner.__exit__(None, None, None)
    assert not runner._started
    assert "not reaped within distributed's 5 s close timeout" in caplog.text
    with pytest.raises(OSError, match="scheduler gone"):
        closing_with(OSError("scheduler gone")).__exit__(None, None, None)
    assert type(runner.duplicate()) is ReapingDaskTaskRunner  # what Prefect runs each flow with
