"""The runner's accounting: a stage that declares ``balance`` counts its input itself, and a stage
that loses (or invents) a row fails before anything is marked complete. A shard reused after a
crash brings its own counts back from its footer, extras included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from storage import Artifact
from tasks.framework import shards
from tasks.framework.accounting import AccountingError, StageResult, check_balance
from tasks.framework.runner import prepare_stage, run_stage
from tasks.framework.stage import Stage, StageRun, Work, Write

ROWS = pa.schema([pa.field("id", pa.string(), nullable=False)])
REJECTS = pa.schema([pa.field("id", pa.string(), nullable=False), pa.field("reason", pa.string(), nullable=False)])


def _shard(index: int, inputs: list[str], lose: str | None = None) -> tuple[dict[str, pa.Table], dict[str, Any]]:
    """Inputs ending in 'x' are rejected, the rest accepted; ``lose`` is dropped on the floor."""
    kept = [i for i in inputs if not i.endswith("x") and i != lose]
    bad = [i for i in inputs if i.endswith("x") and i != lose]
    return ({"rows": pa.table({"id": kept}, schema=ROWS),
             "rejects": pa.table({"id": bad, "reason": ["not_sampled"] * len(bad)}, schema=REJECTS)},
            {"input_rows": len(inputs), "accepted": len(kept), "rejected": {"not_sampled": len(bad)} if bad else {},
             "tokens": 10 * len(inputs)})


def _outputs(root: Path) -> list[shards.Output]:
    return [shards.Output("rows", str(root / "rows"), "rows", ROWS),
            shards.Output("rejects", str(root / "rejects"), "rejects", REJECTS)]


def test_check_balance_passes_a_balanced_count_and_names_the_gap() -> None:
    assert check_balance("s", {"input_rows": 5, "accepted": 3, "rejected": {"a": 1, "b": 1}})
    with pytest.raises(AccountingError, match=r"s shard 2: 5 inputs counted, but 3 accepted \+ 1 rejected "
                                                      r"= 4 \(1 rows lost\)"):
        check_balance("s", {"input_rows": 5, "accepted": 3, "rejected": {"a": 1}}, " shard 2")
    with pytest.raises(AccountingError, match="1 rows more than its input"):
        check_balance("s", {"input_rows": 3, "accepted": 3, "rejected": {"a": 1}})


class _Toy(Stage):
    """A whole-input stage over four inputs; ``lose`` drops one on the floor."""

    name = "toy"
    version = "1"
    writes = (Write("rows", "rows", ROWS), Write("rejects", "rejects", REJECTS, rejects=True))
    balance = True

    def __init__(self, lose: str | None) -> None:
        self.lose = lose

    def run(self, run: StageRun) -> Work:
        return Work.one(*_shard(0, ["a", "bx", "c", "dx"], self.lose))


def _run_whole(tmp_path: Path, lose: str | None) -> StageResult:
    from rde.profile import load_profile
    from tasks.framework.context import RunContext

    ctx = RunContext(load_profile("demo"), "balance-check", str(tmp_path / "out"))
    return run_stage(ctx, _Toy(lose))


def test_a_whole_input_stage_that_loses_a_row_is_refused(tmp_path: Path) -> None:
    rows = tmp_path / "out" / "balance-check" / "demo" / "rows"
    with pytest.raises(AccountingError, match="1 rows lost"):
        _run_whole(tmp_path, lose="c")  # an accepted row that was never written
    assert not Artifact(str(rows)).is_complete()
    result = _run_whole(tmp_path, lose=None)
    assert (result.input_rows, result.accepted, result.rejected, result.balanced) == (4, 2, {"not_sampled": 2}, True)
    assert Artifact(str(rows)).manifest().stats["balanced"] is True


class _PerShard(Stage):
    """A per-shard stage over three shards of inputs, computed by ``compute`` (one Prefect task each)."""

    name = "toy"
    version = "1"
    writes = (Write("rows", "rows", ROWS), Write("rejects", "rejects", REJECTS, rejects=True))
    balance = True

    def __init__(self, compute: Any) -> None:
        self.compute = compute

    def shard_count(self, run: StageRun) -> int:
        return 3

    def process(self, run: StageRun, index: int) -> Work:
        return Work.one(*self.compute(index))


def _per_shard(tmp_path: Path, compute: Any) -> StageResult:
    """The per-shard toy stage run by the one lifecycle inside a flow (its shards are tasks)."""
    from prefect import flow

    @flow(name="balance-check")
    def run() -> StageResult:
        return run_stage(_ctx(tmp_path), _PerShard(compute))

    return run()


def _ctx(tmp_path: Path) -> Any:
    from rde.profile import load_profile
    from tasks.framework.context import RunContext

    return RunContext(load_profile("demo"), "balance-check", str(tmp_path / "out"))


INPUTS = {0: ["a", "bx", "c"], 1: ["d", "e", "fx"], 2: ["g"]}


@pytest.mark.slow
def test_a_per_shard_stage_is_checked_shard_by_shard_and_reuses_footer_stats(tmp_path: Path) -> None:
    calls: list[int] = []

    def compute(index: int, lose: str | None = None) -> tuple[dict[str, pa.Table], dict[str, Any]]:
        calls.append(index)
        return _shard(index, INPUTS[index], lose)

    rows = Artifact(str(tmp_path / "out" / "balance-check" / "demo" / "rows"))
    with pytest.raises(AccountingError, match="toy shard 1: 3 inputs counted"):
        _per_shard(tmp_path, lambda i: compute(i, lose="e" if i == 1 else None))
    assert sorted(calls) == [0, 1, 2], "the lost row was retried (a bug is not flaky: no retry)"
    assert rows.shard_stats(1) is None  # the bad shard was not written
    assert not rows.is_complete()
    calls.clear()
    result = _per_shard(tmp_path, compute)  # like a rerun after a crash: shards 0 and 2 are reused
    assert calls == [1] and result.shards_resumed == 2
    assert (result.input_rows, result.accepted, result.rejected, result.balanced) == (7, 5, {"not_sampled": 2}, True)
    assert rows.manifest().stats["tokens"] == 70  # reused shards keep their extras (was 0 when recounted from rows)
    assert rows.shard_stats(0) == {"input_rows": 3, "accepted": 2, "rejected": {"not_sampled": 1}, "tokens": 30}


@pytest.mark.slow
def test_a_shard_written_without_counts_in_its_footer_is_computed_again(tmp_path: Path) -> None:
    """A shard of the same key whose footer holds no counts is not recounted from its rows (its input
    would be accepted + rejected, balanced by construction): it is computed again, so a row it lost
    shows in the stage's totals instead of vanishing from them."""
    calls: list[int] = []

    def compute(index: int) -> tuple[dict[str, pa.Table], dict[str, Any]]:
        calls.append(index)
        return _shard(index, INPUTS[index])

    prepared = prepare_stage(_ctx(tmp_path), _PerShard(compute))
    lossy, _ = _shard(1, INPUTS[1], lose="e")  # shard 1 as other code left it: "e" lost, no counts kept
    shards.write_shards(prepared.outputs, prepared.key, 1, lossy)
    assert Artifact(prepared.outputs[0].url).shard_stats(1) is None
    result = _per_shard(tmp_path, compute)
    assert sorted(calls) == [0, 1, 2] and result.shards_resumed == 0
    assert (result.input_rows, result.accepted, result.rejected) == (7, 5, {"not_sampled": 2})
    assert Artifact(prepared.outputs[0].url).shard_stats(1) == {
        "input_rows": 3, "accepted": 2, "rejected": {"not_sampled": 1}, "tokens": 30}


def test_a_fanned_out_parent_removes_shards_without_counts_and_never_collects_one(tmp_path: Path) -> None:
    """The parent of shard-range runs removes the shards of its key whose footers hold no counts (so
    its ranges compute them), and refuses to build a manifest over such a shard rather than count
    its input as accepted + rejected."""
    from tasks.framework.fanout import FanoutError, collect_shards

    outs = _outputs(tmp_path / "fan")
    counted, stats = _shard(0, ["a", "bx"])
    shards.write_shards(outs, "key-1", 0, counted, stats)
    uncounted, _ = _shard(1, ["c", "dx"])
    shards.write_shards(outs, "key-1", 1, uncounted)
    with pytest.raises(FanoutError, match="shard 1 was written without its counts in the Parquet footer"):
        collect_shards(outs, "key-1", 2, "toy", balance=True)
    assert shards.discard_uncounted_shards("toy", outs, "key-1", range(2)) == [1]
    for out in outs:
        assert Artifact(out.url).written_indices() == {0}
    infos, collected = collect_shards(outs, "key-1", 1, "toy", balance=True)
    assert collected == [stats] and infos[0]["rows"].rows == 1
