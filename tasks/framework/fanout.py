"""Shard fan-out over a work pool: a per-shard stage as shard-range flow runs of one deployment.

With ``prefect.fanout.enabled`` the runner does not map a GPU stage's shards onto tasks of the flow
run (one worker busy, the others idle), nor a CPU stage's where ``prefect.fanout.cpu_deployment``
names a deployment on a pool of CPU workers (the parent then does no per-shard work of its own).
It splits the shards still missing into ranges of
``shards_per_run`` and submits each range as a flow run of the ``run-shards`` deployment
(``run_deployment``, linked to the parent run as a subflow, so the UI shows parent and children),
which any worker of the deployment's pool picks up. A range's run loads its models once and runs
the stage's own shard code (``tasks.framework.runner.run_shard_range``: skip what exists, write atomically,
hold a ``gpu`` slot while computing).

The parent then watches: it counts finished shards on storage (the progress artifact), reads each
child's state and heartbeats (``prefect.flow-run.heartbeat`` events, sent every
``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` seconds by the child's engine), and

- resubmits the range's missing shards when its run ended Failed or Crashed, or Completed
  without them (at most ``max_attempts`` runs per range, then the stage fails with the last run's
  message);
- leaves marking a lost run Crashed to the server: a Running or Pending run whose heartbeats stop
  for ``stale_after_s`` is set Crashed by Prefect's zombie-detection automation
  (``tasks.framework.prefect_automations``; ``rde stack up`` creates it, Prefect Cloud has it built in),
  and the parent resubmits its missing shards as for any crash. Only on a server without such an
  automation (checked once per stage; warned) does the parent mark a run silent that long
  (measured on this process's clock from the last heartbeat, state change or shard it was seen to
  make) Crashed itself: else a lost worker's run would stay Running, and the stage wait, forever;
- never resubmits a run that is Cancelling or Cancelled: someone (the UI's Cancel, ``prefect
  flow-run cancel``) asked for it to stop, which is not a lost worker. The stage fails at once,
  saying so; the shards written so far stay for a rerun, and the other ranges' runs go on.

Every shard-range run is tagged with the stage key (``rde-key:<key>``). A parent that starts on a
stage whose key already has live runs (Scheduled, Pending or Running: the parent before it crashed,
and the server's resume automation ran it again; or a user ran the build again) **adopts** them:
it watches them as its own ranges, for the shards they were asked for that are not written yet,
and submits ranges only for the shards no live run covers. No shard is computed twice, and the
accounting is the one an undisturbed run makes.

When the parent itself is stopped (its own cancel: the worker sends its flow-run process SIGTERM,
which the engine raises as ``TerminationSignal``; Ctrl-C in the CLI), it cancels the shard-range
runs it submitted that have not ended, before it lets the signal end it: their workers stop their
processes and they end Cancelled. Should the parent die before it could (SIGKILL after the
worker's 30 s grace), what is left is Prefect server's cancellation-cleanup service, which cancels
the unfinished subflow runs of a Cancelled run on its loop (every 20 s by default; not tested here).

Only when every shard of the stage exists (one file per index: ``part-<index>.parquet``, written
by rename or one PUT) does the parent build the manifest, from the files themselves: their rows,
bytes and SHA-256 as read back, and the stats in their footers; the balance is checked per shard
and in total as on the single-worker path. A shard of the key found without stats in its footer is
removed before the ranges are split (its range computes it again): its input cannot be told from
its rows.

A run marked Crashed that was only slow to report (a network partition, not a dead worker) may
still finish a shard that its replacement also computes: both write the same file name, the last
rename wins, and the manifest records the file that is there (hash read back) — no row is counted
twice, but such a pair of writes is possible. Each write is announced as an ``rde.shard.written``
event (resource ``rde.shard.<stage>.<index>``), so double writes can be counted from the event log.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rde.common.orchestration_config import FanoutSpec
from storage import Artifact, ShardInfo
from tasks.framework import shards
from tasks.framework.accounting import check_balance, check_reasons, sum_stats
from tasks.framework.context import RunContext
from tasks.framework.orchestrator import (
    ALIVE,
    CANCELLED,
    TERMINAL_FAILED,
    FanoutError,
    LiveRun,
    Orchestrator,
    PrefectOrchestrator,
    RunView,
    key_tag,
)
from tasks.framework.reporting import Progress, log, publish_table, warn


@dataclass
class ShardRange:
    """One range of shard indices and the flow runs tried for it, in order."""

    indices: tuple[int, ...]  # the shards its next run is asked for (a retry asks only for the missing)
    label: str = ""  # the range as first submitted, e.g. "4-7"
    runs: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    outcomes: list[str] = field(default_factory=list)  # one per finished or abandoned run
    done: bool = False
    seen: str = ""  # the last RunView.heartbeat seen
    seen_at: float = 0.0  # when it (or a shard of the range) last changed, on this process's clock
    shards_seen: int = 0
    warned: bool = False  # the "no worker has started it" warning was given for its current run
    warned_silent: bool = False  # the "no heartbeat, waiting for the server" warning was given for it
    tries_before: int = 0  # runs of this range an earlier parent submitted before the one adopted

    @property
    def next_try(self) -> int:
        """The number the range's next run is named with (``…-try<n>``)."""
        return self.tries_before + len(self.runs) + 1

    def __post_init__(self) -> None:
        self.label = self.label or range_label(self.indices)


def range_label(indices: Sequence[int]) -> str:
    """A range as its runs are named: "4-7", or "4" for one shard."""
    first, last = indices[0], indices[-1]
    return f"{first}-{last}" if last != first else str(first)


def split_ranges(indices: Sequence[int], per_run: int) -> list[ShardRange]:
    """Consecutive ranges of at most ``per_run`` of the (sorted) missing shard indices."""
    ordered = sorted(indices)
    return [ShardRange(tuple(ordered[at:at + per_run])) for at in range(0, len(ordered), per_run)]


def plan_ranges(missing: Sequence[int], live: Sequence[LiveRun], per_run: int) -> list[ShardRange]:
    """The ranges for the ``missing`` shards: first one per live run that was asked for some of
    them (adopted: its run is its first try, already submitted), then new ranges of at most
    ``per_run`` for the shards no live run covers. A live run whose shards are all written is left
    to finish on its own; of two live runs asked for one shard (a run marked Crashed that went on),
    the first adopts it."""
    todo, adopted = set(missing), []
    for run in live:
        mine = tuple(i for i in run.indices if i in todo)
        if not mine:
            continue
        todo -= set(mine)
        earlier = re.search(r"-try(\d+)$", run.name)
        adopted.append(ShardRange(mine, label=range_label(run.indices), runs=[run.run_id], names=[run.name],
                                  tries_before=int(earlier.group(1)) - 1 if earlier else 0))
    return adopted + split_ranges(sorted(todo), per_run)


def judge(view: RunView, quiet_s: float, spec: FanoutSpec) -> str:
    """What the parent makes of a child run's latest view, ``quiet_s`` seconds after its last sign
    of life: "completed"; "cancelled" (Cancelling or Cancelled: stopped on purpose, never
    resubmitted, whatever its heartbeats); "failed" (Failed, Crashed: resubmit its missing shards);
    "lost" (Running or Pending but silent for ``stale_after_s``: its worker is presumed dead);
    "unclaimed" (no worker has started it for ``unclaimed_warn_s``); else "alive"."""
    if view.state_type == "COMPLETED":
        return "completed"
    if view.state_type in CANCELLED:
        return "cancelled"
    if view.state_type in TERMINAL_FAILED:
        return "failed"
    if view.state_type in ALIVE and quiet_s > spec.stale_after_s:
        return "lost"
    if view.state_type == "SCHEDULED" and quiet_s > spec.unclaimed_warn_s:
        return "unclaimed"
    return "alive"


def cancel_unfinished(ranges: Sequence[ShardRange], orchestrator: Orchestrator, why: str) -> list[str]:
    """Cancel the latest run of every range not done (a parent being stopped takes its children
    with it); returns the runs it asked to cancel. The first call that fails (the API is gone, as
    the CLI's temporary server is after Ctrl-C) ends the attempt: it is reported, and the parent's
    stop is not held up by the next ones failing the same way."""
    asked = []
    for r in ranges:
        if r.done or not r.runs or len(r.outcomes) >= len(r.runs):
            continue
        try:
            orchestrator.cancel(r.runs[-1], why)
        except Exception as err:  # the parent is on its way out: report, and stop trying
            warn(f"shard range {r.label}: could not cancel run {r.names[-1]} ({err}); cancel the runs of this "
                 "stage's ranges that are still going in the UI")
            break
        r.outcomes.append("cancelled with its parent")
        asked.append(r.runs[-1])
    return asked


def watch_ranges(ranges: list[ShardRange], orchestrator: Orchestrator, spec: FanoutSpec,
                 parameters: Callable[[tuple[int, ...]], dict[str, Any]], run_name: Callable[[ShardRange], str],
                 shards_present: Callable[[], set[int]], on_progress: Callable[[int], None] = lambda n: None,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 server_detects_zombies: bool = True) -> None:
    """Submit every range that has no run yet (an adopted range has one), then watch until each
    range's shards all exist (see the module docstring); raises ``FanoutError`` when a range has
    used ``max_attempts`` runs without finishing. Without ``server_detects_zombies`` the parent
    marks a silent run Crashed itself."""

    def watch_from_now(r: ShardRange, present: set[int]) -> None:  # its latest run, just submitted or adopted
        r.seen, r.seen_at, r.shards_seen = "", clock(), len(set(r.indices) & present)
        r.warned = r.warned_silent = False

    def submit(r: ShardRange, present: set[int]) -> None:
        name = run_name(r)
        r.runs.append(orchestrator.submit(parameters(r.indices), name))
        r.names.append(name)
        watch_from_now(r, present)

    def retry(r: ShardRange, outcome: str, present: set[int]) -> None:
        r.outcomes.append(outcome)
        missing = tuple(i for i in r.indices if i not in present)
        if r.next_try > spec.max_attempts:
            raise FanoutError(f"shards {list(missing)}: {r.next_try - 1} flow runs ({', '.join(r.names)}) did not "
                              f"write them; the last {outcome} (prefect.fanout.max_attempts = {spec.max_attempts})")
        warn(f"shard range {r.label}: run {r.names[-1]} {outcome}; resubmitting shards {list(missing)}")
        r.indices = missing
        submit(r, present)

    try:
        present = shards_present()
        for r in ranges:
            if r.runs:  # adopted: its run was submitted by an earlier parent
                watch_from_now(r, present)
            else:
                submit(r, present)
        while not all(r.done for r in ranges):
            sleep(spec.poll_s)
            present = shards_present()
            on_progress(len(present))
            for r in ranges:
                if not r.done:
                    present = _watch_one(r, orchestrator, spec, present, shards_present, retry, clock,
                                         server_detects_zombies)
    except Exception:
        raise  # a failed stage: the other ranges' runs finish their shards, which a rerun reuses
    except BaseException as stop:  # TerminationSignal (this run's cancel), KeyboardInterrupt: stop the children
        asked = cancel_unfinished(ranges, orchestrator, f"its parent flow run was stopped ({type(stop).__name__})")
        if asked:
            warn(f"stopped: cancelled {len(asked)} shard-range run(s) still going")
        raise


def _watch_one(r: ShardRange, orchestrator: Orchestrator, spec: FanoutSpec, present: set[int],
               shards_present: Callable[[], set[int]], retry: Callable[[ShardRange, str, set[int]], None],
               clock: Callable[[], float], server_detects_zombies: bool) -> set[int]:
    """One poll of one range's latest run (``judge``); returns the shards present, listed again when
    a completed run may have written its last shard since the listing."""
    view = orchestrator.view(r.runs[-1])
    made = len(set(r.indices) & present)
    if view.heartbeat != r.seen or made != r.shards_seen:
        r.seen, r.seen_at, r.shards_seen = view.heartbeat, clock(), made
    quiet = clock() - r.seen_at
    verdict = judge(view, quiet, spec)
    if verdict == "completed":
        if not set(r.indices) <= present:
            present = shards_present()
        if set(r.indices) <= present:
            r.done = True
            r.outcomes.append("completed")
        else:
            retry(r, "completed without writing all its shards", present)
    elif verdict == "cancelled":
        r.outcomes.append(f"{view.state_name or 'cancelled'} (not resubmitted)")
        missing = [i for i in r.indices if i not in present]
        raise FanoutError(f"shard range {r.label}: run {r.names[-1]} was cancelled ({view.state_name}: "
                          f"{view.message[:300]}); a cancelled run is not resubmitted, so the stage stops with "
                          f"shards {missing} not written. The shards written are kept: run the same command "
                          "again to compute the rest")
    elif verdict == "failed":
        retry(r, f"ended {view.state_name}: {view.message[:300]}", present)
    elif verdict == "lost" and server_detects_zombies:
        if not r.warned_silent:  # the server's automation marks it Crashed; the parent resubmits then
            r.warned_silent = True
            warn(f"shard range {r.label}: run {r.names[-1]} sent no heartbeat for {quiet:.0f} s; waiting for the "
                 "server's zombie automation to mark it Crashed")
    elif verdict == "lost":
        orchestrator.mark_crashed(r.runs[-1], f"no heartbeat for {quiet:.0f} s: its worker is presumed "
                                              "lost; the parent resubmits its missing shards")
        retry(r, f"sent no heartbeat for {quiet:.0f} s (marked Crashed by the parent)", present)
    elif verdict == "unclaimed" and not r.warned:
        r.warned = True  # waiting for a free worker of the pool (Late, AwaitingConcurrencySlot...)
        warn(f"shard range {r.label}: no worker of the pool has started run {r.names[-1]} for "
             f"{quiet:.0f} s; are all its workers busy (a parent running on the same pool "
             "holds one of its slots: run a parent that fans out on another pool, e.g. build-largefine/pool)?")
    return present




def shard_range_parameters(ctx: RunContext, stage: str, key: str, indices: tuple[int, ...]) -> dict[str, Any]:
    """The ``run-shards`` flow's parameters: how to load the same profile and find the same stage."""
    return {"flow_name": ctx.flow_name, "stage": stage, "profile": ctx.source or ctx.profile.name,
            "overrides": ctx.overrides, "output_root": ctx.output_root, "locations": dict(ctx.locations),
            "stage_key": key, "indices": list(indices)}


def fanned_out(ctx: RunContext, stage: str, outputs: Sequence[shards.Output], key: str, n_shards: int,
               *, balance: bool, device: str = "gpu") -> shards.Computed:
    """A per-shard stage's computation as shard-range flow runs on the pool of its ``device``
    (module docstring): the lifecycle (``runner.lifecycle``) has begun its outputs; this returns
    every shard's files and stats read back from storage, checked as a shard task checks them."""
    spec = ctx.profile.prefect.fanout
    deployment = spec.deployment_for(device)
    if deployment is None:
        raise FanoutError(f"{stage}: no prefect.fanout deployment for {device} stages")
    orchestrator = PrefectOrchestrator(deployment, tags=["fanout", ctx.flow_name, stage, key_tag(key)])
    orchestrator.check_deployment()
    zombies = orchestrator.detects_zombies()
    if not zombies:
        warn("the Prefect server has no zombie-detection automation (`rde stack automations` creates it; Prefect "
             "Cloud has it built in): this parent marks a shard-range run whose heartbeats stop Crashed itself, "
             "and nothing marks this parent Crashed or resumes it if its own worker dies")
    shards.discard_uncounted_shards(stage, outputs, key, range(n_shards))

    def present() -> set[int]:  # shard files of every output (begin() removed other keys' files)
        return set.intersection(*(Artifact(o.url).written_indices() for o in outputs)) & set(range(n_shards))

    before = present()
    live = orchestrator.live_runs(key)
    ranges = plan_ranges([i for i in range(n_shards) if i not in before], live, spec.shards_per_run)
    adopted = sum(1 for r in ranges if r.runs)
    log(f"{stage}: {len(before)} of {n_shards} shards already written; {len(ranges)} shard-range runs of "
        f"{deployment} for the rest" + (f", {adopted} of them adopted (still running from an earlier "
                                              "parent run)" if adopted else ""))
    with Progress(f"{ctx.flow_name}-{stage}-progress", f"{stage}: shards done of {n_shards}", stage=stage,
                  total=n_shards, unit="shards") as progress:
        try:
            watch_ranges(ranges, orchestrator, spec, lambda idx: shard_range_parameters(ctx, stage, key, idx),
                         lambda r: f"{ctx.flow_name}-{stage}-{r.label}-try{r.next_try}", present,
                         lambda n: progress.update(n), server_detects_zombies=zombies)
        finally:
            publish_table(f"{ctx.flow_name}-{stage}-fanout".lower(), fanout_rows(ranges),
                          f"{stage}: shard-range flow runs on the pool (each try, and how it ended)")
    infos, stats = collect_shards(outputs, key, n_shards, stage, balance)
    tries = sum(len(r.runs) for r in ranges)
    return shards.Computed(infos, sum_stats(stats), reused=len(before),
                           note=f" in {tries} shard-range runs for {len(ranges)} ranges")


def collect_shards(outputs: Sequence[shards.Output], key: str, n_shards: int, stage: str, balance: bool
                   ) -> tuple[list[dict[str, ShardInfo]], list[dict[str, Any]]]:
    """Every shard's ShardInfo read back from its file (rows, bytes, SHA-256) and its footer stats,
    checked as a shard task checks them; raises when a shard is missing or holds no counts (its
    input cannot be told from its rows)."""
    infos, stats = [], []
    for index in range(n_shards):
        found = shards.existing_shards(outputs, key, index)
        if found is None:
            raise FanoutError(f"{stage}: shard {index} is missing after every range's run completed")
        shard_stats = shards.footer_stats(outputs, index)
        if shard_stats is None:
            raise FanoutError(f"{stage}: shard {index} was written without its counts in the Parquet footer (by "
                              "other code than this parent's?); its input cannot be told from its rows. Run the "
                              "stage again: the parent removes such shards and has them computed")
        check_reasons(stage, shard_stats, f" shard {index}")
        if balance:
            check_balance(stage, shard_stats, f" shard {index}")
        infos.append(found)
        stats.append(shard_stats)
    return infos, stats


def fanout_rows(ranges: Sequence[ShardRange]) -> list[dict[str, Any]]:
    """One row per flow run tried: its range, try number, name and how it ended."""
    rows = []
    for r in ranges:
        for attempt, (run_id, name) in enumerate(zip(r.runs, r.names, strict=True), start=1):
            outcome = r.outcomes[attempt - 1] if attempt <= len(r.outcomes) else "running"
            rows.append({"range": r.label, "try": attempt, "flow_run": name, "flow_run_id": run_id,
                         "outcome": outcome})
    return rows
