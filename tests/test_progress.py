"""Stage progress: the process-local reporter (one display per stage, nested progress takes over a
"running" stage), the terminal renderer (advances, finishes, logs print above it) and silence when
the output is not a terminal."""

from __future__ import annotations

import io
import logging
import re
import sys

from rich.console import Console

from entry.console_progress import describe, live_progress
from rde.common import progress

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


class Recorder:
    """A renderer that keeps every call: (event, handle, description, done, total)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, str, float, float | None]] = []
        self.next = 0

    def start(self, snap: progress.Snapshot) -> int:
        self.next += 1
        self.calls.append(("start", self.next, snap.description, snap.done, snap.total))
        return self.next

    def update(self, handle: int, snap: progress.Snapshot) -> None:
        self.calls.append(("update", handle, snap.description, snap.done, snap.total))

    def stop(self, handle: int, snap: progress.Snapshot) -> None:
        self.calls.append(("stop", handle, snap.description, snap.done, snap.total))


def test_a_stage_reports_done_of_total_and_a_nested_progress_takes_over_its_line() -> None:
    rec = Recorder()
    with progress.install(rec):
        # no total: shown as running; the nested progress with a total takes that line over
        with progress.StageProgress("caption-pool"), progress.StageProgress("caption-pool", total=3) as inner:
            for _ in range(3):
                inner.advance()
        with progress.StageProgress("measure", total=2, unit="shards") as shards:
            shards.update(2)
    assert [c[0] for c in rec.calls].count("start") == 2  # one line per stage, none for the nested one
    first = [c for c in rec.calls if c[1] == 1]
    assert [c[3] for c in first if c[0] == "update"] == [0, 1, 2, 3, 0]  # advances, then back to "running"
    assert first[-1][0] == "stop" and rec.calls[-1] == ("stop", 2, "measure", 2, 2)
    progress.StageProgress("no renderer", total=1).update(1)  # a no-op once uninstalled
    assert len([c for c in rec.calls if c[0] == "start"]) == 2


def test_rate_and_time_left_come_from_the_stage_so_far_and_the_clock_ticks_between_updates() -> None:
    snap = progress.Snapshot("qa-tiers", 4, 17, "shards", started=0.0, updated=120.0)
    fields = describe(snap, now=120.0)
    assert fields["count"] == "4/17 shards" and fields["rate"] == "30.0 s/shard"
    assert fields["when"] == "2:00, ~6:30 left"
    assert describe(snap, now=130.0)["when"] == "2:10, ~6:20 left"  # no new shard yet: elapsed up, left down
    fast = describe(progress.Snapshot("train", 50, None, "steps", started=0.0, updated=10.0), now=10.0)
    assert fast == {"count": "50 steps", "rate": "5.0 steps/s", "when": "0:10"}


def test_on_a_terminal_the_display_advances_finishes_and_logs_print_above_it() -> None:
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    logger = logging.getLogger("rde.test_progress")
    handler = logging.StreamHandler(sys.stderr)
    logger.addHandler(handler)
    try:
        with live_progress(console) as renderer:
            assert renderer is not None
            stage = progress.StageProgress("qa-tiers", total=3, unit="shards")
            seen = []
            for _ in range(3):
                stage.advance()
                renderer.progress.refresh()
                seen.append(ANSI.sub("", out.getvalue()))
            logger.warning("Task run 'qa-tiers-2' - Finished in state Completed()")
            stage.close()
            assert not renderer.progress.tasks  # the finished stage's line is gone
        assert handler.stream is sys.stderr  # restored
    finally:
        logger.removeHandler(handler)
    text = ANSI.sub("", out.getvalue())
    assert "1/3 shards" in seen[0] and "2/3 shards" in seen[1] and "3/3 shards" in seen[2]
    assert "left" in seen[0] and "qa-tiers" in seen[0]
    assert "Task run 'qa-tiers-2' - Finished in state Completed()" in text  # through the live console


def test_without_a_terminal_nothing_is_drawn(monkeypatch) -> None:
    out = io.StringIO()
    with live_progress(Console(file=out, width=120)) as renderer:
        assert renderer is None
        with progress.StageProgress("measure", total=2, unit="shards") as stage:
            stage.update(2)
    assert out.getvalue() == ""
    monkeypatch.setenv("RDE_PROGRESS", "off")
    with live_progress(Console(file=out, force_terminal=True)) as renderer:
        assert renderer is None


class RichConsoleHandler(logging.StreamHandler):
    """A handler that draws with a rich console of its own on the real stderr, as Prefect's console
    handler does: given the live display's stream proxy, such a console unwraps it and writes under
    the display, onto the line being drawn."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.console = Console(file=sys.stderr)

    def emit(self, record: logging.LogRecord) -> None:
        self.console.print(self.format(record), soft_wrap=True)


def test_a_handler_with_its_own_rich_console_prints_through_the_display_and_quiet_drops_task_lines(
        capsys) -> None:
    from entry.console_progress import QuietTaskRuns

    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    handler = RichConsoleHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    task_log = logging.getLogger("prefect.task_runs")
    flow_log = logging.getLogger("prefect.flow_runs")
    hook_log = logging.getLogger("tests.flow_engine")  # Prefect's engine logs hooks; the filter reads the text
    hook_log.setLevel(logging.INFO)
    levels = task_log.level, flow_log.level
    task_log.setLevel(logging.INFO)
    flow_log.setLevel(logging.INFO)
    try:
        with live_progress(console, QuietTaskRuns()) as renderer:
            assert renderer is not None
            with progress.StageProgress("measure", total=2, unit="shards") as stage:
                stage.advance()
                renderer.progress.refresh()
                task_log.info("Finished in state Completed()", extra={"task_run_name": "measure-0"})
                task_log.warning("a shard retried", extra={"task_run_name": "measure-1"})
                flow_log.info("measure: 8/8 accepted", extra={"flow_run_name": "quiet-otter"})
                stage.advance()
        assert root.handlers.count(handler) == 1 and not handler.filters  # restored as it was
        # --verbose: task lines back, through the display; the CLI's own hook's lines stay out
        with live_progress(console, QuietTaskRuns(verbose=True, hooks=("record_flow_run",))) as renderer:
            task_log.info("Finished in state Completed()", extra={"task_run_name": "measure-2"})
            hook_log.info("Running hook 'record_flow_run' in response to entering state 'Running'")
            hook_log.info("Hook 'record_flow_run' finished running successfully")
            hook_log.info("Hook 'notify' finished running successfully")  # a hook of the flow's own
    finally:
        root.removeHandler(handler)
        task_log.setLevel(levels[0])
        flow_log.setLevel(levels[1])
    text = ANSI.sub("", out.getvalue())
    assert capsys.readouterr().err == ""  # nothing written past the display
    assert "Flow run 'quiet-otter' - measure: 8/8 accepted" in text
    assert "Task run 'measure-1' - a shard retried" in text  # a task's warning passes
    assert "measure-0" not in text and "Task run 'measure-2' - Finished in state Completed()" in text
    assert "record_flow_run" not in text and "Hook 'notify' finished" in text
    for line in text.replace("\r", "\n").splitlines():
        assert not ("━" in line and " - " in line), line  # no log line shares a line with a bar


def test_without_a_terminal_quiet_still_drops_task_lines_from_the_plain_handler() -> None:
    from entry.console_progress import QuietTaskRuns

    pipe = io.StringIO()  # stderr as a pipe, as in CI: the console and the log handler write to it
    handler = logging.StreamHandler(pipe)
    logging.getLogger().addHandler(handler)
    task_log = logging.getLogger("prefect.task_runs")
    level = task_log.level
    task_log.setLevel(logging.INFO)
    run = {"task_run_name": "measure-0"}  # what Prefect's own handlers (if configured) format
    try:
        with live_progress(Console(file=pipe, width=120), QuietTaskRuns()) as renderer:
            assert renderer is None
            task_log.info("Finished in state Completed()", extra=run)
            task_log.error("shard failed", extra=run)
        task_log.info("after the run", extra=run)  # the filter goes with the run
    finally:
        logging.getLogger().removeHandler(handler)
        task_log.setLevel(level)
    assert pipe.getvalue() == "shard failed\nafter the run\n"


def test_a_user_errors_traceback_stays_off_the_terminal_unless_verbose() -> None:
    """The CLI prints a user error (a missing model) as one line; Prefect's logged traceback of it
    is left out, another error's is not, and --verbose keeps both."""
    from entry.console_progress import QuietTaskRuns

    def logged(error: BaseException, verbose: bool) -> str:
        pipe = io.StringIO()
        handler = logging.StreamHandler(pipe)
        flow_log = logging.getLogger("tests.flow_runs")
        flow_log.addHandler(handler)
        try:
            with live_progress(Console(file=pipe, width=120), QuietTaskRuns(verbose, user_errors=(FileNotFoundError,))):
                try:
                    raise error
                except Exception as exc:
                    flow_log.exception("Encountered exception during execution: %r", exc)
        finally:
            flow_log.removeHandler(handler)
        return pipe.getvalue()

    assert logged(FileNotFoundError("no trained reranker"), verbose=False) == ""
    assert "Traceback" in logged(RuntimeError("a bug"), verbose=False)
    assert "no trained reranker" in logged(FileNotFoundError("no trained reranker"), verbose=True)


def test_a_stage_that_counts_its_images_shows_their_rate_not_the_shards() -> None:
    rec = Recorder()
    with progress.install(rec), progress.StageProgress("measure", total=6, unit="shards", item_unit="images") as s:
        s.advance(items=4)
        s.advance(items=4)
        snap = s.snapshot()
    assert (snap.done, snap.items, snap.item_unit) == (2, 8, "images")
    timed = progress.Snapshot("measure", 2, 6, "shards", started=0.0, updated=4.0, items=8, item_unit="images")
    assert describe(timed, now=4.0) == {"count": "2/6 shards", "rate": "2.0 images/s", "when": "0:04, ~0:08 left"}
    reused = progress.Snapshot("measure", 2, 6, "shards", started=0.0, updated=4.0, item_unit="images")
    assert describe(reused, now=4.0)["rate"] == "2.0 s/shard"  # no rows computed yet: the shards' rate
