"""The two Prefect automations a deployed build relies on when a worker dies, as server objects.

- **Zombie detection** (Prefect's "Detect zombie flows"; Prefect Cloud's managed "Unresponsive run
  detection"): a proactive trigger per flow run: after a ``prefect.flow-run.heartbeat`` event, the
  next heartbeat or a final state must follow within ``stale_after_s``; when none does, the run is
  set Crashed. Flow-run processes send heartbeats every ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY``
  seconds (30 in ``rde stack up``), so the window must be longer than that.
- **Resume on crash**: a reactive trigger on ``prefect.flow-run.Crashed`` for the flow runs tagged
  ``resume-on-crash`` (the build deployments in ``prefect.yaml``; never ``run-shards``, whose lost
  runs their parent resubmits): the run is set Scheduled (``AwaitingRetry``, as the UI's Retry
  does) and a worker of its pool runs the same flow run again, with its parameters. The build
  reuses every shard already written (content keys) and adopts its live shard-range runs
  (``tasks.framework.fanout``). A run that keeps crashing is bounded by ``prefect.resume_max_runs``
  (``tasks.framework.context.run_locked``).

``rde stack up`` creates both (``ensure``); on another server, ``rde stack automations`` does. The
fanned-out parent asks whether the server has zombie detection (``detects_zombies``) and only when
it does not, marks silent runs Crashed itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

ZOMBIE_NAME = "rde: crash flow runs whose heartbeats stopped"
RESUME_NAME = "rde: resume crashed build runs"
RESUME_TAG = "resume-on-crash"
HEARTBEAT = "prefect.flow-run.heartbeat"
ZOMBIE_MESSAGE = "no heartbeat for {window:.0f} s: marked Crashed by the server's zombie automation"
RESUME_MESSAGE = ("crashed: run again by the server's resume automation; it reuses every shard already "
                  "written and adopts its live shard-range runs")


def zombie_automation(stale_after_s: float) -> dict[str, Any]:
    """Prefect's zombie-detection automation with a window of ``stale_after_s`` seconds, as the JSON
    body of ``POST /automations/`` (validated by Prefect's own schema classes)."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    automation = AutomationCore(
        name=ZOMBIE_NAME,
        description="A flow run that sent no heartbeat for the window is marked Crashed (its process or "
                    "worker is presumed lost). Created by `rde stack`.",
        trigger=EventTrigger(
            after={HEARTBEAT},
            expect={HEARTBEAT, "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                    "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            for_each={"prefect.resource.id"}, posture=Posture.Proactive, threshold=1,
            within=timedelta(seconds=stale_after_s)),
        actions=[ChangeFlowRunState(state=StateType.CRASHED, message=ZOMBIE_MESSAGE.format(window=stale_after_s))])
    return automation.model_dump(mode="json")


def resume_automation() -> dict[str, Any]:
    """The resume-on-crash automation (module docstring), as the JSON body of ``POST /automations/``."""
    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    automation = AutomationCore(
        name=RESUME_NAME,
        description=f"A crashed flow run tagged {RESUME_TAG!r} is scheduled again (AwaitingRetry). Created by "
                    "`rde stack`.",
        trigger=EventTrigger(
            expect={"prefect.flow-run.Crashed"},
            match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
            match_related=ResourceSpecification({"prefect.resource.role": "tag",
                                                 "prefect.resource.id": f"prefect.tag.{RESUME_TAG}"}),
            for_each={"prefect.resource.id"}, posture=Posture.Reactive, threshold=1, within=timedelta(0)),
        actions=[ChangeFlowRunState(state=StateType.SCHEDULED, name="AwaitingRetry", message=RESUME_MESSAGE)])
    return automation.model_dump(mode="json")


def detects_zombies(automations: Iterable[dict[str, Any]]) -> bool:
    """Whether one of the server's automations (as the API returns them) is zombie detection:
    enabled, a proactive trigger after heartbeat events, an action that sets a flow run Crashed.
    Judged by shape, not by name, so one created by hand from Prefect's docs counts too."""
    for automation in automations:
        trigger, actions = automation.get("trigger") or {}, automation.get("actions") or []
        if (automation.get("enabled", True) and trigger.get("posture") == "Proactive"
                and HEARTBEAT in (trigger.get("after") or [])
                and any(a.get("type") == "change-flow-run-state" and a.get("state") == "CRASHED" for a in actions)):
            return True
    return False


def ensure(api: Callable[[str, str, dict[str, Any] | None], Any], stale_after_s: float) -> dict[str, str]:
    """Create the two automations on the server that ``api(method, path, body)`` calls, or update
    ours when they differ (idempotent: run it again and nothing changes); returns what was done
    per automation name: "created", "updated" or "unchanged"."""
    done = {}
    for body in (zombie_automation(stale_after_s), resume_automation()):
        found = api("POST", "/automations/filter", {"automations": {"name": {"any_": [body["name"]]}}})
        if not found:
            api("POST", "/automations/", body)
            done[body["name"]] = "created"
            continue
        current = found[0]
        if all(_same(current.get(k), v) for k, v in body.items()):
            done[body["name"]] = "unchanged"
        else:
            api("PUT", f"/automations/{current['id']}", body)
            done[body["name"]] = "updated"
        for extra in found[1:]:  # a duplicate by name (created twice by hand): one is enough
            api("DELETE", f"/automations/{extra['id']}", None)
    return done


def _same(current: Any, wanted: Any) -> bool:
    """Whether a field as the server returns it equals the body's (the server adds fields with
    defaults and may order a set's items differently)."""
    if isinstance(wanted, dict):
        return isinstance(current, dict) and all(_same(current.get(k), v) for k, v in wanted.items())
    if isinstance(wanted, list):
        if not isinstance(current, list) or len(current) != len(wanted):
            return False
        if all(not isinstance(w, dict | list) for w in wanted):
            return sorted(map(str, current)) == sorted(map(str, wanted))
        return all(_same(c, w) for c, w in zip(current, wanted, strict=True))
    return current == wanted
