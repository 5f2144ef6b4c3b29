"""The Prefect side of fan-out: what the parent sees of a shard-range flow run, and the Prefect
API calls that submit, watch, mark and cancel them (``fanout`` plans and watches the ranges)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

TERMINAL_FAILED = ("FAILED", "CRASHED")
CANCELLED = ("CANCELLED", "CANCELLING")
ALIVE = ("RUNNING", "PENDING")


class FanoutError(RuntimeError):
    """A fanned-out stage could not finish: a range failed ``max_attempts`` times, the deployment is
    missing, or a shard-range run computes another stage key than its parent."""


@dataclass(frozen=True)
class RunView:
    """What the parent sees of one child flow run: its state and its latest sign of life."""

    state_type: str
    state_name: str
    message: str
    heartbeat: str  # an id that changes with each heartbeat or state change ("" when none yet)


class Orchestrator(Protocol):
    """How the parent submits and watches shard-range runs (Prefect in production; a fake in tests)."""

    def submit(self, parameters: dict[str, Any], run_name: str) -> str: ...

    def view(self, run_id: str) -> RunView: ...

    def mark_crashed(self, run_id: str, message: str) -> None: ...

    def cancel(self, run_id: str, message: str) -> None: ...

    def live_runs(self, key: str) -> list[LiveRun]: ...

    def detects_zombies(self) -> bool: ...


@dataclass(frozen=True)
class LiveRun:
    """A shard-range run of a stage key that has not ended (Scheduled, Pending or Running): one a
    new parent adopts instead of submitting its shards again."""

    run_id: str
    name: str
    indices: tuple[int, ...]


def key_tag(key: str) -> str:
    """The tag every shard-range run of a stage key carries (how a new parent finds them)."""
    return f"rde-key:{key}"



class PrefectOrchestrator:
    """Shard-range runs through the Prefect API: ``run_deployment`` (no wait; a subflow of the
    current run), ``read_flow_run`` and the heartbeat events of each run."""

    def __init__(self, deployment: str, tags: Sequence[str] = ()) -> None:
        self.deployment, self.tags = deployment, list(tags)

    def check_deployment(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        try:
            with get_client(sync_client=True) as client:
                client.read_deployment_by_name(self.deployment)
        except ObjectNotFound:
            raise FanoutError(f"prefect.fanout is on, but the Prefect server has no deployment {self.deployment!r} "
                              "(`rde stack up` deploys prefect.yaml's run-shards/gpu); deploy it, or set "
                              "prefect.fanout.enabled=false to run the shards in this flow run") from None

    def submit(self, parameters: dict[str, Any], run_name: str) -> str:
        from prefect.deployments import run_deployment

        flow_run = run_deployment(self.deployment, parameters=parameters, flow_run_name=run_name, timeout=0,
                                  tags=self.tags)
        return str(flow_run.id)

    def view(self, run_id: str) -> RunView:
        from prefect.client.orchestration import get_client
        from prefect.events.filters import EventFilter, EventNameFilter, EventOccurredFilter, EventResourceFilter

        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_id)
            state = run.state
            try:
                page = client.read_events(EventFilter(
                    occurred=EventOccurredFilter(since=run.created),
                    event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                    resource=EventResourceFilter(id=[f"prefect.flow-run.{run_id}"])), limit=1)
                beats = f"{page.total}"
            except Exception:  # an events backend that does not answer: the state alone decides
                beats = "?"
        stamp = state.timestamp.isoformat() if state and state.timestamp else ""
        return RunView(state.type.value if state else "SCHEDULED", state.name if state else "", (state.message or "")
                       if state else "", f"{state.name if state else ''}@{stamp}#{beats}")

    def mark_crashed(self, run_id: str, message: str) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(run_id, Crashed(message=message), force=True)

    def live_runs(self, key: str) -> list[LiveRun]:
        """The runs of this deployment tagged with the stage key that have not ended, oldest first."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import (
            FlowRunFilter,
            FlowRunFilterState,
            FlowRunFilterStateType,
            FlowRunFilterTags,
        )
        from prefect.client.schemas.objects import StateType
        from prefect.client.schemas.sorting import FlowRunSort

        alive = [StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING]
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name(self.deployment)
            runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                deployment_id={"any_": [deployment.id]}, tags=FlowRunFilterTags(all_=[key_tag(key)]),
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=alive))),
                sort=FlowRunSort.START_TIME_ASC)
        return [LiveRun(str(r.id), r.name, tuple(int(i) for i in r.parameters.get("indices", []))) for r in runs]

    def detects_zombies(self) -> bool:
        """Whether the server has an enabled zombie-detection automation (judged by its shape)."""
        from prefect.client.orchestration import get_client

        from tasks.framework.prefect_automations import detects_zombies

        with get_client(sync_client=True) as client:
            automations = client.read_automations()
        return detects_zombies(a.model_dump(mode="json") for a in automations)

    def cancel(self, run_id: str, message: str) -> None:
        """Ask for a run to stop, as the UI's Cancel does: Cancelling, on which its worker stops the
        flow-run process and records Cancelled. A run no worker has started yet (Scheduled, Late,
        AwaitingConcurrencySlot) has no process to stop: it is set Cancelled at once, else it would
        wait in Cancelling for the server's timeout. A run already ending or ended is left alone.
        Without the client's retries: the parent is being stopped, and a gone API must not hold
        it for the minutes of back-off the stack allows its runs (``StackConfig.api_retries``)."""
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.responses import SetStateStatus
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings
        from prefect.states import Cancelled, Cancelling

        with temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}), get_client(sync_client=True) as client:
            state = client.read_flow_run(run_id).state
            if state is None or state.is_final() or state.is_cancelling():
                return
            if state.is_scheduled():
                result = client.set_flow_run_state(run_id, Cancelled(message=message))
                if result.status == SetStateStatus.ACCEPT:
                    return  # else a worker took it meanwhile: it has a process to stop
            client.set_flow_run_state(run_id, Cancelling(message=message))

