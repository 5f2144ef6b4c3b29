"""Shard fan-out (tasks/framework/fanout.py): the parent's watch loop on a scripted orchestrator (submit,
crash, lost worker, too many tries, a cancelled child, the parent stopped), then a whole
fanned-out stage in one process, its shard-range "runs" executed by threads through the same
child code (``run_shard_range``) that a worker runs.
The loop on a real server and pool is tests/test_deployment_stack.py's fan-out test."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from prefect import flow
from prefect.exceptions import TerminationSignal

from rde.common.orchestration_config import FanoutSpec
from rde.profile import load_profile
from storage import Artifact
from tasks.framework.context import RunContext
from tasks.framework.fanout import (
    FanoutError,
    LiveRun,
    RunView,
    ShardRange,
    judge,
    plan_ranges,
    split_ranges,
    watch_ranges,
)
from tasks.framework.runner import fans_out, run_pipeline, run_shard_range
from tasks.framework.stage import Pipeline, Resources, Stage, StageRun, Work, Write

NUMBERS = pa.schema([pa.field("n", pa.int64(), nullable=False)])
REJECTS = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("reason", pa.string(), nullable=False)])


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Scripted:
    """Runs that do what ``script[(range label, try)]`` says: "ok" writes its shards on the first
    poll and completes, "crash" ends Crashed, "silent" stays Running with no heartbeat, "beating"
    stays Running with a new heartbeat each poll, "hollow" completes without writing, "cancelled"
    ends Cancelled, "cancelling" stays Cancelling with no heartbeat (a process being stopped)."""

    def __init__(self, script: dict[tuple[str, int], str], written: set[int]) -> None:
        self.script, self.written = script, written
        self.runs: dict[str, tuple[str, tuple[int, ...]]] = {}
        self.crashed: list[str] = []
        self.cancelled: list[str] = []
        self.views = 0

    def submit(self, parameters: dict[str, Any], run_name: str) -> str:
        label, attempt = run_name.rsplit("-try", 1)
        run_id = f"run{len(self.runs)}"
        self.runs[run_id] = (self.script.get((label, int(attempt)), "ok"), tuple(parameters["indices"]))
        return run_id

    def view(self, run_id: str) -> RunView:
        self.views += 1
        behaviour, indices = self.runs[run_id]
        if run_id in self.crashed:
            return RunView("CRASHED", "Crashed", "marked", "x")
        if behaviour == "ok":
            self.written.update(indices)
            return RunView("COMPLETED", "Completed", "", "done")
        if behaviour == "crash":
            return RunView("CRASHED", "Crashed", "process exited -9", "c")
        if behaviour == "hollow":
            return RunView("COMPLETED", "Completed", "", "h")
        if behaviour == "unclaimed":
            return RunView("SCHEDULED", "Late", "", "")
        if behaviour == "beating":
            return RunView("RUNNING", "Running", "", f"beat{self.views}")
        if behaviour == "cancelled":
            return RunView("CANCELLED", "Cancelled", "cancelled from the UI", "x")
        if behaviour == "cancelling":
            return RunView("CANCELLING", "Cancelling", "", "still")
        return RunView("RUNNING", "Running", "", "still")

    def mark_crashed(self, run_id: str, message: str) -> None:
        self.crashed.append(run_id)

    def cancel(self, run_id: str, message: str) -> None:
        self.cancelled.append(run_id)


def _watch(script: dict[tuple[str, int], str], n: int = 4, per_run: int = 2, server_detects_zombies: bool = True,
           **spec: Any) -> tuple[list[ShardRange], Scripted, Clock]:
    written: set[int] = set()
    orch, clock = Scripted(script, written), Clock()
    ranges = split_ranges(range(n), per_run)
    watch_ranges(ranges, orch, FanoutSpec(**{"poll_s": 1.0, "stale_after_s": 10.0, **spec}),
                 lambda idx: {"indices": list(idx)}, lambda r: f"{r.label}-try{r.next_try}",
                 lambda: set(written), clock=clock, sleep=clock.sleep, server_detects_zombies=server_detects_zombies)
    assert written == set(range(n))
    return ranges, orch, clock


def test_ranges_split_the_missing_shards_and_each_runs_once_when_nothing_fails() -> None:
    assert [r.indices for r in split_ranges([5, 0, 1, 2, 7], 2)] == [(0, 1), (2, 5), (7,)]
    ranges, orch, _ = _watch({})
    assert [(r.label, len(r.runs), r.outcomes) for r in ranges] == [("0-1", 1, ["completed"]),
                                                                     ("2-3", 1, ["completed"])]
    assert not orch.crashed


def test_a_crashed_or_hollow_run_is_resubmitted_for_its_missing_shards_only() -> None:
    ranges, orch, _ = _watch({("0-1", 1): "crash", ("2-3", 1): "hollow"})
    assert [len(r.runs) for r in ranges] == [2, 2]
    assert ranges[0].outcomes[0].startswith("ended Crashed: process exited -9")
    assert ranges[1].outcomes[0] == "completed without writing all its shards"
    assert [orch.runs[r.runs[-1]][1] for r in ranges] == [(0, 1), (2, 3)]


def test_a_silent_run_is_left_to_the_servers_zombie_automation_and_resubmitted_once_it_is_crashed(
        capsys: pytest.CaptureFixture[str]) -> None:
    """With zombie detection on the server the parent never marks a run Crashed itself: it warns
    once that the run is silent, and resubmits its shards when the server's automation has set it
    Crashed (here 25 s after the parent last saw it alive)."""
    written: set[int] = set()
    orch, clock = Scripted({("0-1", 1): "silent"}, written), Clock()
    ranges = split_ranges(range(4), 2)

    def server_crashes_it_at_25_s(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now > 25:
            orch.runs[ranges[0].runs[0]] = ("crash", (0, 1))

    watch_ranges(ranges, orch, FanoutSpec(poll_s=1.0, stale_after_s=10.0), lambda idx: {"indices": list(idx)},
                 lambda r: f"{r.label}-try{r.next_try}", lambda: set(written), clock=clock,
                 sleep=server_crashes_it_at_25_s, server_detects_zombies=True)
    assert not orch.crashed and len(ranges[0].runs) == 2 and written == {0, 1, 2, 3}
    assert ranges[0].outcomes[0].startswith("ended Crashed")
    assert 25.0 < clock.now < 28.0
    out = capsys.readouterr().out
    assert out.count("waiting for the server's zombie automation") == 1


def test_a_run_whose_heartbeats_stop_is_marked_crashed_and_replaced_but_a_beating_one_is_left() -> None:
    """Without zombie detection on the server (the fallback) the parent marks a silent run Crashed."""
    ranges, orch, clock = _watch({("0-1", 1): "silent"}, stale_after_s=10.0, server_detects_zombies=False)
    assert orch.crashed == [ranges[0].runs[0]] and len(ranges[0].runs) == 2
    assert ranges[0].outcomes[0].startswith("sent no heartbeat for 1")
    assert "(marked Crashed by the parent)" in ranges[0].outcomes[0]
    assert 10.0 < clock.now < 14.0  # replaced within a poll or two after the stale limit
    # a long shard whose run keeps beating is not touched (bounded here by a hollow try later)
    beating = Scripted({("0-1", 1): "beating"}, set())
    ranges = split_ranges(range(2), 2)
    clock = Clock()

    def stop_after_a_while(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now > 60:
            beating.runs[ranges[0].runs[0]] = ("ok", (0, 1))

    watch_ranges(ranges, beating, FanoutSpec(poll_s=1.0, stale_after_s=10.0), lambda idx: {"indices": list(idx)},
                 lambda r: f"{r.label}-try{len(r.runs) + 1}", lambda: beating.written, clock=clock,
                 sleep=stop_after_a_while, server_detects_zombies=False)
    assert not beating.crashed and len(ranges[0].runs) == 1


def test_a_run_no_worker_starts_is_waited_for_with_one_warning(capsys: pytest.CaptureFixture[str]) -> None:
    """A scheduled run is not a lost one (every worker may be busy): no resubmission, one warning."""
    orch, clock = Scripted({("0-1", 1): "unclaimed"}, set()), Clock()
    ranges = split_ranges(range(2), 2)

    def claimed_later(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now > 400:
            orch.runs[ranges[0].runs[0]] = ("ok", (0, 1))

    watch_ranges(ranges, orch, FanoutSpec(poll_s=1.0, stale_after_s=10.0, unclaimed_warn_s=300.0),
                 lambda idx: {"indices": list(idx)}, lambda r: f"{r.label}-try{len(r.runs) + 1}",
                 lambda: orch.written, clock=clock, sleep=claimed_later)
    assert len(ranges[0].runs) == 1 and not orch.crashed
    assert capsys.readouterr().out.count("no worker of the pool has started run 0-1-try1 for 30") == 1


def test_a_new_parent_adopts_the_live_runs_of_its_stage_key_and_submits_only_the_shards_they_miss() -> None:
    """Shards 0-7 of which 0 and 5 are written; live runs from the crashed parent: "1-3-try2"
    (asked for 1, 2, 3) and "4-5-try1" (asked for 4, 5); shards 6, 7 have none. Hand-computed: the
    first is adopted for (1, 2, 3), the second for (4,) (5 is written), and one new range (6, 7)
    is submitted; a retry of the first range is named try3."""
    live = [LiveRun("a", "build-largefine-qa-tiers-1-3-try2", (1, 2, 3)),
            LiveRun("b", "build-largefine-qa-tiers-4-5-try1", (4, 5)),
            LiveRun("c", "build-largefine-qa-tiers-0-try1", (0,))]  # all its shards written: left alone
    ranges = plan_ranges([1, 2, 3, 4, 6, 7], live, per_run=2)
    assert [(r.indices, r.label, r.runs, r.next_try) for r in ranges] == [
        ((1, 2, 3), "1-3", ["a"], 3), ((4,), "4-5", ["b"], 2), ((6, 7), "6-7", [], 1)]
    # watched: the adopted runs are not submitted again; only (6, 7) is
    written = {0, 5}
    orch, clock = Scripted({}, written), Clock()
    orch.runs.update({"a": ("ok", (1, 2, 3)), "b": ("crash", (4, 5))})
    watch_ranges(ranges, orch, FanoutSpec(poll_s=1.0), lambda idx: {"indices": list(idx)},
                 lambda r: f"{r.label}-try{r.next_try}", lambda: set(written), clock=clock, sleep=clock.sleep)
    assert written == set(range(8))
    submitted = {rid: idx for rid, (_, idx) in orch.runs.items() if rid not in ("a", "b")}
    assert sorted(submitted.values()) == [(4,), (6, 7)]  # the crashed adoptee's missing shard, the new range
    assert ranges[1].names == ["build-largefine-qa-tiers-4-5-try1", "4-5-try2"]


def test_a_range_that_fails_every_try_fails_the_stage_with_the_last_message() -> None:
    with pytest.raises(FanoutError, match=r"shards \[0, 1\]: 3 flow runs .* ended Crashed: process exited -9"):
        _watch({("0-1", 1): "crash", ("0-1", 2): "crash", ("0-1", 3): "crash"}, max_attempts=3)


def test_a_cancelled_or_cancelling_run_is_never_judged_lost() -> None:
    """Cancelling or Cancelled is a stop someone asked for: never "lost" (which marks it Crashed and
    resubmits it), however long its heartbeats have been quiet; a quiet Running run is lost."""
    spec = FanoutSpec(stale_after_s=10.0, unclaimed_warn_s=300.0)
    for state in ("CANCELLED", "CANCELLING"):
        assert judge(RunView(state, state.title(), "", ""), 1000.0, spec) == "cancelled"
    assert judge(RunView("RUNNING", "Running", "", ""), 11.0, spec) == "lost"
    assert judge(RunView("RUNNING", "Running", "", ""), 9.0, spec) == "alive"
    assert judge(RunView("CRASHED", "Crashed", "", ""), 0.0, spec) == "failed"
    assert judge(RunView("SCHEDULED", "Late", "", ""), 301.0, spec) == "unclaimed"


@pytest.mark.parametrize("behaviour", ["cancelled", "cancelling"])
def test_a_cancelled_run_stops_the_stage_and_is_not_resubmitted(behaviour: str) -> None:
    written: set[int] = set()
    orch, clock = Scripted({("0-1", 1): behaviour}, written), Clock()
    ranges = split_ranges(range(4), 2)
    with pytest.raises(FanoutError, match=r"shard range 0-1: run 0-1-try1 was cancelled .* not resubmitted"):
        watch_ranges(ranges, orch, FanoutSpec(poll_s=1.0, stale_after_s=10.0),
                     lambda idx: {"indices": list(idx)}, lambda r: f"{r.label}-try{len(r.runs) + 1}",
                     lambda: set(written), clock=clock, sleep=lambda s: clock.sleep(s + 20.0))  # past stale_after_s
    assert len(ranges[0].runs) == 1 and not orch.crashed and not orch.cancelled


def test_a_parent_that_is_stopped_cancels_its_unfinished_runs_and_stops() -> None:
    """A signal in the parent (its own cancel raises ``TerminationSignal`` in its flow-run process;
    Ctrl-C raises KeyboardInterrupt) cancels the latest run of each range not done, then goes on."""
    written: set[int] = set()
    orch, clock = Scripted({("2-3", 1): "beating", ("4-5", 1): "beating"}, written), Clock()
    ranges = split_ranges(range(6), 2)

    def stopped_on_second_poll(seconds: float) -> None:
        clock.sleep(seconds)
        if clock.now > 1.5:
            raise TerminationSignal(signal=15)

    with pytest.raises(TerminationSignal):
        watch_ranges(ranges, orch, FanoutSpec(poll_s=1.0, stale_after_s=10.0),
                     lambda idx: {"indices": list(idx)}, lambda r: f"{r.label}-try{len(r.runs) + 1}",
                     lambda: set(written), clock=clock, sleep=stopped_on_second_poll)
    assert orch.cancelled == [ranges[1].runs[0], ranges[2].runs[0]]  # 0-1 completed on the first poll
    assert [r.outcomes for r in ranges] == [["completed"], ["cancelled with its parent"],
                                            ["cancelled with its parent"]]


# -- a whole fanned-out stage, in one process ---------------------------------------------------------

class Source(Stage):
    name = "source"
    version = "1"
    writes = (Write("numbers", "numbers", NUMBERS),)

    def run(self, run: StageRun) -> Work:
        return Work.one({"numbers": pa.table({"n": list(range(12))}, schema=NUMBERS)},
                        {"input_rows": 12, "accepted": 12})


class Halves(Stage):
    """Per shard, on the GPU: keeps multiples of three, rejects the rest (four shards)."""

    name = "halves"
    version = "1"
    reads = ("numbers",)
    writes = (Write("kept", "numbers", NUMBERS), Write("rejects", "rejects", REJECTS, rejects=True))
    resources = Resources(device="gpu", hold_slot=False)
    balance = True

    def shard_count(self, run: StageRun) -> int:
        return 4

    def process(self, run: StageRun, index: int) -> Work:
        mine = sorted(run.input("numbers").to_pandas().n.tolist())[index::4]
        kept, odd = [n for n in mine if n % 3 == 0], [n for n in mine if n % 3]
        return Work.one({"kept": pa.table({"n": kept}, schema=NUMBERS),
                         "rejects": pa.table({"n": odd, "reason": ["wrong_category"] * len(odd)}, schema=REJECTS)},
                        {"input_rows": len(mine), "accepted": len(kept),
                         "rejected": {"wrong_category": len(odd)} if odd else {}})


TOY = Pipeline("toy-fanout", (Source(), Halves()))


class ThreadPool:
    """Each submitted range runs ``run_shard_range`` (what the run-shards flow runs) in a thread,
    from the parameters alone; the first try of the range holding shard 2 dies before writing."""

    def __init__(self, pipeline: Pipeline | None = None) -> None:
        self.parameters: list[dict[str, Any]] = []
        self.states: dict[str, RunView] = {}
        self.lock = threading.Lock()
        self.pipeline = pipeline or TOY

    def submit(self, parameters: dict[str, Any], run_name: str) -> str:
        run_id = f"r{len(self.parameters)}"
        self.parameters.append(parameters)
        self.states[run_id] = RunView("RUNNING", "Running", "", "0")
        threading.Thread(target=self._run, args=(run_id, parameters, run_name), daemon=True).start()
        return run_id

    def _run(self, run_id: str, p: dict[str, Any], run_name: str) -> None:
        if 2 in p["indices"] and run_name.endswith("try1"):
            self.states[run_id] = RunView("CRASHED", "Crashed", "worker lost", "1")
            return
        ctx = RunContext(load_profile(p["profile"], p["overrides"]), p["flow_name"], p["output_root"],
                         locations=p["locations"], source=p["profile"], overrides=p["overrides"])
        stage = next(s for s in self.pipeline.stages if s.name == p["stage"])
        try:
            _range_flow(ctx, stage, p["stage_key"], p["indices"])
            self.states[run_id] = RunView("COMPLETED", "Completed", "", "2")
        except Exception as err:  # a failed run, as Prefect would record it
            self.states[run_id] = RunView("FAILED", "Failed", str(err), "2")

    def view(self, run_id: str) -> RunView:
        return self.states[run_id]

    def mark_crashed(self, run_id: str, message: str) -> None:
        raise AssertionError("no run goes silent here")

    def cancel(self, run_id: str, message: str) -> None:
        raise AssertionError("nothing is cancelled here")

    def live_runs(self, key: str) -> list[LiveRun]:
        return []  # a first run: nothing to adopt

    def detects_zombies(self) -> bool:
        return True


@flow(name="toy-run-shards", validate_parameters=False)
def _range_flow(ctx: RunContext, stage: Stage, key: str, indices: list[int]) -> dict:
    """What flows/run_shards.py runs, for the toy pipeline."""
    return run_shard_range(ctx, stage, key, indices)


@flow(name="toy-fanout", validate_parameters=False)
def _toy_flow(ctx: RunContext) -> list:
    return run_pipeline(ctx, TOY, None)


def test_a_fanned_out_stage_writes_every_shard_once_and_the_same_rows_as_in_one_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import tasks.framework.fanout as fanout

    pool = ThreadPool()
    monkeypatch.setattr(fanout, "PrefectOrchestrator", lambda deployment, tags=(): _Checked(pool))
    overrides = {"prefect": {"fanout": {"enabled": True, "shards_per_run": 2, "poll_s": 0.05}}}
    fanned = RunContext(load_profile("demo", overrides), "toy-fanout", str(tmp_path / "fan"), source="demo",
                        overrides=overrides)
    results = _toy_flow(fanned)
    plain = _toy_flow(RunContext(load_profile("demo"), "toy-fanout", str(tmp_path / "one")))
    got = {(r.stage, r.input_rows, r.accepted, tuple(r.rejected.items()), r.balanced) for r in results}
    assert got == {(r.stage, r.input_rows, r.accepted, tuple(r.rejected.items()), r.balanced) for r in plain}
    assert ("halves", 12, 4, (("wrong_category", 8),), True) in got
    # two ranges, the one holding shard 2 tried twice; each range's run asked for its own shards
    assert [tuple(p["indices"]) for p in pool.parameters] == [(0, 1), (2, 3), (2, 3)]
    for name in ("kept", "rejects"):
        fan = Artifact(str(tmp_path / "fan" / "toy-fanout" / "demo" / name))
        one = Artifact(str(tmp_path / "one" / "toy-fanout" / "demo" / name))
        assert fan.is_complete(verify_hashes=True)
        assert fan.manifest().fingerprint == one.manifest().fingerprint  # byte-identical shards
        assert fan.manifest().stats["balanced"] is True


class _Checked:
    def __init__(self, pool: ThreadPool) -> None:
        self.pool = pool

    def check_deployment(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self.pool, name)


def test_a_range_run_that_computes_another_key_refuses_to_write(tmp_path: Path) -> None:
    ctx = RunContext(load_profile("demo"), "toy-fanout", str(tmp_path))
    _toy_flow(ctx)
    with pytest.raises(FanoutError, match=r"computes stage key .* its parent 0000"):
        _range_flow(ctx, TOY.stages[1], "0" * 64, [0])
    key = Artifact(str(tmp_path / "toy-fanout" / "demo" / "kept")).manifest().stage_key
    with pytest.raises(FanoutError, match=r"has 4 shards; asked for \[9\]"):
        _range_flow(ctx, TOY.stages[1], key, [9])
    assert _range_flow(ctx, TOY.stages[1], key, [1, 3]) == {"computed": [], "reused": [1, 3]}


def test_run_shards_finds_every_flows_pipeline_by_name_and_refuses_unknown_ones() -> None:
    """run-shards imports a flow's module only when asked for it; each name maps to the module whose
    PIPELINE carries that name, and unknown flows, stages or whole-input stages are refused clearly."""
    from flows.run_shards import PIPELINE_MODULES, pipeline, pipeline_stage

    fixed = [name for name in PIPELINE_MODULES if name != "evaluate"]
    assert {name: pipeline(name).name for name in fixed} == {name: name for name in fixed}
    assert pipeline_stage("build-largefine", "qa-tiers").name == "qa-tiers"
    # evaluate's stages follow its profile (the models and the benchmark): a shard-range run builds
    # them from the run's context, and cannot without one
    from rde.profile import load_profile
    from tasks.framework.context import RunContext

    profile = load_profile("demo", {"evaluation": {"benchmark": "data/check_set/queries.yaml",
                                                   "models": ["expert:attributes-v1"]}})
    built = pipeline("evaluate", RunContext(profile, "evaluate"))
    assert built.name == "evaluate" and [s.name.split("-")[0] for s in built.stages] == ["embed", "score", "compare"]
    assert pipeline_stage("evaluate", built.stages[0].name, RunContext(profile, "evaluate")).per_shard
    with pytest.raises(ValueError, match="follow its profile"):
        pipeline("evaluate")
    with pytest.raises(ValueError, match="no pipeline 'build-nothing'"):
        pipeline("build-nothing")
    with pytest.raises(ValueError, match="has no stage 'nope'"):
        pipeline_stage("build-secmm", "nope")
    with pytest.raises(ValueError, match="works over its whole input"):
        pipeline_stage("build-secmm", "cgds")


class CpuHalves(Halves):
    """Halves on the CPU."""

    name = "cpu-halves"
    resources = Resources()


class OneProcess(CpuHalves):
    """A CPU stage that says no to the fan-out (as hard-negatives does over an IVF index)."""

    name = "one-process"

    def fans_out(self, run: StageRun) -> bool:
        return False


TOY_CPU = Pipeline("toy-fanout", (Source(), CpuHalves()))


def test_cpu_stages_fan_out_to_the_cpu_deployment_only_where_one_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the fan-out on, a GPU stage goes to ``deployment``; a CPU stage stays in the parent
    unless ``cpu_deployment`` names one, then runs there (ranges as for the GPU stages, the same
    rows as in one run); a stage whose ``fans_out`` says no stays in the parent."""
    import tasks.framework.fanout as fanout

    def ctx(fan: dict, where: str) -> RunContext:
        overrides = {"prefect": {"fanout": {"enabled": True, "shards_per_run": 2, "poll_s": 0.05, **fan}}}
        return RunContext(load_profile("demo", overrides), "toy-fanout", str(tmp_path / where), source="demo",
                          overrides=overrides)

    gpu_only, both = ctx({}, "gpu-only"), ctx({"cpu_deployment": "run-shards/cpu"}, "both")
    assert fans_out(Halves(), gpu_only) and not fans_out(CpuHalves(), gpu_only)
    assert fans_out(Halves(), both) and fans_out(CpuHalves(), both)
    assert not fans_out(OneProcess(), both, StageRun(OneProcess(), both))
    assert not fans_out(CpuHalves(), ctx({"cpu_deployment": "run-shards/cpu", "stages": ["halves"]}, "listed"))
    pool, deployments = ThreadPool(TOY_CPU), []

    def orchestrator(deployment: str, tags: Any = ()) -> _Checked:
        deployments.append(deployment)
        return _Checked(pool)

    monkeypatch.setattr(fanout, "PrefectOrchestrator", orchestrator)

    @flow(name="toy-cpu-fanout", validate_parameters=False)
    def toy(run_ctx: RunContext) -> list:
        return run_pipeline(run_ctx, TOY_CPU, None)

    results = toy(both)
    assert deployments == ["run-shards/cpu"]
    assert [tuple(p["indices"]) for p in pool.parameters] == [(0, 1), (2, 3), (2, 3)]
    plain = toy(RunContext(load_profile("demo"), "toy-fanout", str(tmp_path / "one")))
    assert [(r.stage, r.accepted, r.rejected) for r in results] == [(r.stage, r.accepted, r.rejected) for r in plain]
    fan = Artifact(str(tmp_path / "both" / "toy-fanout" / "demo" / "kept"))
    assert fan.manifest().fingerprint == Artifact(str(tmp_path / "one" / "toy-fanout" / "demo" / "kept")
                                                  ).manifest().fingerprint
