"""The deployment path for real: `rde stack up` on loopback (server, pools, `gpu` limit, workers,
deployments from prefect.yaml), `prefect deployment run 'build-secmm/demo'` through the cpu worker,
artifacts read back through the REST API, a Chromium screenshot of the run's artifacts page, and
`rde stack down`."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from rde.entry.stack import StackConfig, down, free_port, healthy, start_server, status, stop_server, up

pytestmark = pytest.mark.slow
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                  "--disable-dev-shm-usage", "--window-size=1440,1000", "--virtual-time-budget=20000"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    cfg = StackConfig(port=free_port(), folder=tmp_path_factory.mktemp("stack"))
    up(cfg)
    try:
        yield cfg
    finally:
        down(cfg)


@pytest.fixture(scope="module")
def pg_stack():
    """A stack on a PostgreSQL cluster of its own. Its folder is outside pytest's 0700 temporary
    root (the ``postgres`` OS user must reach the data folder when the tests run as root)."""
    from rde.entry.local_postgres import PostgresError, server_binaries

    try:
        server_binaries()
    except PostgresError as err:
        pytest.skip(str(err))
    folder = Path(tempfile.mkdtemp(prefix="rde-pg-stack-"))
    folder.chmod(0o755)
    cfg = StackConfig(port=free_port(), folder=folder, postgres=True)
    try:
        up(cfg)
        yield cfg
    finally:
        down(cfg, remove_postgres=True)
        shutil.rmtree(folder, ignore_errors=True)


def _api(cfg: StackConfig, path: str, body: dict) -> list[dict]:
    response = httpx.post(f"{cfg.api_url}{path}", json=body, timeout=30)
    response.raise_for_status()
    return response.json()


def test_stack_is_up_on_loopback_with_pools_limit_and_deployments(stack: StackConfig) -> None:
    assert healthy(stack) and stack.host == "127.0.0.1"
    assert all(status(stack)["processes"].values())
    pools = {p["name"]: p["type"] for p in _api(stack, "/work_pools/filter", {})}
    assert pools.get("cpu") == "process" and pools.get("gpu") == "process"
    limits = {g["name"]: g["limit"] for g in _api(stack, "/v2/concurrency_limits/filter", {})}
    assert limits.get("gpu") == 1
    names = {(d["name"], d["work_pool_name"]) for d in _api(stack, "/deployments/filter", {})}
    assert {("demo", "cpu"), ("demo", "gpu")} <= names


def _run_build_secmm(cfg: StackConfig, out: Path, small_pool_url: str) -> tuple[dict, list[dict], float]:
    """``prefect deployment run 'build-secmm/demo'`` through the cpu worker up to denoise; the flow
    run, its artifacts (read back over the API) and the seconds it took."""
    params = {"until": "denoise", "output_root": str(out),
              "overrides": {"input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16}}}
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "build-secmm/demo",
                          "--params", json.dumps(params), "--watch",
                          "--watch-timeout", "600"], env=cfg.env(), capture_output=True, text=True, timeout=660)
    elapsed = time.monotonic() - start
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [flow_run] = _api(cfg, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    assert flow_run["state_type"] == "COMPLETED"
    assert (out / "build-secmm" / "demo" / "accepted" / "_manifest.json").exists()
    artifacts = _api(cfg, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    keys = {a["key"] for a in artifacts if a.get("key")}
    assert {"build-secmm-ingest", "build-secmm-denoise", "build-secmm-summary"} <= keys
    summary = next(a for a in artifacts if a.get("key") == "build-secmm-summary")
    assert "balanced: **True**" in summary["data"]
    return flow_run, artifacts, elapsed


def test_deployment_run_through_the_worker_publishes_artifacts(stack: StackConfig, tmp_path: Path,
                                                                test_artifacts_dir: Path, small_pool_url: str) -> None:
    flow_run, artifacts, elapsed = _run_build_secmm(stack, tmp_path / "out", small_pool_url)
    keys = {a["key"] for a in artifacts if a.get("key")}
    summary = next(a for a in artifacts if a.get("key") == "build-secmm-summary")
    (test_artifacts_dir / "deployment-run.json").write_text(json.dumps(
        {"flow_run": flow_run["id"], "seconds_through_worker": round(elapsed, 1), "artifacts": sorted(keys)},
        indent=1))

    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no headless Chromium for the UI screenshot (make browser installs it)")
    base = f"http://{stack.host}:{stack.port}"
    pages = {"prefect-ui-run-summary-artifact.png": f"{base}/artifacts/artifact/{summary['id']}",
             "prefect-ui-artifacts.png": f"{base}/artifacts",
             "prefect-ui-flow-run.png": f"{base}/runs/flow-run/{flow_run['id']}"}
    for name, url in pages.items():
        shot = test_artifacts_dir / name
        shot.unlink(missing_ok=True)
        subprocess.run([chromium, *CHROMIUM_FLAGS, f"--screenshot={shot}", url], capture_output=True, timeout=120)
        assert shot.exists() and shot.stat().st_size > 20_000, f"the UI page {url} did not render"
    # the summary page shows the artifact itself (an error page or an empty shell would not): its
    # key, and a value of its table as a rendered cell
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, "--dump-dom", pages["prefect-ui-run-summary-artifact.png"]],
                         capture_output=True, text=True, timeout=120).stdout
    measure = _measure_row(summary["data"])  # stage, skipped, input, accepted, ...
    assert "build-secmm-summary" in dom, "the artifact page does not name the artifact"
    assert re.search(rf"<td[^>]*>\s*{measure[3]}\s*</td>", dom), "the summary table is not on the page"


def test_gpu_pool_deployment_runs_through_its_worker_under_the_gpu_limit(stack: StackConfig, tmp_path: Path,
                                                                          small_pool_url: str) -> None:
    """build-largefine/demo is deployed to the ``gpu`` pool: the gpu worker picks it up, its
    captioning shards run as ``gpu``-tagged tasks holding the ``gpu`` limit, and it completes with
    a balanced summary."""
    out = tmp_path / "out"
    params = {"until": "tiers", "output_root": str(out),
              "overrides": {"input": {"kind": "pool", "path": small_pool_url}, "ingest": {"shard_size": 16},
                            "largefine": {"max_images": 4, "shard_size": 2}}}
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "build-largefine/demo",
                          "--params", json.dumps(params), "--watch", "--watch-timeout", "600"],
                         env=stack.env(), capture_output=True, text=True, timeout=660)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [flow_run] = _api(stack, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    assert flow_run["state_type"] == "COMPLETED" and flow_run["work_pool_name"] == "gpu"
    tasks = _api(stack, "/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run["id"]]}}})
    tiers = [t for t in tasks if t["name"].startswith("qa-tiers-")]
    assert len(tiers) == 2 and all("gpu" in t["tags"] for t in tiers)
    assert all(t["state_type"] == "COMPLETED" for t in tiers)
    # (that the slot serialises the shards' computation is measured in tests/test_gpu_limit.py)
    artifacts = _api(stack, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    summary = next(a for a in artifacts if a.get("key") == "build-largefine-summary")
    assert "balanced: **True**" in summary["data"]


_PLOT_FLOW = """
import sys
from pathlib import Path

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
from prefect import flow

from tasks.reporting import inline_png, publish_markdown


@flow(name="plot-artifact-check")
def plot_artifact_check(png: str) -> None:
    fig, ax = plt.subplots(figsize=(4, 2.5))
    ax.plot([0, 1, 2, 3], [2.0, 1.2, 0.8, 0.7], label="itc")
    ax.legend()
    fig.savefig(png, dpi=100)
    publish_markdown("plot-artifact-check", "# train-gtr: training loss\\n\\n" + inline_png(Path(png), "loss curve"),
                     "the training flows' plot markdown")


plot_artifact_check(sys.argv[1])
"""


def test_training_plots_show_as_pictures_in_the_ui(stack: StackConfig, tmp_path: Path,
                                                   test_artifacts_dir: Path) -> None:
    """The loss / ŝ plots are inlined in the markdown artifact (the same ``inline_png`` the training
    flows use): the artifact page renders an <img> that loaded, not a link to a file the UI cannot open."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    if chromium is None:
        pytest.skip("no headless Chromium for the UI check (make browser installs it)")
    script = tmp_path / "plot_flow.py"
    script.write_text(_PLOT_FLOW)
    env = {**stack.env(), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    run = subprocess.run([sys.executable, str(script), str(tmp_path / "loss.png")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    [artifact] = _api(stack, "/artifacts/filter", {"artifacts": {"key": {"any_": ["plot-artifact-check"]}},
                                                   "sort": "CREATED_DESC", "limit": 1})
    assert "data:image/png;base64," in artifact["data"] and "file://" not in artifact["data"]
    url = f"http://{stack.host}:{stack.port}/artifacts/artifact/{artifact['id']}"
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    assert "train-gtr: training loss" in dom, "the artifact page did not render the markdown"
    assert re.search(r'<img[^>]*src="data:image/png;base64,', dom), "the plot is not an <img> on the page"
    shot = test_artifacts_dir / "prefect-ui-training-plot-artifact.png"
    shot.unlink(missing_ok=True)
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists()


def _measure_row(summary_markdown: str) -> list[str]:
    line = next(x for x in summary_markdown.splitlines() if x.startswith("| measure |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_server_stopped_mid_run_then_restarted_resumes(stack: StackConfig, tmp_path: Path,
                                                        test_artifacts_dir: Path) -> None:
    """The server goes away while the worker runs a flow. Measured: the flow-run process waits for its
    API (it does not exit within a minute) and, once the server is back on the same database, ends in
    a terminal state; a rerun then completes, skipping or reusing what was written. Nothing is lost."""
    out = tmp_path / "out"
    params = {"until": "denoise", "output_root": str(out), "overrides": {"ingest": {"shard_size": 32}}}
    cmd = [sys.executable, "-m", "prefect", "deployment", "run", "build-secmm/demo", "--params", json.dumps(params)]
    subprocess.run(cmd, env=stack.env(), check=True, capture_output=True, timeout=120)
    measurements = out / "build-secmm" / "demo" / "measurements"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and len(list(measurements.glob("part-*.parquet"))) < 2:
        time.sleep(0.5)
    [first] = _api(stack, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    stop_server(stack)
    written = len(list(measurements.glob("part-*.parquet")))
    assert written >= 2 and not (measurements / "_manifest.json").exists()
    stopped_at = time.monotonic()
    assert _engine_pids(first["id"]), "no flow-run process of the run was found"
    ended_without_server = _wait_engine_gone(60, first["id"])
    # an outage longer than Prefect's default client retries (5: about 62 s) — the CI machine's
    # slow server restart once made the run FAIL this way; the stack's api_retries must cover it
    time.sleep(max(0.0, 80 - (time.monotonic() - stopped_at)))
    start_server(stack)
    # the client sleeps its current back-off step (up to 128 s) before it finds the server again
    ended_after_restart = ended_without_server or _wait_engine_gone(420, first["id"])
    state = None
    for _ in range(60):  # the old run's final state as the server records it
        state = httpx.get(f"{stack.api_url}/flow_runs/{first['id']}", timeout=30).json()["state_type"]
        if state != "RUNNING":
            break
        time.sleep(1)
    again = subprocess.run([*cmd, "--watch", "--watch-timeout", "600"], env=stack.env(), capture_output=True,
                           text=True, timeout=660)
    assert again.returncode == 0, (again.stdout + again.stderr)[-2000:]
    [second] = _api(stack, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 1})
    summary = next(a for a in _api(stack, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [second["id"]]}}})
                   if a.get("key") == "build-secmm-summary")
    row = _measure_row(summary["data"])  # stage, skipped, input, accepted, rejected, shards, reused, seconds
    (test_artifacts_dir / "server-outage.json").write_text(json.dumps(
        {"shards_written_before_outage": written, "run_process_ended_within_60s_without_server": ended_without_server,
         "run_process_ended_after_restart": ended_after_restart, "first_run_state_after_restart": state,
         "measure_after_restart": row}, indent=1))
    # what the README promises: the flow-run process waits for its API while the server is down,
    # and the interrupted run finishes once the server is back; the rerun then skips the stage
    assert not ended_without_server, "the flow-run process gave up while the server was down"
    assert ended_after_restart, "the flow-run process still runs after the server came back"
    assert state == "COMPLETED", f"the interrupted run is left in state {state}"
    assert row[1] == "True"
    assert "balanced: **True**" in summary["data"]


def _wait_engine_gone(seconds: float, flow_run_id: str) -> bool:
    """True once the flow-run process of ``flow_run_id`` (``python -m prefect.engine``, started by
    the worker with ``PREFECT__FLOW_RUN_ID`` in its environment) is gone. Other runs' processes (a
    second stack's, under pytest-xdist) do not count."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _engine_pids(flow_run_id):
            return True
        time.sleep(1)
    return False


def _engine_pids(flow_run_id: str) -> list[int]:
    marker = f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if b"prefect.engine" in (proc / "cmdline").read_bytes() and marker in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return pids


def _postgres_rows(cfg: StackConfig, sql: str, *args: object) -> list:
    import asyncio

    import asyncpg

    pg = cfg.local_postgres()

    async def query() -> list:
        conn = await asyncpg.connect(host=pg.host, port=pg.port, user=pg.role, password=pg.password,
                                     database=pg.database, timeout=30)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(query())


def test_postgres_stack_runs_the_build_secmm_deployment(pg_stack: StackConfig, tmp_path: Path,
                                                        small_pool_url: str, test_artifacts_dir: Path) -> None:
    """``rde stack up --postgres``: the server's rows are in the stack's own PostgreSQL (loopback
    only), the deployment runs through the worker, and the password is in no log or state file."""
    pg = pg_stack.local_postgres()
    assert pg.running() and pg_stack.database_url == pg.url
    assert status(pg_stack)["processes"]["postgres"] and status(pg_stack)["database"] == "postgres (stack)"
    flow_run, artifacts, elapsed = _run_build_secmm(pg_stack, tmp_path / "out", small_pool_url)
    [row] = _postgres_rows(pg_stack, "SELECT state_type FROM flow_run WHERE id = $1::uuid", flow_run["id"])
    assert row["state_type"] == "COMPLETED"
    assert _postgres_rows(pg_stack, "SELECT count(*) AS n FROM artifact WHERE flow_run_id = $1::uuid",
                          flow_run["id"])[0]["n"] == len(artifacts)
    listen = _postgres_rows(pg_stack, "SELECT setting FROM pg_settings WHERE name = 'listen_addresses'")
    assert listen[0]["setting"] == "127.0.0.1"
    secret = pg.password
    for path in [*pg_stack.folder.glob("*.log"), pg_stack.folder / "stack.json", pg.folder / "server.log"]:
        assert secret not in path.read_text(errors="replace"), f"the database password is in {path}"
    assert oct(pg.password_file.stat().st_mode & 0o777) == "0o600"
    (test_artifacts_dir / "deployment-run-postgres.json").write_text(json.dumps(
        {"flow_run": flow_run["id"], "seconds_through_worker": round(elapsed, 1),
         "artifacts": sorted(a["key"] for a in artifacts if a.get("key"))}, indent=1))


def _probe_load(cfg: StackConfig, test_artifacts_dir: Path) -> dict:
    """The bounded version of benchmarks/orchestration_load.py: 6 concurrent runs of the probe
    deployment, 20 shard tasks each; every run and task completes. Its row is kept per database."""
    from rde.entry.orchestration_load import submit_and_wait

    result = submit_and_wait(cfg, concurrent=6, shards=20, work_ms=10, timeout_s=600, label="ci-")
    row = result.row()
    assert result.completed == 6 and result.failed == 0, row
    assert result.task_runs_completed == 6 * 20, row
    assert result.server_peak_rss_mb > 0 and result.start_p95_s >= result.start_p50_s > 0
    (test_artifacts_dir / f"orchestration-load-{row['database']}.json").write_text(json.dumps(row, indent=1))
    return row


def test_concurrent_probe_runs_complete_on_sqlite(stack: StackConfig, test_artifacts_dir: Path) -> None:
    """SQLite may log "database is locked" at this load (the server retries; seen here at 6 runs
    while the rest of the suite ran): recorded, not asserted."""
    assert _probe_load(stack, test_artifacts_dir)["database"] == "sqlite"


def test_concurrent_probe_runs_complete_on_postgres(pg_stack: StackConfig, test_artifacts_dir: Path) -> None:
    """PostgreSQL must have no lock and no retry at the same load."""
    row = _probe_load(pg_stack, test_artifacts_dir)
    assert row["database"] == "postgres"
    assert row["db_errors"] == {"database is locked": 0, "timeout": 0} and row["submit_retries"] == 0


def test_stack_down_stops_workers_then_server(stack: StackConfig) -> None:
    down(stack)  # the fixture's own down afterwards is a no-op
    assert not healthy(stack) and not list(stack.folder.glob("*.pid"))


def test_postgres_stack_down_stops_and_removes_its_cluster(pg_stack: StackConfig) -> None:
    pg = pg_stack.local_postgres()
    down(pg_stack)
    assert not healthy(pg_stack) and not pg.running() and (pg.data_dir / "PG_VERSION").exists()
    down(pg_stack, remove_postgres=True)
    assert not pg.folder.exists()
