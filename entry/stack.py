"""A local Prefect stack for the deployment path: server, work pools, workers, deployments.

``up`` starts ``prefect server`` on 127.0.0.1 (SQLite in the stack folder; with ``postgres`` a
throwaway PostgreSQL cluster of its own in the stack folder, see ``entry.local_postgres``; or any
database URL given), creates the ``cpu`` and ``gpu`` process work pools and the ``gpu``
global concurrency limit (one slot per gpu worker), the zombie-detection and resume-on-crash
automations (``tasks.framework.prefect_automations``; window ``stale_after_s``), deploys everything in
``prefect.yaml`` and starts ``workers_per_pool`` workers for the ``cpu`` pool and ``gpu_workers``
for the ``gpu`` pool (``--gpu-workers``).
``down`` stops the workers first (SIGINT twice, as Prefect workers expect), then the server, then
the stack's own PostgreSQL cluster (kept on disk unless ``remove_postgres``).
Process ids and logs live in the stack folder (``.rde/stack`` by default), so ``down`` works
from another shell.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from entry.local_postgres import LocalPostgres, PostgresError
from storage.locations import project_root, state_dir

POOLS = ("cpu", "gpu")


class StackError(RuntimeError):
    """The stack could not be brought up or down; the message says what and where to look."""


@dataclass
class StackConfig:
    host: str = "127.0.0.1"
    port: int = 4200
    folder: Path = field(default_factory=lambda: state_dir() / "stack")
    database_url: str | None = None  # e.g. postgresql+asyncpg://user:pass@host/db; None = SQLite
    postgres: bool = False  # a PostgreSQL cluster of the stack's own in <folder>/postgres (database_url unset)
    postgres_port: int = 0  # its loopback port; 0 = a free one, chosen at ``up``
    gpu_slots: int | None = None  # the `gpu` concurrency limit; None: one slot per gpu worker
    pools: Sequence[str] = POOLS
    workers_per_pool: int = 1
    gpu_workers: int = 1  # workers of the `gpu` pool (one per GPU on a real machine)
    # flow runs one gpu worker runs at once (`prefect worker --limit`): one, as one GPU holds one
    # run's models; a parent that fans out runs on the cpu pool (build-largefine/pool), else it would
    # hold the slot its shard-range runs wait for. None: no limit
    gpu_worker_limit: int | None = 1
    # seconds between a flow run's heartbeat events (Prefect's minimum is 30): the server's zombie
    # automation marks a run whose heartbeats stop for stale_after_s Crashed
    heartbeat_s: int = 30
    # the zombie automation's window: a flow run silent this long is marked Crashed by the server
    # (the profile's prefect.fanout.stale_after_s; `rde stack up --profile`)
    stale_after_s: float = 90.0
    worker_poll_seconds: float = 2.0
    startup_timeout_s: float = 90.0
    # Prefect's client retries a lost API with a doubling back-off (2, 4, 8, … s), each wait
    # jittered by up to 20 % (as short as 0.82 of it). Prefect's default of 5 retries gives up after
    # 62 s or less, shorter than a server restart on a busy machine; 7 (254 s on average) can give up
    # after 209 s; 8 lets a flow-run process wait at least 7 minutes for its server (2 + 4 + … + 256 s
    # = 510 s, 420 s at the shortest jitter; tests/test_deployment_stack.py measures it).
    api_retries: int = 8

    def local_postgres(self) -> LocalPostgres:
        return LocalPostgres(self.folder / "postgres", self.postgres_port)

    @property
    def api_url(self) -> str:
        return f"http://{self.host}:{self.port}/api"

    def env(self) -> dict[str, str]:
        """Environment of every process of the stack (CLI calls, server, workers, flow runs)."""
        env = dict(os.environ)
        env.update({
            "PREFECT_HOME": str(self.folder / "prefect"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_API_URL": self.api_url,
            "PREFECT_WORKER_QUERY_SECONDS": str(self.worker_poll_seconds),
            "PREFECT_WORKER_PREFETCH_SECONDS": "5",
            "RDE_PROJECT_ROOT": str(project_root()),
        })
        env.setdefault("PREFECT_CLIENT_MAX_RETRIES", str(self.api_retries))  # a user's own value wins
        env.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(self.heartbeat_s))
        if self.database_url:
            env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = self.database_url
        return env


def _prefect() -> list[str]:
    return [sys.executable, "-m", "prefect"]


def _pid_file(cfg: StackConfig, name: str) -> Path:
    return cfg.folder / f"{name}.pid"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _start(cfg: StackConfig, name: str, args: list[str]) -> int:
    log = open(cfg.folder / f"{name}.log", "ab")  # noqa: SIM115 - handed to the child process
    proc = subprocess.Popen(args, env=cfg.env(), stdout=log, stderr=subprocess.STDOUT, cwd=project_root(),
                            start_new_session=True)
    _pid_file(cfg, name).write_text(str(proc.pid))
    return proc.pid


def _cli(cfg: StackConfig, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([*_prefect(), *args], env=cfg.env(), cwd=project_root(), capture_output=True, text=True,
                          timeout=300)
    if check and done.returncode != 0:
        raise StackError(f"`prefect {' '.join(args)}` failed ({done.returncode}): "
                         f"{(done.stderr or done.stdout).strip()[-800:]}")
    return done


@functools.cache
def http_client() -> httpx.Client:
    """One HTTP client per process for the stack's REST calls: a new client builds a TLS context
    (~25 CPU ms, even for a loopback ``http://`` server), and health checks and state polls call
    many times a minute; one client also keeps its connections open between calls."""
    return httpx.Client()


def healthy(cfg: StackConfig) -> bool:
    try:
        return http_client().get(f"{cfg.api_url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False


def up(cfg: StackConfig | None = None) -> StackConfig:
    """Start server, pools, concurrency limit, deployments and workers (idempotent for pools)."""
    cfg = cfg or StackConfig()
    cfg.folder.mkdir(parents=True, exist_ok=True)
    if healthy(cfg):
        raise StackError(f"a Prefect server already answers on {cfg.api_url}; `rde stack down` first, "
                         "or choose another --port")
    if cfg.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"warning: binding the Prefect server to {cfg.host}: anyone who can reach it can run flows; "
              "enable basic auth (PREFECT_SERVER_API_AUTH_STRING) first", file=sys.stderr)
    if cfg.postgres:
        if cfg.database_url:
            raise StackError("give either a database URL or postgres, not both")
        cfg.postgres_port = cfg.postgres_port or free_port(cfg.host)
        try:
            pg = cfg.local_postgres()  # as root, refuses when the package's `postgres` user is missing
            pg.start()
        except PostgresError as err:
            raise StackError(f"PostgreSQL for the stack: {err}") from err
        cfg.database_url = pg.url
    _write_state(cfg)  # before anything else starts: ``down`` from another shell finds every part
    try:
        start_server(cfg)
    except StackError:
        _stop_postgres(cfg)
        raise
    _create_pools_and_limit(cfg)
    ensure_automations(cfg)
    _cli(cfg, "deploy", "--all")
    for pool in cfg.pools:
        for i in range(cfg.gpu_workers if pool == "gpu" else cfg.workers_per_pool):
            name = f"worker-{pool}-{i}"
            limit = ["--limit", str(cfg.gpu_worker_limit)] if pool == "gpu" and cfg.gpu_worker_limit else []
            _start(cfg, name, [*_prefect(), "worker", "start", "--pool", pool, "--name", name, *limit])
    return cfg


def _create_pools_and_limit(cfg: StackConfig) -> None:
    """The process work pools and the ``gpu`` global concurrency limit, through the server's REST API
    (what ``prefect work-pool create --type process`` and ``prefect gcl create`` send; existing ones
    are kept). In-process instead of four ``prefect`` CLI processes: each of those imported Prefect
    for 2-4 CPU seconds, a quarter of ``up``'s own CPU time."""
    from prefect.workers.process import ProcessWorker

    existing = {p["name"] for p in _post(cfg, "/work_pools/filter", {})}
    for pool in cfg.pools:
        if pool not in existing:
            _post(cfg, "/work_pools/", {"name": pool, "type": "process",
                                        "base_job_template": ProcessWorker.get_default_base_job_template()})
    if "gpu" not in {g["name"] for g in _post(cfg, "/v2/concurrency_limits/filter", {})}:
        _post(cfg, "/v2/concurrency_limits/", {"name": "gpu", "limit": cfg.gpu_slots or cfg.gpu_workers})


def ensure_automations(cfg: StackConfig, api_url: str | None = None) -> dict[str, str]:
    """Zombie detection (window ``cfg.stale_after_s``) and resume-on-crash on the stack's server (or
    the server at ``api_url``, e.g. one ``rde stack`` did not start), created or brought up to
    date; what was done per automation."""
    from tasks.framework.prefect_automations import ensure

    if cfg.stale_after_s <= cfg.heartbeat_s:
        raise StackError(f"the zombie window ({cfg.stale_after_s:g} s) must be longer than the heartbeat interval "
                         f"({cfg.heartbeat_s} s), else every running flow run is marked Crashed")
    url = (api_url or cfg.api_url).rstrip("/")
    return ensure(lambda method, path, body: _call(url, method, path, body), cfg.stale_after_s)


def api_request(cfg: StackConfig, method: str, path: str, body: dict[str, Any] | None = None,
                timeout: float = 60.0) -> Any:
    """One call of the stack server's REST API (``path`` under ``/api``): its JSON answer; an HTTP
    error status or a lost connection raises ``httpx``'s error, for the caller to retry or report."""
    return _request(cfg.api_url, method, path, body, timeout)


def _request(api_url: str, method: str, path: str, body: dict[str, Any] | None, timeout: float) -> Any:
    """One call of the REST API at ``api_url``: its JSON answer, None for an empty one (a 204)."""
    response = http_client().request(method, f"{api_url}{path}", json=body, timeout=timeout)
    response.raise_for_status()
    return response.json() if response.content else None


def _post(cfg: StackConfig, path: str, body: dict[str, Any]) -> Any:
    """``api_request`` for ``up``: a failure is a ``StackError`` naming the call."""
    return _call(cfg.api_url, "POST", path, body)


def _call(api_url: str, method: str, path: str, body: dict[str, Any] | None) -> Any:
    """``_request`` for ``up`` and the automations: a failure is a ``StackError`` naming the call."""
    try:
        return _request(api_url, method, path, body, timeout=30)
    except httpx.HTTPError as err:
        raise StackError(f"{method} {path} to the server at {api_url} failed: {err}") from err


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _write_state(cfg: StackConfig) -> None:
    """``stack.json``: what ``down``/``status`` need from another shell (never the database password)."""
    database = "postgres (stack)" if cfg.postgres else ("url" if cfg.database_url else "sqlite")
    state = {"api_url": cfg.api_url, "pools": list(cfg.pools), "workers_per_pool": cfg.workers_per_pool,
             "database": database}
    if cfg.postgres:
        state["postgres"] = {"folder": str(cfg.local_postgres().folder), "port": cfg.postgres_port}
    (cfg.folder / "stack.json").write_text(json.dumps(state))


def recorded_state(cfg: StackConfig) -> dict[str, Any]:
    """``stack.json`` as ``up`` wrote it (empty when absent or unreadable)."""
    path = cfg.folder / "stack.json"
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):  # unreadable, as the docstring says: not a traceback
        return {}


def _recorded_postgres(cfg: StackConfig) -> LocalPostgres | None:
    """The stack's own cluster as ``stack.json`` records it (another shell's ``up``), else this
    config's when it asks for one, else None."""
    recorded = recorded_state(cfg).get("postgres")
    if recorded:
        return LocalPostgres(Path(recorded["folder"]), int(recorded["port"]))
    return cfg.local_postgres() if cfg.postgres else None


def _stop_postgres(cfg: StackConfig, remove: bool = False) -> None:
    """Stop (and with ``remove`` delete) the stack's own cluster."""
    pg = _recorded_postgres(cfg)
    if pg is None:
        return
    if remove:
        pg.remove()
    else:
        pg.stop()


def start_server(cfg: StackConfig) -> None:
    """Start (or restart, on the same database) the server and wait until it is healthy."""
    cfg.folder.mkdir(parents=True, exist_ok=True)
    _start(cfg, "server", [*_prefect(), "server", "start", "--host", cfg.host, "--port", str(cfg.port)])
    deadline = time.monotonic() + cfg.startup_timeout_s
    while not healthy(cfg):
        pid = int(_pid_file(cfg, "server").read_text())
        if not _alive(pid) or time.monotonic() > deadline:
            tail = (cfg.folder / "server.log").read_text(errors="replace")[-1500:]
            down(cfg)
            raise StackError(f"the Prefect server did not become healthy on {cfg.api_url}; "
                             f"log {cfg.folder / 'server.log'}:\n{tail}")
        time.sleep(0.5)


def stop_server(cfg: StackConfig) -> None:
    """Stop only the server (workers keep running and reconnect when it is back)."""
    _stop(cfg, "server", [signal.SIGTERM, signal.SIGINT], 15.0)


def _stop(cfg: StackConfig, name: str, signals: Sequence[signal.Signals], wait_s: float) -> None:
    path = _pid_file(cfg, name)
    if not path.exists():
        return
    pid = int(path.read_text())
    for sig in signals:
        if not _alive(pid):
            break
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            break
        deadline = time.monotonic() + wait_s
        while _alive(pid) and time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):  # reap it if it is our child
                os.waitpid(pid, os.WNOHANG)
            time.sleep(0.2)
    if _alive(pid):
        os.killpg(pid, signal.SIGKILL)
    path.unlink(missing_ok=True)


def down(cfg: StackConfig | None = None, remove_postgres: bool = False) -> None:
    """Workers first (SIGINT, SIGINT, then SIGTERM), then the server, then the stack's PostgreSQL."""
    cfg = cfg or StackConfig()
    for path in sorted(cfg.folder.glob("worker-*.pid")):
        _stop(cfg, path.stem, [signal.SIGINT, signal.SIGINT, signal.SIGTERM], 10.0)
    stop_server(cfg)
    _stop_postgres(cfg, remove=remove_postgres)


def recorded_port(cfg: StackConfig | None = None) -> int | None:
    """The port of the server the last ``up`` started (``stack.json``), None when none is recorded."""
    url = str(recorded_state(cfg or StackConfig()).get("api_url", ""))
    port = urlsplit(url).port if url else None
    return int(port) if port else None


def status(cfg: StackConfig | None = None) -> dict[str, object]:
    """Health of the server at ``cfg``'s port, each recorded process alive or not, the database."""
    cfg = cfg or StackConfig()
    procs = {}
    for path in sorted(cfg.folder.glob("*.pid")):
        procs[path.stem] = _alive(int(path.read_text()))
    out: dict[str, object] = {"api_url": cfg.api_url, "healthy": healthy(cfg), "processes": procs,
                              "database": recorded_state(cfg).get("database", "sqlite")}
    pg = _recorded_postgres(cfg)
    if pg is not None:
        out["processes"] = {**procs, "postgres": pg.running()}
    return out
