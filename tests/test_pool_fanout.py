"""Fan-out over a pool for real: `rde stack up --gpu-workers 3 --workers 2` on loopback (with its
zombie-detection and resume-on-crash automations), build-largefine/pool (the parent on a cpu
worker) with its qa-tiers shards as run-shards flow runs on the three gpu workers, one gpu worker
lost mid-stage; another such run cancelled mid-stage; then a third whose parent's own worker is
lost mid-stage and which the server resumes. A module of its own (its own stack) so pytest-xdist
runs it beside the other stack modules."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx
import pytest
from evaluation_helpers import FACTORY
from stack_checks import CHROMIUM_FLAGS, api, engine_pids, headless_chromium, kill_with_its_worker

from entry.stack import StackConfig, down, ensure_automations, free_port, up
from tasks.framework.prefect_automations import RESUME_NAME, ZOMBIE_NAME, detects_zombies

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent


# the zombie automation's window here (the demo profile's is 90 s): longer than the 30 s between
# heartbeats, with room for a heartbeat late by a busy machine
STALE_S = 50.0
# the tests' waits poll the stack's REST API (a flow-run filter the server answers, and a scan of
# /proc) once a second, twice a second where seconds after a cancel are measured: every poll is CPU
# the server and the flow runs under test share
POLL_S = 1.0
TIMING_POLL_S = 0.5


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory):
    """Three workers in the `gpu` pool, one flow run each at a time; the `gpu` limit is 3; two
    workers in the `cpu` pool (one is left when the other is lost); the server's automations."""
    cfg = StackConfig(port=free_port(), folder=tmp_path_factory.mktemp("pool-stack"), gpu_workers=3,
                      workers_per_pool=2, stale_after_s=STALE_S)
    up(cfg)
    try:
        yield cfg
    finally:
        down(cfg)


def test_the_gpu_pool_has_three_workers_and_three_slots(stack: StackConfig) -> None:
    limits = {g["name"]: g["limit"] for g in api(stack, "/v2/concurrency_limits/filter", {})}
    assert limits.get("gpu") == 3
    deadline = time.monotonic() + 120  # each worker registers once its process has started
    while (len(api(stack, "/work_pools/gpu/workers/filter", {})) < 3
           or len(api(stack, "/work_pools/cpu/workers/filter", {})) < 2) and time.monotonic() < deadline:
        time.sleep(1)
    assert len({w["name"] for w in api(stack, "/work_pools/gpu/workers/filter", {})}) == 3
    names = {(d["name"], d["work_pool_name"]) for d in api(stack, "/deployments/filter", {})}
    # run-shards/gpu, run-shards/cpu, build-largefine/pool
    assert {("gpu", "gpu"), ("cpu", "cpu"), ("pool", "cpu")} <= names
    # rde doctor on a profile that fans out on both pools: each pool's deployment and workers found
    from entry.doctor import pool_checks
    from rde.profile import load_profile

    both = load_profile("demo", {"prefect": {"fanout": {"enabled": True, "cpu_deployment": "run-shards/cpu"}}})
    assert [(c.area, c.status, c.fact.rsplit(": ", 1)[-1]) for c in pool_checks(stack.api_url, both)] == [
        ("gpu pool", "ok", "3 worker(s) online"), ("cpu pool", "ok", "2 worker(s) online")]
    automations = {a["name"]: a for a in api(stack, "/automations/filter", {})}
    assert detects_zombies(automations.values()) and RESUME_NAME in automations
    assert automations[ZOMBIE_NAME]["trigger"]["within"] == STALE_S
    assert ensure_automations(stack) == {ZOMBIE_NAME: "unchanged", RESUME_NAME: "unchanged"}  # idempotent


def test_evaluate_deployment_fans_its_gallery_out_over_the_gpu_pool(stack: StackConfig, tmp_path: Path) -> None:
    """``prefect deployment run 'evaluate/default'`` with the command's options as parameters: a user's
    factory on the check set, its gallery's two shards embedded by shard-range runs on the other
    gpu workers (``prefect.fanout``); its comparison and report are published."""
    factory = tmp_path / "colour_words.py"
    factory.write_text(FACTORY)
    params = {"benchmark": str(ROOT / "data" / "check_set" / "queries.yaml"), "models": [f"python:{factory}:make"],
              "output_root": str(tmp_path / "out"), "report": str(tmp_path / "report.md"),
              "overrides": {"evaluation": {"bootstrap_resamples": 200, "embed_group_items": 256},
                            "prefect": {"fanout": {"enabled": True, "shards_per_run": 1}}}}
    run = subprocess.run([sys.executable, "-m", "prefect", "deployment", "run", "evaluate/default", "--params",
                          json.dumps(params), "--watch", "--watch-timeout", "600"], env=stack.env(),
                         capture_output=True, text=True, timeout=660)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    runs = api(stack, "/flow_runs/filter", {"sort": "START_TIME_DESC", "limit": 10})
    flow_run = next(r for r in runs if r["parameters"].get("report") == params["report"])
    assert flow_run["state_type"] == "COMPLETED"
    ranges = [r for r in runs if r["parameters"].get("flow_name") == "evaluate"]
    assert len(ranges) == 2 and {r["state_type"] for r in ranges} == {"COMPLETED"}  # one per gallery shard
    report = (tmp_path / "report.md").read_text()
    assert report.startswith("# check-set:") and f"python:{factory}:make" in report
    artifacts = api(stack, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run["id"]]}}})
    keys = {a["key"] for a in artifacts if a.get("key")}
    assert any(k.startswith("evaluate-check-set") and k.endswith("-comparison") for k in keys), keys
    assert any(k.startswith("evaluate-check-set") and k.endswith("-chart") for k in keys), keys


@pytest.fixture(scope="session")
def chromium() -> str:
    """The browser for the UI check; session-scoped, so without one the UI test is skipped (or fails
    under CI) before the stack or the fan-out run is started for it."""
    return headless_chromium()


@pytest.fixture(scope="module")
def fanout_run(stack: StackConfig, tmp_path_factory: pytest.TempPathFactory, small_pool_url: str) -> dict:
    """build-largefine/pool (the parent on the cpu worker) on the 96-image slice, its qa-tiers
    shards fanned out as run-shards flow runs over the three gpu workers, one run each at a time
    (stub generator, 1 s per request). One worker and its flow-run process are SIGKILLed
    mid-stage; returns once the parent has ended: its id, final state, the killed run, the build's
    output folder and when the kill happened."""
    from pool_checks import fanout_params, shard_runs, stub_server, submit, wait_final

    out = tmp_path_factory.mktemp("fanout") / "out"
    root = out / "build-largefine" / "demo"
    images, shard_size = 24, 4
    with stub_server(delay_s=1.0) as stub:
        params = fanout_params(out, small_pool_url, stub.base_url, images=images, shard_size=shard_size, per_run=3,
                               stale_after_s=STALE_S)
        params.pop("until")  # the whole build: the 3-tier accounting needs the advanced tier and the export
        # the hard negatives' search on the cpu pool's workers (run-shards/cpu), beside the tiers on the gpu pool's
        params["overrides"]["prefect"]["fanout"].update(cpu_deployment="run-shards/cpu",
                                                        stages=["hard-negatives", "qa-tiers"])
        parent = submit(stack, params)
        victim, pids, deadline = None, [], time.monotonic() + 400
        while time.monotonic() < deadline and not pids:
            running = [r for r in shard_runs(stack, parent) if r["state_type"] == "RUNNING"]
            if running and list((root / "tier12_captions").glob("part-*.parquet")):
                victim = running[-1]
                pids = engine_pids(victim["id"])
            time.sleep(POLL_S)
        assert victim and pids, "no shard-range run was seen running mid-stage"
        kill_with_its_worker(pids[0])
        killed_at = time.monotonic()
        final = wait_final(stack, parent, 600)
    return {"parent": parent, "final": final, "victim": victim, "root": root, "images": images,
            "shard_size": shard_size, "killed_at": killed_at}


def test_fanned_out_captioning_survives_a_lost_worker(stack: StackConfig, fanout_run: dict,
                                                      test_artifacts_dir: Path) -> None:
    """After the lost worker (``fanout_run``) the server's zombie automation marks the silent run
    Crashed, the parent resubmits its missing shards to the two workers left, and the build
    completes: every captioned image's three tiers are a caption or a rejected text, no shard is
    written twice (the shard-write events), and every manifest matches its files by hash."""
    from pool_checks import flow_run, shard_runs, shard_write_events

    from storage import Artifact

    parent, final, victim, root = fanout_run["parent"], fanout_run["final"], fanout_run["victim"], fanout_run["root"]
    images, shard_size = fanout_run["images"], fanout_run["shard_size"]
    assert final["state_type"] == "COMPLETED", final["state"]
    runs = shard_runs(stack, parent)
    lost = flow_run(stack, victim["id"])
    assert lost["state_type"] == "CRASHED" and "by the server's zombie automation" in lost["state"]["message"]
    prefix = victim["name"].rsplit("-try", 1)[0]
    again = [r for r in runs if r["name"].startswith(prefix) and r["id"] != victim["id"]]
    assert again and again[-1]["state_type"] == "COMPLETED"
    # the gpu pool's workers ran the shard-range runs; their shard tasks carry the `gpu` tag and, in
    # the runs that completed, all completed (that the slot serialises computation: test_gpu_limit.py)
    assert {r["work_pool_name"] for r in runs if "-qa-tiers-" in r["name"]} == {"gpu"}
    # the hard negatives' search ran on the cpu pool's workers, and found what one search over every
    # chosen image's vector finds (computed here from the artifacts, not by the stage's code)
    searches = [r for r in runs if "-hard-negatives-" in r["name"]]
    assert searches and {(r["work_pool_name"], r["state_type"]) for r in searches} == {("cpu", "COMPLETED")}
    assert _neighbours(root) == _searched_in_one(root)
    done = [r["id"] for r in runs if r["state_type"] == "COMPLETED"]
    tasks = api(stack, "/task_runs/filter", {"flow_runs": {"id": {"any_": done}}})
    tiers = [t for t in tasks if t["name"].startswith("qa-tiers-")]
    assert tiers and all("gpu" in t["tags"] and t["state_type"] == "COMPLETED" for t in tiers)
    # accounting: captions + rejected texts = 3 x captioned images
    captions = Artifact(str(root / "largefine")).count_rows()
    rejected = Artifact(str(root / "caption_rejects")).count_rows()
    assert captions + rejected == 3 * images and captions > 0
    # no shard written twice: the write events of this build's shard-range runs, at most one per shard
    children = {f"prefect.flow-run.{r['id']}" for r in runs}
    writers = {i: [w for w in ws if w in children] for i, ws in shard_write_events(stack, "qa-tiers").items()}
    n_shards = len(Artifact(str(root / "tier12_captions")).manifest().shards)
    assert n_shards == images // shard_size
    assert all(len(w) <= 1 for w in writers.values()), writers
    assert sum(len(w) for w in writers.values()) >= n_shards - 1  # a kill between write and event: one less
    for folder in ("tier12_captions", "qa_pairs", "tier12_rejects", "largefine", "caption_rejects"):
        assert Artifact(str(root / folder)).is_complete(verify_hashes=True), folder
    (test_artifacts_dir / "fanout-worker-loss.json").write_text(json.dumps(
        {"parent": parent, "lost_run": victim["name"], "lost_run_message": lost["state"]["message"],
         "replaced_by": [r["name"] for r in again],
         "seconds_from_kill_to_completion": round(time.monotonic() - fanout_run["killed_at"], 1),
         "runs": [{"name": r["name"], "state": r["state_type"]} for r in shard_runs(stack, parent)],
         "captions": captions, "rejected_texts": rejected, "shard_writes": writers}, indent=1))


def test_the_fanned_out_parent_run_lists_its_shard_runs_in_the_ui(chromium: str, stack: StackConfig,
                                                                   fanout_run: dict, test_artifacts_dir: Path) -> None:
    """The parent run's page in the UI, on its subflow-runs tab: the child runs are listed there."""
    from pool_checks import shard_runs

    children = [r["name"] for r in shard_runs(stack, fanout_run["parent"])]
    assert children, "the parent run has no shard-range runs"
    url = f"http://{stack.host}:{stack.port}/runs/flow-run/{fanout_run['parent']}?tab=Subflow%20Runs"
    shot = test_artifacts_dir / "prefect-ui-fanout-parent-run.png"
    shot.unlink(missing_ok=True)
    subprocess.run([chromium, *CHROMIUM_FLAGS, f"--screenshot={shot}", url], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 20_000, f"the UI page {url} did not render"
    dom = subprocess.run([chromium, *CHROMIUM_FLAGS, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120).stdout
    assert any(name in dom for name in children), "the parent run's page does not list its shard-range runs"


def _running(pid: int) -> bool:
    """Whether ``pid`` still runs code (a zombie its worker has not reaped yet does not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_cancelling_a_fanned_out_run_cancels_it_and_its_shard_runs(stack: StackConfig, small_pool_url: str,
                                                                    tmp_path: Path, test_artifacts_dir: Path) -> None:
    """``prefect flow-run cancel`` (the state the UI's Cancel sets) on build-largefine/pool while its
    shard-range runs caption: the parent's flow-run process on the cpu worker stops within
    seconds and the run ends Cancelled, not Crashed; the shard-range runs that were running end
    Cancelled (the parent cancels them as it stops), their processes stop, and none is
    resubmitted. The seconds from the cancel (its state set) to each are printed and kept in
    test-artifacts/fanout-cancel.json. The same deployment run again then completes the build,
    reusing every shard written before the cancel and writing each missing one once (the
    shard-write events)."""
    from pool_checks import fanout_params, flow_run, shard_runs, shard_write_events, stub_server, submit, wait_final

    from storage import Artifact

    out = tmp_path / "out"
    with stub_server(delay_s=3.0) as stub:  # slow captions: the shard-range runs are mid-shard at the cancel
        params = fanout_params(out, small_pool_url, stub.base_url, images=24, shard_size=4, per_run=2,
                               stale_after_s=STALE_S)
        parent = submit(stack, params)
        running, deadline = [], time.monotonic() + 400
        while time.monotonic() < deadline and len(running) < 2:
            running = [r for r in shard_runs(stack, parent) if r["state_type"] == "RUNNING" and engine_pids(r["id"])]
            time.sleep(POLL_S)
        assert len(running) >= 2, "no two shard-range runs were seen running"
        pids = {"parent": engine_pids(parent), "children": [p for r in running for p in engine_pids(r["id"])]}
        assert pids["parent"], "no flow-run process of the parent was found"
        cli_started = time.monotonic()
        subprocess.run([sys.executable, "-m", "prefect", "flow-run", "cancel", parent], env=stack.env(), check=True,
                       capture_output=True, timeout=120)
        cancelled_at = time.monotonic()
        seconds: dict[str, float] = {"cancel_cli": round(cancelled_at - cli_started, 1)}
        final, children = flow_run(stack, parent), shard_runs(stack, parent)
        while time.monotonic() < cancelled_at + 300 and len(seconds) < 5:
            elapsed = round(time.monotonic() - cancelled_at, 1)
            for who, group in pids.items():
                if f"{who}_processes_gone" not in seconds and not [p for p in group if _running(p)]:
                    seconds[f"{who}_processes_gone"] = elapsed
            if "parent_final_state" not in seconds and (final := flow_run(stack, parent))["state_type"] in TERMINAL:
                seconds["parent_final_state"] = elapsed
            children = shard_runs(stack, parent)
            if "children_final_states" not in seconds and all(r["state_type"] in TERMINAL for r in children):
                seconds["children_final_states"] = elapsed
            time.sleep(TIMING_POLL_S)
        # the same deployment run again (same parameters, captions now without delay) finishes the build
        captions = out / "build-largefine" / "demo" / "tier12_captions"
        written = sorted(p.name for p in captions.glob("part-*.parquet"))
        stub.script.delay_s = 0.0
        rerun = submit(stack, params)
        rerun_final = wait_final(stack, rerun, 400)
    measured = {"parent": parent, "parent_state": final["state_type"], "parent_message": final["state"]["message"],
                "seconds_after_cancel": seconds,
                "children": [{"name": r["name"], "state": r["state_type"], "message": r["state"]["message"],
                              "running_at_cancel": r["id"] in {x["id"] for x in running}} for r in children]}
    (test_artifacts_dir / "fanout-cancel.json").write_text(json.dumps(measured, indent=1))
    print(json.dumps(measured, indent=1))
    assert final["state_type"] == "CANCELLED", measured
    assert seconds.get("parent_processes_gone", 1e9) < PROCESS_BOUND_S, measured
    assert seconds.get("children_processes_gone", 1e9) < PROCESS_BOUND_S + 15, measured
    assert seconds.get("parent_final_state", 1e9) < STATE_BOUND_S, measured
    assert seconds.get("children_final_states", 1e9) < STATE_BOUND_S + 15, measured
    assert all(c["state"] == "CANCELLED" for c in measured["children"] if c["running_at_cancel"]), measured
    assert all(r["state_type"] in ("CANCELLED", "COMPLETED") for r in children), measured
    assert not [r["name"] for r in children if not r["name"].endswith("-try1")], "a cancelled run was resubmitted"
    # the rerun reuses every shard written before the cancel and writes each missing one once
    assert rerun_final["state_type"] == "COMPLETED", rerun_final["state"]
    runs = {f"prefect.flow-run.{r['id']}": who for who, top in (("cancelled", parent), ("rerun", rerun))
            for r in shard_runs(stack, top)}
    before = {int(name.removeprefix("part-").removesuffix(".parquet")) for name in written}
    deadline = time.monotonic() + 30  # the server persists events in batches: the rerun's last may lag
    while True:
        events = shard_write_events(stack, "qa-tiers").items()
        writers = {i: w for i, w in sorted((int(i), [runs[w] for w in ws if w in runs]) for i, ws in events) if w}
        if set(writers) | before >= set(range(6)) or time.monotonic() > deadline:
            break
        time.sleep(1)
    print(f"rerun after the cancel: shards written before it {written}; writers by shard {writers}")
    assert all(len(w) == 1 for w in writers.values()), writers  # no shard written twice
    assert all(writers.get(i, ["cancelled"]) == ["cancelled"] for i in before), (written, writers)
    assert {i for i, w in writers.items() if w == ["rerun"]} == set(range(6)) - before  # 24 images, shards of 4
    root = out / "build-largefine" / "demo"
    for folder in ("tier12_captions", "qa_pairs", "tier12_rejects"):
        assert Artifact(str(root / folder)).is_complete(verify_hashes=True), folder


TERMINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
# The cancel reaches the worker as an event (websocket), which sends the flow-run process SIGTERM:
# it stops within seconds. Prefect's worker then runs the flow's on_cancellation hooks in a fresh
# interpreter that loads the flow (8 s on two busy cores) before it records Cancelled.
PROCESS_BOUND_S = 15.0
STATE_BOUND_S = 45.0


def test_a_build_whose_parent_worker_dies_is_crashed_resumed_and_adopts_its_shard_runs(
        stack: StackConfig, fanout_run: dict, small_pool_url: str, tmp_path: Path, test_artifacts_dir: Path) -> None:
    """SIGKILL of the parent's cpu worker and its flow-run process while its qa-tiers shard-range
    runs caption: the server's zombie automation marks the parent Crashed within the window after
    its last heartbeat, the resume automation schedules the same flow run again, the other cpu
    worker runs it, and it adopts the shard-range runs still going instead of submitting their
    shards again: the build completes with each shard written once (the shard-write events),
    every image captioned once per tier, and every manifest matching its files by hash."""
    from pool_checks import fanout_params, flow_run, shard_runs, shard_write_events, stub_server, submit

    from storage import Artifact

    out = tmp_path / "out"
    root = out / "build-largefine" / "demo"
    images, shards = 24, 6
    with stub_server(delay_s=2.0) as stub:
        params = fanout_params(out, small_pool_url, stub.base_url, images=images, shard_size=4, per_run=3,
                               stale_after_s=STALE_S)
        parent = submit(stack, params)
        running, deadline = [], time.monotonic() + 400
        while time.monotonic() < deadline and (len(running) < 2 or not list((root / "tier12_captions").glob("part-*"))):
            running = [r for r in shard_runs(stack, parent) if r["state_type"] == "RUNNING" and engine_pids(r["id"])]
            time.sleep(POLL_S)
        assert len(running) >= 2, "no two shard-range runs were seen running with a shard written"
        pids = engine_pids(parent)
        assert pids, "no flow-run process of the parent was found"
        kill_with_its_worker(pids[0])
        killed_at, killed_wall, crashed_since, adopted = time.monotonic(), time.time(), None, []
        stub.script.delay_s = 20.0  # the ranges outlive the parent's detection and restart (<= 60 s) ...
        while time.monotonic() < killed_at + 500:  # Crashed lasts a moment: the resume automation follows
            final = flow_run(stack, parent)
            if final["state_type"] in ("COMPLETED", "FAILED", "CANCELLED"):
                break
            if final["run_count"] == 2 and not adopted:
                logs = api(stack, "/logs/filter", {"logs": {"flow_run_id": {"any_": [parent]}}, "limit": 200})
                adopted = [line["message"] for line in logs if "adopted" in line["message"]]
                if adopted:
                    stub.script.delay_s = 0.5  # ... and once adopted, finish quickly
            crashed_since = (crashed_since or time.monotonic()) if final["state_type"] == "CRASHED" else None
            if crashed_since and time.monotonic() - crashed_since > 60:
                break  # not resumed
            time.sleep(POLL_S)
        completed_after = time.monotonic() - killed_at
    states = httpx.get(f"{stack.api_url}/flow_run_states/", params={"flow_run_id": parent}, timeout=30).json()
    crashed_at = [datetime.fromisoformat(s["timestamp"]).timestamp() for s in states if s["name"] == "Crashed"]
    children = shard_runs(stack, parent)
    measured = {"parent": parent, "final": final["state_type"], "run_count": final["run_count"],
                "states": [(s["name"], (s["message"] or "")[:120]) for s in states],
                "seconds_from_kill_to_crashed": round(crashed_at[0] - killed_wall, 1) if crashed_at else None,
                "seconds_from_kill_to_completion": round(completed_after, 1), "adoption_log": adopted,
                "children": [{"name": r["name"], "state": r["state_type"],
                              "running_at_kill": r["id"] in {x["id"] for x in running}} for r in children]}
    (test_artifacts_dir / "fanout-parent-loss.json").write_text(json.dumps(measured, indent=1))
    print(json.dumps(measured, indent=1))
    assert final["state_type"] == "COMPLETED", measured
    assert final["run_count"] == 2, measured  # started once, crashed, resumed once
    crashed = [m for name, m in measured["states"] if name == "Crashed"]
    assert crashed and "by the server's zombie automation" in crashed[0], measured
    assert "AwaitingRetry" in [name for name, _ in measured["states"]], measured
    # marked within the window after its last heartbeat (which came before the kill), give or take
    # the server's 5 s evaluation period
    assert crashed_at and crashed_at[0] - killed_wall <= STALE_S + 10, measured
    # the live runs were adopted: none of their ranges was submitted again, no range ran twice
    names = [c["name"] for c in measured["children"]]
    assert len(names) == len(set(names)) and not [n for n in names if not n.endswith("-try1")], measured
    assert all(c["state"] == "COMPLETED" for c in measured["children"]), measured
    # the ranges still going were adopted (both, unless one finished its last shard meanwhile)
    assert adopted and re.search(r"\b[12] of them adopted", adopted[-1]), adopted
    ids = {f"prefect.flow-run.{r['id']}" for r in children}
    deadline = time.monotonic() + 30  # the server persists events in batches
    while True:
        writers = {i: [w for w in ws if w in ids] for i, ws in shard_write_events(stack, "qa-tiers").items()}
        writers = {i: w for i, w in writers.items() if w}
        if len(writers) >= shards or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert sorted(int(i) for i in writers) == list(range(shards)) and all(len(w) == 1 for w in writers.values()), \
        writers
    # the same texts and rejects as the same build's run that lost only a shard-range run (the stub
    # answers alike): nothing lost, nothing twice
    for folder, columns in (("tier12_captions", ["image_id", "tier", "text"]),
                            ("tier12_rejects", ["input_id", "reason"])):
        mine = sorted(tuple(r.values()) for r in Artifact(str(root / folder)).rows(columns))
        other = sorted(tuple(r.values()) for r in Artifact(str(fanout_run["root"] / folder)).rows(columns))
        assert mine == other and len(set(mine)) == len(mine), folder
    assert len({r["image_id"] for r in Artifact(str(root / "tier12_captions")).rows(["image_id"])}) == images
    for folder in ("tier12_captions", "qa_pairs", "tier12_rejects"):
        assert Artifact(str(root / folder)).is_complete(verify_hashes=True), folder


def _neighbours(root: Path) -> list[tuple]:
    """The build's neighbours rows: image, neighbours, hard negative."""
    from storage import Artifact

    return [(r["image_id"], r["neighbour_ids"], r["hard_negative_id"])
            for r in Artifact(str(root / "neighbours")).rows(["image_id", "neighbour_ids", "hard_negative_id"])]


def _searched_in_one(root: Path) -> list[tuple]:
    """The chosen images' neighbours from one in-memory search over all their vectors."""
    import numpy as np

    from rde.largefine.hard_negatives import hard_negative_neighbours
    from rde.profile import load_profile
    from storage import Artifact

    chosen = Artifact(str(root / "chosen_images")).rows(["image_id", "accepted_shard", "vector_row"])
    vectors = Artifact(str(root / "image_vectors"))
    by_shard = {s: vectors.read_shard(s, ["vector"]).column("vector").to_pylist()
                for s in {r["accepted_shard"] for r in chosen}}
    x = np.array([by_shard[r["accepted_shard"]][r["vector_row"]] for r in chosen], np.float32)
    lf = load_profile("demo").largefine
    found = hard_negative_neighbours(x, [r["image_id"] for r in chosen], lf.neighbours_k, lf.seed,
                                     lf.neighbour_index_above, ann=lf.neighbour_ann)
    return [(f.image_id, f.neighbour_ids, f.hard_negative_id) for f in found]
