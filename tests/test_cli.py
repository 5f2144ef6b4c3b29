"""The ``rde`` command: help texts, and clear one-line errors (no tracebacks) for bad input."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from entry.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("build-secmm", "profile", "pool", "artifacts", "train-vedje", "index-cache", "rerank", "clips"):
        assert command in result.output
    result = runner.invoke(app, ["build-secmm", "--help"])
    assert result.exit_code == 0 and "--input" in result.output and "--set" in result.output


def test_profile_validate_reports_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text((ROOT / "profiles" / "demo.yaml").read_text().replace("min_width: 32", "min_width: wide"))
    result = runner.invoke(app, ["profile", "validate", str(bad)])
    assert result.exit_code == 2
    assert "denoise.min_width" in result.output and "Traceback" not in result.output
    ok = runner.invoke(app, ["profile", "validate", "production"])
    assert ok.exit_code == 0 and "ok" in ok.output


def _rde(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "entry.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env or {**os.environ}, timeout=120)


@pytest.mark.slow  # the flow-found mistake runs against the session server
def test_bad_inputs_give_messages_not_tracebacks(tmp_path: Path, shared_server_env: dict[str, str]) -> None:
    """Each mistake is named on stderr with exit code 2 and no traceback; the one found inside a flow
    runs it against the session's server (not a temporary server of its own: 12-20 CPU s)."""
    for args, message in [
        (["build-secmm", "--input", str(tmp_path / "missing-folder")], "does not exist or is not a folder"),
        (["build-secmm", "--input", str(tmp_path / "missing.parquet")], "does not exist"),
        (["build-secmm", "--set", "denoise.min_height=-3"], "denoise.min_height"),
        (["build-secmm", "--set", "nonsense"], "--set expects key.path=value"),
        (["build-secmm", "--profile", "nope"], "not found"),
        (["build-secmm", "--until", "bogus", "--output", str(tmp_path / "out")], "valid names: denoise, queries"),
        # found inside the flow (Prefect logs its traceback): the terminal shows the error line only
        (["rerank", "--query", "a man walking", "--output", str(tmp_path / "out")], "no trained reranker at"),
    ]:
        result = _rde(*args, env=shared_server_env)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, args


def _in_terminal(args: list[str], timeout: float = 600, env: dict[str, str] | None = None, exit_code: int = 0) -> str:
    """Run ``rde`` in a pseudo-terminal (140 columns); everything it drew, ANSI codes removed and
    carriage returns made line breaks (what was drawn over, one screen line each)."""
    import fcntl
    import pty
    import select
    import struct
    import termios
    import time

    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 140, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "entry.cli", *args], stdin=slave, stdout=slave, stderr=slave,
                            cwd=ROOT, env={**(env or os.environ), "TERM": "xterm-256color"}, close_fds=True)
    os.close(slave)
    raw, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([master], [], [], 0.5)[0]:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            raw += chunk
        elif proc.poll() is not None:
            break
    proc.kill() if proc.poll() is None else None
    os.close(master)
    assert proc.wait() == exit_code, raw.decode(errors="replace")[-3000:]
    return re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", raw.decode(errors="replace")).replace("\r", "\n")


BAR = "━"  # the progress bar's glyph (rich's BarColumn)
SPINNER = re.compile("[\u2800-\u28ff]")  # rich's spinner frames (braille dots)
LOG_LINE = re.compile(r"\b(INFO|WARNING|ERROR)\b|Task run '|Flow run '")


@pytest.mark.slow
def test_progress_is_live_on_a_terminal_and_absent_in_a_pipe(tmp_path: Path, tiny_pool_url: str,
                                                            shared_server_env: dict[str, str]) -> None:
    """One line per running stage that advances (shards done of total) and finishes, with log lines
    above it and never on it, even with --verbose's per-task lines; the same run piped prints plain
    lines: no progress, spinner, carriage return or escape code, and no per-task lines without
    --verbose. On the 24-image pool in six 4-image shards: the display is the subject, not the
    measuring."""
    args = ["build-secmm", "--input", tiny_pool_url, "--until", "denoise", "--set", "ingest.shard_size=4"]
    shown = _in_terminal([*args, "--verbose", "--output", str(tmp_path / "tty")])
    measured = {int(n) for n in re.findall(r"measure[\s━╸╺]+(\d+)/6 shards", shown)}
    assert len(measured) >= 2 and 6 in measured, shown[-3000:]  # it advanced, and was drawn finished
    assert "Finished in state Completed()" in shown and "inputs 24 = accepted" in shown  # --verbose: task lines
    shared = [line for line in shown.splitlines() if BAR in line and LOG_LINE.search(line)]
    assert not shared, shared[:5]  # a log line printed onto a progress line
    assert "telemetry" not in shown.lower()
    # the piped run stops after ingest (six shards, so a progress line would be drawn): what it must
    # not print is the same for every stage, and the models' minute is spent once, above
    piped_args = [*args[:args.index("--until")], "--until", "ingest", *args[args.index("--until") + 2:]]
    piped = subprocess.run([sys.executable, "-m", "entry.cli", *piped_args, "--output", str(tmp_path / "pipe")],
                           capture_output=True, text=True, cwd=ROOT, timeout=600, env=shared_server_env)
    assert piped.returncode == 0, piped.stderr[-3000:]
    everything = piped.stdout + piped.stderr
    assert "inputs 24 = accepted" in piped.stdout and "ingest: 24/24 accepted" in piped.stderr  # the stage's line
    assert "Task run '" not in everything  # per-task lines only with --verbose
    noise = re.findall(r"━\s*\d+/\d+ shards|\x1b\[|~\d+:\d\d left|\r", everything) + SPINNER.findall(everything)
    assert not noise, noise


def test_no_telemetry_notice_on_a_terminal(tmp_path: Path) -> None:
    """Prefect prints a telemetry notice on its first import in a terminal (per Prefect home): a
    fresh home, no CI variables (they turn it off too), and a run refused once the flow is imported
    (its --until checked), in a pseudo-terminal."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("CI", "GITHUB_ACTIONS", "GITLAB_CI", "BUILDKITE", "DO_NOT_TRACK", "PREFECT_API_URL")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    shown = _in_terminal(["build-secmm", "--until", "bogus", "--output", str(tmp_path / "out")], timeout=300,
                         env=env, exit_code=2)
    assert "valid names: denoise" in shown  # the flow module (and Prefect) was imported
    assert "telemetry" not in shown.lower() and "anonymous usage" not in shown


def test_a_model_load_draws_no_bar_of_its_own() -> None:
    """transformers draws a "Loading weights" bar per model load: carriage returns in a pipe or log
    file, a second bar beside the stage lines on a terminal. The CLI's environment turns it off."""
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_DISABLE_PROGRESS_BARS"}
    probe = ("import entry.cli\nfrom transformers.utils import logging\n"
             "print('bars', logging.is_progress_bar_enabled())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0 and "bars False" in out.stdout, out.stderr[-2000:]


def test_each_cli_flow_ref_names_the_flow_it_loads() -> None:
    """FlowRef derives the flow's name (its artifacts' folder, locked before import) from the
    module name: it must be the loaded flow's own name."""
    from entry.cli import FlowRef

    for module in ("build_secmm", "build_largefine", "train_saft", "train_gtr", "train_vedje", "index_cache",
                   "rerank"):
        ref = FlowRef(module)
        assert ref.load().name == ref.name, module



# (arguments, what the error says): the first four are the CLI's own one-line errors, the others
# typer's range and existence checks (its usage-error box)
BAD_PARAMETERS = [
    (["build-secmm", "--until", "bogus"], "--until 'bogus' is not a stage of build-secmm; valid names: denoise, "
                                          "queries, gallery, candidates, benchmark, evaluate, videos, ingest, measure"),
    (["build-largefine", "--until", "tier"], "--until 'tier' is not a stage of build-largefine; valid names: "
                                             "denoise, neighbours, tiers,"),
    (["build-secmm", "--input-kind", "zip", "--input", "x"], "--input-kind 'zip' is not an input kind; valid kinds: "
                                                             "folder, paths, pool, video"),
    (["build-secmm", "--input-kind", "folder"], "--input-kind folder needs --input"),
    (["pool", "synth", "--n", "0"], "Invalid value for '--n'"),
    (["pool", "synth", "--n", "5", "--shard-size", "0"], "Invalid value for '--shard-size'"),
    (["pool", "synth", "--n", "5", "--duplicate-share", "1.5"], "Invalid value for '--duplicate-share'"),
    (["check-experts", "--k", "0"], "Invalid value for '--k'"),
    (["stack", "up", "--port", "0"], "Invalid value for '--port'"),
    (["stack", "up", "--gpu-slots", "0"], "Invalid value for '--gpu-slots'"),
    (["stack", "status", "--port", "70000"], "Invalid value for '--port'"),
    (["labels", "import", "no-such-decisions.json"], "does not exist"),
]


@pytest.mark.parametrize("args, message", BAD_PARAMETERS, ids=[" ".join(a) for a, _ in BAD_PARAMETERS])
def test_bad_run_parameters_are_refused_before_anything_starts(args: list[str], message: str, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A bad parameter is a clear error and exit 2 (typer's usage-error code), and nothing starts:
    every command's work (a flow, the stack, the synthetic pool, the experts, a label import) fails
    the test if it is reached."""
    from entry import cli, stack, synth_pool
    from rde.common import expert_check
    from rde.secmm import label_import

    def started(*_args, **_kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError(f"{args} started work before refusing its parameters")

    monkeypatch.setattr(cli.FlowRef, "load", started)
    for module, name in ((stack, "up"), (stack, "down"), (stack, "status"), (synth_pool, "write_synth_pool"),
                         (expert_check, "load_check_set"), (label_import, "merge_decisions")):
        monkeypatch.setattr(module, name, started)
    monkeypatch.chdir(tmp_path)  # a relative path named here is not in the repository
    out = ["--output", str(tmp_path / "out")] if args[0].startswith("build-") else []
    result = runner.invoke(app, [*args, *out], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert message in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output
    if message.startswith("--"):  # the CLI's own errors: one line
        assert result.output.startswith("error: ") and result.output.strip().count("\n") == 0, result.output


def test_a_stage_whose_rows_do_not_add_up_is_an_error_line_and_exit_2(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that loses rows raises AccountingError in the flow: the CLI prints its message (the
    stage and the counts) as one error line and exits 2, never a traceback."""
    from entry import cli
    from tasks.framework.accounting import AccountingError

    def lossy_flow(**_kwargs):  # type: ignore[no-untyped-def]
        raise AccountingError("denoise: 24 inputs counted, but 20 accepted + 1 rejected")

    monkeypatch.setattr(cli.FlowRef, "load", lambda _self: lossy_flow)
    result = runner.invoke(app, ["build-secmm", "--output", str(tmp_path / "out")], env={"COLUMNS": "200"})
    assert result.exit_code == 2, (result.output, result.exception)
    assert result.output.strip() == "error: denoise: 24 inputs counted, but 20 accepted + 1 rejected"


def test_python_dash_m_runs_every_command_group_the_rde_script_has() -> None:
    """``python -m entry.cli`` defines every command before it runs (the stack commands used to
    follow the ``__main__`` block, so ``python -m entry.cli stack up`` did not find them)."""
    done = subprocess.run([sys.executable, "-m", "entry.cli", "stack", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert all(f" {name} " in done.stdout for name in ("up", "down", "status")), done.stdout


def test_stack_status_checks_the_port_the_last_stack_up_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``stack up --port 4317`` records its URL in ``stack.json``; ``status`` without ``--port``
    checks that port (it checked 4200 and said unhealthy), ``--port`` still wins."""
    import json

    from entry.stack import StackConfig, _write_state, recorded_port

    monkeypatch.setenv("RDE_STATE_DIR", str(tmp_path))
    assert recorded_port() is None
    cfg = StackConfig(port=4317)
    cfg.folder.mkdir(parents=True)
    _write_state(cfg)
    assert recorded_port() == 4317
    shown = json.loads(CliRunner().invoke(app, ["stack", "status"]).output)
    assert shown["api_url"] == "http://127.0.0.1:4317/api" and shown["healthy"] is False  # nothing listens there
    shown = json.loads(CliRunner().invoke(app, ["stack", "status", "--port", "4318"]).output)
    assert shown["api_url"] == "http://127.0.0.1:4318/api"
