"""Stopping a run: Ctrl-C (SIGINT to the process group), SIGTERM to the process, SIGKILL.

Each end-to-end test runs ``rde build-secmm --until denoise`` against its own temporary Prefect
server (the server a user's run starts, the process that used to outlive it), stops it while the
measure stage writes shards, and checks the time to exit, that no process it started is alive and
the server's port is free, what the stopped run leaves (the stop line, ``rde artifacts``, the run
lock), and that a rerun reuses the written shards and writes no row twice.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest
from test_faults import assert_artifacts_intact
from typer.testing import CliRunner

from entry.cli import app
from rde.common.reaper import GRACE_S, TOKEN_VAR
from rde.common.run_lock import output_lock
from storage import Artifact

ROOT = Path(__file__).resolve().parent.parent
RDE = str(ROOT / ".venv" / "bin" / "rde") if (ROOT / ".venv" / "bin" / "rde").exists() else "rde"
EXIT_BOUND_S = 20.0  # the target is a few seconds; generous for a loaded test machine
GONE_BOUND_S = 10.0  # after the run exits: its watcher sweeps (SIGTERM, GRACE_S = 3 s, SIGKILL) and exits; 7 s margin


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One state folder for the module's runs: their temporary servers migrate one database once."""
    return tmp_path_factory.mktemp("signals-state")


def _command(out: Path, pool: str) -> list[str]:
    return [RDE, "build-secmm", "--until", "denoise", "--output", str(out), "--json", "--input", pool,
            "--set", "ingest.shard_size=8"]


def _started(cmd: list[str], state: Path, log: Path) -> subprocess.Popen[str]:
    """The run as a user's shell starts it: its own process group, its own temporary server. Its
    stderr goes to ``log``, not a pipe: a pipe would stay open while an orphan holds it."""
    env = {**os.environ, "RDE_STATE_DIR": str(state)}
    for key in ("PREFECT_API_URL", "PREFECT_HOME", "PREFECT_LOCAL_STORAGE_PATH"):  # all under ``state``
        env.pop(key, None)
    with log.open("w") as err:
        return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, text=True,
                                start_new_session=True)


def _wait_for_shards(proc: subprocess.Popen[str], folder: Path, count: int, log: Path) -> None:
    deadline = time.monotonic() + 400
    while len(list(folder.glob("part-*.parquet"))) < count:
        assert proc.poll() is None, f"the run ended before it wrote {count} shards: {log.read_text()[-2000:]}"
        assert time.monotonic() < deadline, "no measurement shards after 400 s"
        time.sleep(0.1)


def _server(children: list[psutil.Process]) -> tuple[psutil.Process, int]:
    """The run's temporary server and its port."""
    for child in children:
        cmdline = child.cmdline()
        if "uvicorn" in cmdline and "--port" in cmdline:
            return child, int(cmdline[cmdline.index("--port") + 1])
    raise AssertionError(f"no temporary server among the run's processes: {[c.cmdline()[:4] for c in children]}")


def _alive(procs: list[psutil.Process]) -> list[str]:
    """The command lines of those of ``procs`` still running. A process in its exit (its memory
    released, so its command line already empty, not yet a zombie) does not count: it has stopped."""
    found = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE and (cmdline := proc.cmdline()):
                found.append(" ".join(cmdline[:4]))
        except psutil.Error:
            continue
    return found


def _is_watcher(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a run's watcher (``python -m rde.common.reaper``), which outlives the run."""
    try:
        return "rde.common.reaper" in proc.cmdline()
    except psutil.Error:
        return False


def _port_free(port: int) -> bool:
    """Whether a new server could listen on ``port`` (as servers do, past the closed connections'
    TIME_WAIT: only a live listener makes the bind fail)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _stop_mid_measure(how: str, out: Path, pool: str, state: Path) -> tuple[subprocess.Popen[str], float, str]:
    """Start the run, stop it ``how`` once two measurement shards exist; check the exit time and that
    nothing it started is alive; returns the process, the seconds to exit and its stderr."""
    log = out.parent / f"{how}.stderr"
    proc = _started(_command(out, pool), state, log)
    try:
        return _stop_and_check(proc, how, out, log, state)
    except BaseException:  # a failed check: nothing of the run (its group) may outlive the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
        raise


def _stop_and_check(proc: subprocess.Popen[str], how: str, out: Path, log: Path,
                    state: Path) -> tuple[subprocess.Popen[str], float, str]:
    _wait_for_shards(proc, out / "build-secmm" / "demo" / "measurements", 2, log)
    children = psutil.Process(proc.pid).children(recursive=True)
    server, port = _server(children)
    # out of the run's process group (which a terminal's Ctrl-C reaches), its output in a log file
    assert os.getpgid(server.pid) != os.getpgid(proc.pid), "the temporary server is in the run's process group"
    server_log = (state / "prefect" / "temporary-server.log").read_text()
    assert f"pid {proc.pid}: port {port}" in server_log, server_log[-2000:]
    sent = time.monotonic()
    if how == "ctrl-c":
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends to the foreground process group
    elif how == "sigterm":
        proc.send_signal(signal.SIGTERM)  # what Slurm, Kubernetes, systemd and `timeout` send
    else:
        proc.send_signal(signal.SIGKILL)
    try:
        proc.wait(timeout=EXIT_BOUND_S)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{how}: still running {EXIT_BOUND_S:.0f} s after the signal") from None
    seconds = time.monotonic() - sent
    print(f"{how}: exited {proc.returncode} {seconds:.2f} s after the signal")
    if how != "sigkill":  # a handled signal stops the run's processes, all but its watcher, and waits
        # until each is gone (reaper.stop_processes) before the run exits: nothing to wait for here
        started = [p for p in children if not _is_watcher(p)]
        assert not _alive(started), f"{how}: alive when the run exited: {_alive(started)}"
        assert _port_free(port), f"{how}: the temporary server's port {port} is taken when the run exited"
    # the watcher sweeps once the run is gone (after a SIGKILL it stops the rest: SIGTERM, SIGKILL
    # after GRACE_S), then exits
    deadline = time.monotonic() + GONE_BOUND_S
    while (_alive(children) or not _port_free(port)) and time.monotonic() < deadline:
        time.sleep(0.1)
    print(f"{how}: its processes gone and the port free {time.monotonic() - sent:.2f} s after the signal")
    assert not _alive(children), f"{how}: still alive: {_alive(children)}"
    assert _port_free(port), f"{how}: the temporary server's port {port} is still taken"
    return proc, seconds, log.read_text()


def _check_stopped_state(out: Path) -> None:
    """A stopped run is a state: the measurements are listed as cut with their shards, the earlier
    stages as complete, and the run lock is free at once."""
    from entry import cli

    width = cli.console.width  # fixed when the module was imported (80 without a terminal): wide enough
    cli.console.width = 200  # for one table line per artifact whatever the test's paths
    try:
        result = CliRunner().invoke(app, ["artifacts", str(out)])
    finally:
        cli.console.width = width
    assert result.exit_code == 0, result.output
    lines = {line.split()[1]: line for line in result.output.splitlines() if "build-secmm/demo/" in line}
    assert "yes" in lines.get("build-secmm/demo/images", ""), result.output
    assert "cut" in lines.get("build-secmm/demo/measurements", ""), result.output
    with output_lock(str(out), "build-secmm"):
        pass  # free: a RunLockedError otherwise


def _rerun_reuses(out: Path, pool: str, env: dict[str, str], state: Path) -> None:
    """The same command finishes the run: the cut stage's written shards reused, no row twice."""
    written = len(list((out / "build-secmm" / "demo" / "measurements").glob("part-*.parquet")))
    again = subprocess.run(_command(out, pool), env={**env, "RDE_STATE_DIR": str(state)}, cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    summary = json.loads(again.stdout[again.stdout.index("{"):])
    stages = {s["stage"]: s for s in summary["stages"]}
    assert stages["ingest"]["skipped"]
    assert stages["measure"]["shards_reused"] >= max(written - 1, 1)
    assert summary["balanced"] and summary["inputs"] == 96
    demo = out / "build-secmm" / "demo"
    assert_artifacts_intact(demo)
    for name in ("images", "measurements", "accepted", "denoise_rejects"):
        ids = Artifact(str(demo / name)).to_pandas()["input_id"]
        assert ids.is_unique, f"{name} holds a row twice after the resumed run"
    assert len(Artifact(str(demo / "measurements")).to_pandas()) == 96


def _last_flow_run_state(state: Path) -> tuple[str, str]:
    """The state type and message of the latest flow run in the state folder's Prefect database
    (the temporary server's, read after it stopped)."""
    with contextlib.closing(sqlite3.connect(state / "prefect" / "prefect.db")) as db:
        row = db.execute("SELECT flow_run.state_type, flow_run_state.message FROM flow_run JOIN flow_run_state "
                         "ON flow_run.state_id = flow_run_state.id ORDER BY flow_run.created DESC LIMIT 1").fetchone()
    return row[0], row[1] or ""


@pytest.mark.slow
def test_ctrl_c_stops_the_run_within_seconds_and_a_rerun_resumes(tmp_path: Path, small_pool_url: str, state_dir: Path,
                                                                 shared_server_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    proc, _, stderr = _stop_mid_measure("ctrl-c", out, small_pool_url, state_dir)
    assert proc.returncode == 130, stderr[-2000:]
    stop_line = stderr[stderr.index("rde: stopped by"):]
    assert "complete: images, ingest_rejects; cut: measurements (" in stop_line
    assert "shards written" in stop_line and "run the same command" in stop_line
    assert f"rde build-secmm --until denoise --output {out}" in stop_line
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stop_line.rstrip().endswith("--set ingest.shard_size=8"), stop_line  # the last line rde printed
    # the temporary server, out of the terminal's process group, outlived the Ctrl-C to record it
    state_type, message = _last_flow_run_state(state_dir)
    assert (state_type, message) == ("CANCELLED", "stopped by Ctrl-C (SIGINT); rerun the same command to resume")
    _check_stopped_state(out)
    _rerun_reuses(out, small_pool_url, shared_server_env, state_dir)


@pytest.mark.slow
def test_sigterm_stops_the_run_within_seconds_and_a_rerun_resumes(tmp_path: Path, small_pool_url: str,
                                                                  state_dir: Path,
                                                                  shared_server_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    proc, _, stderr = _stop_mid_measure("sigterm", out, small_pool_url, state_dir)
    assert proc.returncode == 143, stderr[-2000:]
    assert "rde: stopped by SIGTERM" in stderr and "Traceback" not in stderr, stderr[-3000:]
    state_type, message = _last_flow_run_state(state_dir)  # Cancelled in the API, not left Running
    assert (state_type, message) == ("CANCELLED", "stopped by SIGTERM; rerun the same command to resume")
    _check_stopped_state(out)
    _rerun_reuses(out, small_pool_url, shared_server_env, state_dir)


@pytest.mark.slow
def test_sigkill_leaves_no_process_and_a_rerun_resumes(tmp_path: Path, small_pool_url: str, state_dir: Path,
                                                       shared_server_env: dict[str, str]) -> None:
    out = tmp_path / "out"
    proc, _, _ = _stop_mid_measure("sigkill", out, small_pool_url, state_dir)
    assert proc.returncode == -signal.SIGKILL
    _check_stopped_state(out)
    _rerun_reuses(out, small_pool_url, shared_server_env, state_dir)


# -- the pieces, without a flow -------------------------------------------------------------------

GUARDED = textwrap.dedent("""
    import functools, subprocess, sys, time
    sys.path.insert(0, {root!r})
    from entry.interrupt import RunGuard
    from rde.common import reaper

    reaper.stop_processes = functools.partial(reaper.stop_processes, grace_s={grace_s!r})

    def work():
        # a child that ignores SIGTERM (and the Ctrl-C its group gets): the first signal waits out
        # its grace period for it; it prints its pid once it ignores them (its stdout is this process's)
        subprocess.Popen([sys.executable, "-c", "import os, signal, time; "
                          "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                          "signal.signal(signal.SIGINT, signal.SIG_IGN); "
                          "print(os.getpid(), flush=True); time.sleep(600)"])
        time.sleep(600)

    RunGuard(lambda: "complete: nothing yet", "rde again").run(work)
""")


def _guarded_process(nohup: bool = False, grace_s: float = GRACE_S) -> tuple[subprocess.Popen[str], psutil.Process]:
    """The guarded process and its child; ``nohup``: started with SIGHUP ignored, as nohup starts it;
    ``grace_s``: how long a stop waits for the child (which ignores SIGTERM) before its SIGKILL."""
    def hangup_as_a_terminal_leaves_it() -> None:
        # ignored under nohup; otherwise the default, even when the suite itself runs under nohup (whose
        # ignored SIGHUP every child inherits, and a run started so keeps ignoring it)
        signal.signal(signal.SIGHUP, signal.SIG_IGN if nohup else signal.SIG_DFL)

    proc = subprocess.Popen([sys.executable, "-c", GUARDED.format(root=str(ROOT), grace_s=grace_s)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=hangup_as_a_terminal_leaves_it)
    assert proc.stdout is not None
    child = psutil.Process(int(proc.stdout.readline()))
    return proc, child


def test_a_second_ctrl_c_forces_the_exit_at_once() -> None:
    """The first Ctrl-C is being handled once its stop line is out; it then waits out the grace
    period for the child, which ignores SIGTERM. The grace period is 60 s here, so a second Ctrl-C
    that did not force the exit would keep the process for a minute; forcing it takes milliseconds,
    and the bound, half the grace period, is all margin for a loaded machine."""
    grace_s = 60.0
    proc, child = _guarded_process(grace_s=grace_s)
    assert proc.stderr is not None
    lines: list[str] = []
    handling = threading.Event()

    def read() -> None:  # stderr as it comes: the stop line is the sign the first Ctrl-C is handled
        for line in proc.stderr:
            lines.append(line)
            if "rde: stopped by" in line:
                handling.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        os.killpg(proc.pid, signal.SIGINT)
        assert handling.wait(30), f"no stop line 30 s after the first Ctrl-C: {''.join(lines)}"
        assert proc.poll() is None, "the first Ctrl-C did not wait for the child's grace period"
        sent = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=grace_s / 2)
        except subprocess.TimeoutExpired:
            raise AssertionError("the second Ctrl-C did not force the exit: still waiting for the grace "
                                 "period") from None
        print(f"second ctrl-c: exited {proc.returncode} {time.monotonic() - sent:.2f} s after it")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing left when a check failed
        proc.wait(30)
        reader.join(10)
    stderr = "".join(lines)
    assert proc.returncode == 130, stderr
    assert stderr.count("rde: stopped by Ctrl-C (SIGINT): complete: nothing yet") == 1, stderr
    child.wait(5)  # killed, not orphaned


def test_a_closed_terminal_stops_the_run_as_sigterm_does_and_nohup_keeps_it() -> None:
    """SIGHUP (a terminal closed, an SSH session dropped) stops a run like SIGTERM: the stop line,
    its children stopped, exit 129. Under nohup, SIGHUP was ignored when the run started: it goes on."""
    proc, child = _guarded_process()
    os.killpg(proc.pid, signal.SIGHUP)  # a closing terminal signals its whole session
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 129, stderr
    assert stderr.count("rde: stopped by SIGHUP (its terminal closed): complete: nothing yet") == 1, stderr
    child.wait(GRACE_S + 5)  # stopped with the run (it ignores SIGTERM: killed after the grace period)

    kept, kept_child = _guarded_process(nohup=True)
    try:
        kept.send_signal(signal.SIGHUP)
        with pytest.raises(subprocess.TimeoutExpired):  # a stopping run exits within the grace period
            kept.wait(GRACE_S + 1)
        assert kept_child.is_running()
    finally:
        os.killpg(kept.pid, signal.SIGKILL)
        kept.communicate(timeout=30)


def test_one_ctrl_c_stops_a_child_that_ignores_sigterm_after_the_grace_period() -> None:
    proc, child = _guarded_process()
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)  # the process alone, not its group
    proc.communicate(timeout=30)
    seconds = time.monotonic() - sent
    assert proc.returncode == 130
    assert seconds >= GRACE_S - 0.5, f"{seconds:.1f} s: the child was not given its grace period"
    child.wait(5)


def test_the_watcher_stops_what_a_killed_process_started() -> None:
    code = textwrap.dedent(f"""
        import subprocess, sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from rde.common import reaper
        reaper.start()
        inner = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; " \\
                "time.sleep(600)']); time.sleep(600)"
        subprocess.Popen([sys.executable, "-c", inner], start_new_session=True)  # even one that left the group
        print("up", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
    deadline = time.monotonic() + 30
    while len(started := psutil.Process(proc.pid).children(recursive=True)) < 3:  # watcher, child, grandchild
        assert time.monotonic() < deadline, started
        time.sleep(0.1)
    carried = [p for p in started if p.environ().get(TOKEN_VAR)]
    assert len(carried) == 2, [p.cmdline() for p in started]
    proc.kill()
    proc.wait(10)
    _, alive = psutil.wait_procs(carried, timeout=GONE_BOUND_S)
    assert not alive, [p.cmdline() for p in alive]
    watcher = [p for p in started if p not in carried]
    psutil.wait_procs(watcher, timeout=GONE_BOUND_S)
    assert not _alive(watcher), "the watcher did not exit"


def test_a_cut_stage_is_listed_with_the_shards_it_wrote(tmp_path: Path) -> None:
    import pyarrow as pa

    from rde.common.run_state import FolderState, folder_states, stop_summary
    from storage import ArtifactWriter

    schema = pa.schema([pa.field("x", pa.int64())])
    done = ArtifactWriter(str(tmp_path / "images"), "images", schema, "k1")
    done.begin()
    done.finalize([done.write_shard(0, pa.table({"x": [1, 2]}))], code_version="test")
    cut = ArtifactWriter(str(tmp_path / "measurements"), "measurements", schema, "k2")
    cut.begin()
    for index in range(2):
        cut.write_shard(index, pa.table({"x": [index] * 3}))
    (tmp_path / "measurements" / "part-00002.parquet.tmp-abc").write_bytes(b"half")  # not a shard
    assert folder_states(tmp_path) == [FolderState("images", "images", 2, 1, True),
                                       FolderState("measurements", None, 6, 2, False)]
    assert stop_summary(tmp_path) == "complete: images; cut: measurements (2 shards written)"
    assert stop_summary(tmp_path / "missing") == "complete: nothing yet"
    result = CliRunner().invoke(app, ["artifacts", str(tmp_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "no: cut, a rerun resumes it" in result.output, result.output
