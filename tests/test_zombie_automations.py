"""The server automations a deployed build relies on when a worker dies (tasks/framework/prefect_automations.py):
their shape, their idempotent creation, how the parent tells whether a server detects zombies,
and the bound on resumed runs. On a real server, with a worker lost: tests/test_pool_fanout.py."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.framework.context import ResumeLimitError, check_run_count
from tasks.framework.prefect_automations import (
    RESUME_NAME,
    RESUME_TAG,
    ZOMBIE_NAME,
    detects_zombies,
    ensure,
    resume_automation,
    zombie_automation,
)


class FakeAutomationsApi:
    """The three automation calls ``ensure`` makes, on a dict (the server adds an id and defaults)."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.calls: list[tuple[str, str]] = []

    def __call__(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        self.calls.append((method, path))
        if path == "/automations/filter":
            names = body["automations"]["name"]["any_"]
            return [a for a in self.stored.values() if a["name"] in names]
        if method == "POST":
            new = {**body, "id": f"a{len(self.stored)}", "created": "now"}
            new["trigger"] = {**body["trigger"], "id": "t"}
            self.stored[new["id"]] = new
            return new
        ident = path.rsplit("/", 1)[1]
        if method == "PUT":
            self.stored[ident] = {**body, "id": ident}
        elif method == "DELETE":
            del self.stored[ident]
        return None


def test_the_zombie_automation_is_prefects_with_the_profiles_window() -> None:
    body = zombie_automation(75.0)
    trigger = body["trigger"]
    assert trigger["posture"] == "Proactive" and trigger["within"] == 75.0
    assert trigger["after"] == ["prefect.flow-run.heartbeat"] and trigger["for_each"] == ["prefect.resource.id"]
    assert set(trigger["expect"]) == {"prefect.flow-run.heartbeat", "prefect.flow-run.Completed",
                                      "prefect.flow-run.Failed", "prefect.flow-run.Cancelled",
                                      "prefect.flow-run.Crashed"}
    assert body["actions"][0]["state"] == "CRASHED" and "75 s" in body["actions"][0]["message"]
    resume = resume_automation()
    assert resume["trigger"]["expect"] == ["prefect.flow-run.Crashed"] and resume["trigger"]["posture"] == "Reactive"
    assert resume["trigger"]["match_related"] == {"prefect.resource.role": "tag",
                                                  "prefect.resource.id": f"prefect.tag.{RESUME_TAG}"}
    assert (resume["actions"][0]["state"], resume["actions"][0]["name"]) == ("SCHEDULED", "AwaitingRetry")


def test_ensure_creates_once_updates_a_changed_window_and_keeps_one_of_each() -> None:
    api = FakeAutomationsApi()
    assert ensure(api, 90.0) == {ZOMBIE_NAME: "created", RESUME_NAME: "created"}
    assert ensure(api, 90.0) == {ZOMBIE_NAME: "unchanged", RESUME_NAME: "unchanged"}
    assert ensure(api, 120.0) == {ZOMBIE_NAME: "updated", RESUME_NAME: "unchanged"}
    zombie = next(a for a in api.stored.values() if a["name"] == ZOMBIE_NAME)
    assert zombie["trigger"]["within"] == 120.0
    api.stored["dup"] = {**zombie, "id": "dup"}  # the same automation created twice by hand
    ensure(api, 120.0)
    assert sorted(a["name"] for a in api.stored.values()) == sorted([ZOMBIE_NAME, RESUME_NAME])


def test_zombie_detection_is_recognised_by_its_shape_not_its_name() -> None:
    ours = zombie_automation(90.0)
    by_hand = {**ours, "name": "Crash zombie flows"}  # Prefect's docs' script
    assert detects_zombies([by_hand]) and detects_zombies([resume_automation(), ours])
    assert not detects_zombies([resume_automation()])
    assert not detects_zombies([{**ours, "enabled": False}])
    assert not detects_zombies([{**ours, "trigger": {**ours["trigger"], "posture": "Reactive"}}])
    assert not detects_zombies([{**ours, "actions": [{"type": "change-flow-run-state", "state": "CANCELLING"}]}])
    assert not detects_zombies([])


def test_a_run_started_more_often_than_resume_max_runs_fails_with_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    check_run_count(3)  # outside a flow run: nothing to check
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__RUN_COUNT", "3")
    check_run_count(3)  # the third run (resumed twice) may go on
    monkeypatch.setenv("PREFECT__RUNTIME__FLOW_RUN__RUN_COUNT", "4")
    with pytest.raises(ResumeLimitError, match=r"started 4 times .* prefect.resume_max_runs is 3"):
        check_run_count(3)


@pytest.mark.slow
def test_rde_stack_automations_creates_both_on_a_server_once(shared_server_env: dict[str, str]) -> None:
    """`rde stack automations` on a server `rde stack` did not start (this session's): created, then
    unchanged; the server then detects zombies. Both are removed again: the session's other runs
    send no heartbeats, but they should not share a server with a resume automation."""
    import subprocess
    import sys

    import httpx

    url = shared_server_env["PREFECT_API_URL"]
    command = [sys.executable, "-m", "entry.cli", "stack", "automations", "--profile", "production"]
    try:
        first = subprocess.run(command, env=shared_server_env, capture_output=True, text=True, timeout=120)
        again = subprocess.run(command, env=shared_server_env, capture_output=True, text=True, timeout=120)
        assert first.returncode == 0 and again.returncode == 0, first.stderr + again.stderr
        assert first.stdout.count("created") == 2 and again.stdout.count("unchanged") == 2, \
            first.stdout + again.stdout
        found = httpx.post(f"{url}/automations/filter", json={}, timeout=30).json()
        assert detects_zombies(found)
        zombie = next(a for a in found if a["name"] == ZOMBIE_NAME)
        assert zombie["trigger"]["within"] == 120.0  # production's prefect.fanout.stale_after_s
    finally:
        for automation in httpx.post(f"{url}/automations/filter", json={}, timeout=30).json():
            if automation["name"] in (ZOMBIE_NAME, RESUME_NAME):
                httpx.delete(f"{url}/automations/{automation['id']}", timeout=30)
