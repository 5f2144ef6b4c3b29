"""A build-largefine whose captioning fans out over the stack's `gpu` pool, with an OpenAI-compatible
stub generator that answers after a fixed delay (the work is then I/O-bound, so several workers on
two cores are meaningful). Shared by the worker-loss test (tests/test_deployment_stack.py) and
benchmarks/pool_scaling.py. The stub's captions are for load, not for quality."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from openai_stub import StubServer, _completion
from stack_checks import api

from entry.stack import StackConfig, api_request, http_client

QA = ("Q1: What is on the top? A1: A dark jacket with long sleeves.\n"
      "Q2: What is on the bottom? A2: Grey trousers.\n"
      "Q3: What are the shoes? A3: White sneakers.\n"
      "Q4: What does the person carry? A4: A black backpack.")
DESCRIPTION = "The person wears a dark jacket, grey trousers and white sneakers, and carries a black backpack."


class DelayedCaptioner:
    """Stub behaviour: Q&A pairs for Q&A prompts, a description for the others, each after
    ``delay_s`` seconds (a GPU generator's latency stood in by a sleep)."""

    def __init__(self, delay_s: float) -> None:
        self.delay_s = delay_s

    def __call__(self, text: str) -> tuple[int, bytes, float]:
        answer = QA if "<question>" in text else DESCRIPTION
        return 200, json.dumps(_completion(answer)).encode(), self.delay_s


def stub_server(delay_s: float) -> StubServer:
    return StubServer(script=DelayedCaptioner(delay_s))


def fanout_params(out: Path, pool_url: str, base_url: str, *, images: int, shard_size: int, per_run: int,
                  stale_after_s: float, fanout: bool = True) -> dict[str, Any]:
    """build-largefine/demo up to the Q&A tiers: ``images`` images captioned in shards of
    ``shard_size``, the qa-tiers stage fanned out in ranges of ``per_run`` shards."""
    spec = {"backend": "openai-http", "model_id": "stub", "batch_size": 8,
            "options": {"base_url": base_url, "timeout_s": 30, "max_retries": 1, "max_concurrency": 8}}
    return {"until": "tiers", "output_root": str(out),
            "overrides": {"input": {"kind": "pool", "path": pool_url}, "ingest": {"shard_size": 48},
                          "models": {"generators": [spec], "template_generator": spec},
                          "largefine": {"max_images": images, "shard_size": shard_size, "tier_prompt": "gtr_tiers"},
                          "prefect": {"fanout": {"enabled": fanout, "stages": ["qa-tiers"], "shards_per_run": per_run,
                                                 "poll_s": 1.0, "stale_after_s": stale_after_s}}}}


def submit(cfg: StackConfig, params: dict[str, Any]) -> str:
    """``prefect deployment run build-largefine/pool`` (the parent on the cpu pool; no wait); the
    new flow run's id."""
    done = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "build-largefine/pool",
                           "--params", json.dumps(params)], env=cfg.env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, (done.stdout + done.stderr)[-2000:]
    found = re.search(r"UUID: ([0-9a-f-]{36})", done.stdout)
    assert found, done.stdout[-2000:]
    return found.group(1)


def flow_run(cfg: StackConfig, run_id: str) -> dict[str, Any]:
    return api_request(cfg, "GET", f"/flow_runs/{run_id}", timeout=30)


def wait_final(cfg: StackConfig, run_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = flow_run(cfg, run_id)
        if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            return run
        time.sleep(1.0)
    raise AssertionError(f"flow run {run_id} did not finish within {timeout_s} s")


def shard_runs(cfg: StackConfig, parent_id: str) -> list[dict[str, Any]]:
    """The run-shards flow runs the parent submitted (its subflows), oldest first."""
    return api(cfg, "/flow_runs/filter", {"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}},
                                          "flows": {"name": {"any_": ["run-shards"]}}, "sort": "START_TIME_ASC"})


def shard_write_events(cfg: StackConfig, stage: str) -> dict[str, list[str]]:
    """``rde.shard.written`` events of ``stage``: shard index → the flow runs that wrote it."""
    body = {"filter": {"event": {"name": ["rde.shard.written"]}, "occurred": {"since": "2020-01-01T00:00:00Z"}},
            "limit": 50}
    page = api_request(cfg, "POST", "/events/filter", body, timeout=30)
    events = list(page["events"])
    while page.get("next_page"):
        page = http_client().get(page["next_page"], timeout=30).raise_for_status().json()
        events += page["events"]
    writers: dict[str, list[str]] = {}
    for event in events:
        if event["resource"].get("rde.stage") != stage:
            continue
        run = next((r["prefect.resource.id"] for r in event.get("related", [])
                    if r.get("prefect.resource.role") == "flow-run"), "")
        writers.setdefault(event["resource"]["rde.index"], []).append(run)
    return writers
