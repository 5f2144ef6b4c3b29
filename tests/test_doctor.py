"""``rde doctor``: each check says what it found and what to do, without loading a model.

The devices come from a stand-in for ``torch.cuda`` (this machine has no GPU); models are
local folders, a Hugging Face cache laid out as the hub writes it, and an OpenAI-compatible
``/models`` endpoint on loopback; the Prefect API is a loopback server answering the routes the
doctor reads, or a closed port; the artifact root is a real folder.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner

from entry import doctor
from entry.cli import app
from models.specs import DetectorSpec, ModelSpec
from rde.profile import load_profile
from tasks.framework.prefect_automations import resume_automation, zombie_automation


def _torch(devices: list[tuple[str, int]]) -> Any:
    props = [SimpleNamespace(name=name, total_memory=memory) for name, memory in devices]
    cuda = SimpleNamespace(is_available=lambda: bool(devices), device_count=lambda: len(devices),
                           get_device_properties=lambda i: props[i])
    return SimpleNamespace(cuda=cuda)


def test_devices_against_the_devices_the_profile_asks_for() -> None:
    production, demo = load_profile("production"), load_profile("demo")
    [check] = doctor.device_checks(production, _torch([]))
    assert check.status == "fail" and "puts models on cuda" in check.fact and "GPU worker" in check.todo
    [check] = doctor.device_checks(demo, _torch([]))
    assert check.status == "ok" and check.fact.startswith("no CUDA device; ")
    gpu, cpu = doctor.device_checks(production, _torch([("NVIDIA H200", 150_000_000_000)]))
    assert (gpu.status, gpu.fact) == ("ok", "cuda:0 NVIDIA H200, 139.7 GiB") and cpu.fact.endswith("CPU cores")


def test_a_model_is_present_in_a_local_folder_or_the_hub_cache_else_missing_with_the_command(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    folder = tmp_path / "dinov2"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"\0" * 3 * 2**20)
    check = doctor.model_check("image_embedder", ModelSpec(backend="transformers", model_id=str(folder)))
    assert check.status == "ok" and check.fact.endswith(f"{folder} (3.0 MiB)")

    cache = tmp_path / "hub"  # the layout huggingface_hub writes: refs/main names the snapshot
    snapshot = cache / "models--google--siglip-base" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (cache / "models--google--siglip-base" / "refs").mkdir()
    (cache / "models--google--siglip-base" / "refs" / "main").write_text("abc123")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    check = doctor.model_check("experts", ModelSpec(backend="transformers-clip", model_id="google/siglip-base"))
    assert check.status == "ok" and check.fact.endswith(f"in the Hugging Face cache, {snapshot}")

    check = doctor.model_check("experts", ModelSpec(backend="transformers-clip", model_id="google/siglip-large"))
    assert check.status == "fail" and "missing" in check.fact
    assert check.todo.startswith("`rde models fetch` with this profile")
    assert "download google/siglip-large" in check.todo
    check = doctor.model_check("teacher", ModelSpec(backend="vlm-embedding", model_id="models/weights/UniME"))
    assert check.status == "fail" and "local path models/weights/UniME not found" in check.fact
    assert "huggingface-cli" not in check.todo  # a path is not a hub id


def test_the_production_text_llm_is_checked_for_both_roles(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """DAP's and the template gallery's Qwen3 (profiles/production.yaml): listed, missing with the
    fetch command while not in the cache, present once it is."""
    import huggingface_hub.constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    roles = ("query_generator", "template_generator")
    checks = {c.area: c for c in doctor.model_checks(load_profile("production")) if c.area[len("model "):] in roles}
    assert set(checks) == {f"model {r}" for r in roles}
    for check in checks.values():
        assert check.status == "fail" and check.fact.startswith("vllm Qwen/Qwen3-4B-Instruct-2507: missing")
        assert check.todo.startswith("`rde models fetch` with this profile")
    repo = cache / "models--Qwen--Qwen3-4B-Instruct-2507"
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    checks = [c for c in doctor.model_checks(load_profile("production")) if c.area[len("model "):] in roles]
    assert [c.status for c in checks] == ["ok", "ok"] and all("in the Hugging Face cache" in c.fact for c in checks)


def test_bundled_and_offline_models_and_the_detector(tmp_path: Path) -> None:
    checks = {c.area: c for c in doctor.model_checks(load_profile("demo"))}
    assert all(c.status == "ok" for c in checks.values()), checks
    assert "bundled" in checks["model detector"].fact and "no weights of its own" in checks["model experts"].fact
    assert checks["model query_generator"].fact.endswith("MiB)")  # the GGUF file found and sized
    yolo_yaml = doctor.model_check("detector", DetectorSpec(backend="yolo", weights="yolov8n.yaml"))
    assert yolo_yaml.status == "warn" and "random weights" in yolo_yaml.fact
    missing = doctor.model_check("detector", DetectorSpec(backend="yolo", weights=str(tmp_path / "yolov8x.pt")))
    assert missing.status == "fail" and "not found" in missing.fact


@pytest.fixture
def loopback() -> Iterator[tuple[str, dict[str, tuple[int, Any]]]]:
    """A loopback HTTP server answering GET and POST paths from a dict: path -> (status, JSON body)."""
    routes: dict[str, tuple[int, Any]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            status, body = routes.get(self.path, (404, {"detail": "Not Found"}))
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self.do_GET()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", routes
    finally:
        server.shutdown()
        server.server_close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_served_model_is_checked_at_its_endpoint(loopback: tuple[str, dict[str, tuple[int, Any]]]) -> None:
    url, routes = loopback
    routes["/v1/models"] = (200, {"data": [{"id": "Qwen/Qwen2-VL-7B-Instruct"}]})
    spec = ModelSpec(backend="openai-http", model_id="Qwen/Qwen2-VL-7B-Instruct", options={"base_url": f"{url}/v1"})
    assert doctor.model_check("generators", spec).status == "ok"
    other = spec.model_copy(update={"model_id": "OpenGVLab/InternVL2_5-8B"})
    check = doctor.model_check("generators", other)
    assert check.status == "warn" and "Qwen/Qwen2-VL-7B-Instruct" in check.fact
    dead = spec.model_copy(update={"options": {"base_url": f"http://127.0.0.1:{_closed_port()}/v1"}})
    check = doctor.model_check("generators", dead)
    assert check.status == "fail" and "does not answer" in check.fact and "vllm serve" in check.todo


def test_prefect_ephemeral_a_dead_server_and_a_reached_one(loopback: tuple[str, dict[str, tuple[int, Any]]],
                                                         monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    prof = load_profile("demo")
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", raising=False)
    monkeypatch.delenv("PREFECT_API_DATABASE_CONNECTION_URL", raising=False)
    api, gpu, database = doctor.prefect_checks(prof)
    assert api.status == "ok" and api.fact.startswith("ephemeral") and database.fact.startswith("SQLite in ")

    monkeypatch.setenv("PREFECT_API_URL", f"http://127.0.0.1:{_closed_port()}/api")
    [api] = doctor.prefect_checks(prof)
    assert api.status == "fail" and "does not answer" in api.fact and "rde stack up" in api.todo

    url, routes = loopback
    monkeypatch.setenv("PREFECT_API_URL", f"{url}/api")
    routes["/api/health"] = (200, True)
    routes["/api/admin/version"] = (200, "3.6.0")
    routes["/api/admin/settings"] = (200, {"server": {"database": {"driver": "postgresql+asyncpg"}}})
    routes["/api/automations/filter"] = (200, [])
    api, gpu, automations, database = doctor.prefect_checks(prof)
    assert (api.status, api.fact) == ("ok", f"{url}/api answers (Prefect 3.6.0)")
    assert gpu.status == "warn" and "prefect gcl create gpu" in gpu.todo  # no limit named 'gpu' there
    assert automations.status == "warn" and "no zombie detection and no resume-on-crash" in automations.fact
    assert "rde stack automations --profile demo" in automations.todo
    assert (database.status, database.fact) == ("ok", "PostgreSQL")
    routes["/api/v2/concurrency_limits/gpu"] = (200, {"name": "gpu", "limit": 4, "active": True})
    routes["/api/admin/settings"] = (200, {"server": {"database": {"driver": "sqlite+aiosqlite"}}})
    routes["/api/automations/filter"] = (200, [zombie_automation(90.0)])
    api, gpu, automations, database = doctor.prefect_checks(prof)
    assert automations.status == "warn" and automations.fact.startswith("no resume-on-crash on this server")
    routes["/api/automations/filter"] = (200, [zombie_automation(90.0), resume_automation()])
    api, gpu, automations, database = doctor.prefect_checks(prof)
    assert automations.status == "ok" and automations.fact.startswith("zombie detection and resume-on-crash")
    assert (gpu.status, gpu.fact) == ("ok", "'gpu': 4 slots, active")
    assert database.status == "warn" and "--postgres" in database.todo
    # a real server reports no driver (its connection URL is hidden): the stack's own record says
    routes["/api/admin/settings"] = (200, {"server": {"database": {"driver": None, "connection_url": "*****"}}})
    assert doctor.prefect_checks(prof, tmp_path)[-1].fact.startswith("not reported")
    (tmp_path / "stack.json").write_text(json.dumps({"api_url": f"{url}/api", "database": "postgres (stack)"}))
    assert doctor.prefect_checks(prof, tmp_path)[-1].fact == "PostgreSQL"


def test_a_fanned_out_profile_is_told_which_pools_it_needs_and_whether_each_has_a_worker(
        loopback: tuple[str, dict[str, tuple[int, Any]]]) -> None:
    """The gpu deployment's pool with a worker online is ok; the cpu deployment missing, then its
    pool without an online worker, fails with what to do; a profile that does not fan out, or
    fans out its GPU stages only, is asked for those pools only."""
    url, routes = loopback
    api = f"{url}/api"
    assert doctor.pool_checks(api, load_profile("demo")) == []
    both = load_profile("demo", {"prefect": {"fanout": {"enabled": True, "cpu_deployment": "run-shards/cpu"}}})
    routes["/api/deployments/name/run-shards/gpu"] = (200, {"name": "gpu", "work_pool_name": "gpu"})
    routes["/api/work_pools/gpu/workers/filter"] = (200, [{"name": "g1", "status": "ONLINE"},
                                                          {"name": "g2", "status": "OFFLINE"}])
    gpu, cpu = doctor.pool_checks(api, both)
    assert (gpu.area, gpu.status) == ("gpu pool", "ok")
    assert gpu.fact == "run-shards/gpu runs on pool 'gpu': 1 worker(s) online"
    assert (cpu.area, cpu.status) == ("cpu pool", "fail") and "no deployment 'run-shards/cpu'" in cpu.fact
    routes["/api/deployments/name/run-shards/cpu"] = (200, {"name": "cpu", "work_pool_name": "cpu"})
    routes["/api/work_pools/cpu/workers/filter"] = (200, [{"name": "c1", "status": "OFFLINE"}])
    _, cpu = doctor.pool_checks(api, both)
    assert cpu.status == "fail" and "no worker online" in cpu.fact and "prefect worker start --pool cpu" in cpu.todo
    gpu_only = load_profile("demo", {"prefect": {"fanout": {"enabled": True}}})
    assert [c.area for c in doctor.pool_checks(api, gpu_only)] == ["gpu pool"]


def test_the_artifact_root_is_written_to_and_left_clean(tmp_path: Path) -> None:
    prof = load_profile("demo")
    root = tmp_path / "artifacts"
    assert doctor.storage_check(prof, str(root)).status == "ok"
    assert list(root.iterdir()) == []  # the probe is removed
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    check = doctor.storage_check(prof, str(blocked / "artifacts"))
    assert check.status == "fail" and "cannot write" in check.fact and "writable" in check.todo


def test_the_command_prints_every_check_and_fails_on_a_failed_one(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    result = CliRunner().invoke(app, ["doctor", "--profile", "demo", "--output", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    checks = json.loads(result.output)
    assert {c["area"] for c in checks} >= {"device", "model detector", "prefect api", "gpu limit", "database",
                                           "artifacts"}
    result = CliRunner().invoke(app, ["doctor", "--profile", "production", "--output", str(tmp_path), "--json"])
    assert result.exit_code == 1  # no weights of the production models here
    missing = [c for c in json.loads(result.output) if c["status"] == "fail" and c["area"].startswith("model")]
    assert len(missing) >= 8 and all(c["todo"] for c in missing)


def test_rde_models_no_load_says_present_or_missing_without_loading(monkeypatch: pytest.MonkeyPatch) -> None:
    from entry import cli

    monkeypatch.setattr(cli.console, "width", 300)  # one table line per model
    result = CliRunner().invoke(app, ["models", "--profile", "demo", "--no-load"])
    assert result.exit_code == 0, result.output
    assert result.output.count("present: ") == 8 and "missing" not in result.output  # the text LLMs included
    assert "present: llama-cpp bundled:SmolLM2-135M-Instruct" in result.output
    result = CliRunner().invoke(app, ["models", "--profile", "production", "--no-load"])
    assert result.exit_code == 1
    assert "missing: transformers facebook/dinov2-large" in result.output
    assert result.output.count("missing: vllm Qwen/Qwen3-4B-Instruct-2507") == 2  # query and template generator
    assert "`rde models fetch` with this profile" in result.output
