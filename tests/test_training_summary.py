"""The training summary reports the first stage's rows as splits (train, held-out: evaluation data)
plus rejected rows by reason, and balances an independently counted input against all three."""

from __future__ import annotations

from rde.profile import load_profile
from tasks.framework.accounting import StageResult
from tasks.framework.context import RunContext
from tasks.framework.reporting import accounting_line
from tasks.training import training_summary


def _results(train: int, held_out: int, rejected: dict[str, int]) -> list[StageResult]:
    kept = train + held_out
    features = StageResult("training-features", False, {}, kept + sum(rejected.values()), kept, rejected,
                           splits={"train": train, "held_out": held_out})
    return [features, StageResult("train_saft", False, {}, train, train, {})]


def test_held_out_captions_are_a_split_and_the_balance_is_a_real_comparison() -> None:
    ctx = RunContext(load_profile("demo"), "train-saft", "/tmp/unused")
    summary = training_summary(ctx, _results(588, 318, {"check_set_identity": 40}), counted_inputs=946)
    assert summary["splits"] == {"train": 588, "held_out": 318} and summary["total_rejected"] == 40
    assert summary["rejected"] == {"training-features:check_set_identity": 40} and summary["balanced"]
    assert accounting_line(summary) == "inputs 946 = train 588 + held-out 318 + rejected 40"
    # one caption the features stage never saw: the counted input no longer matches
    assert not training_summary(ctx, _results(588, 318, {"check_set_identity": 40}), counted_inputs=947)["balanced"]
    # splits that do not add up to what the stage kept are not balanced either
    broken = _results(588, 318, {})
    broken[0].splits["held_out"] = 300
    assert not training_summary(ctx, broken, counted_inputs=906)["balanced"]


def test_without_splits_the_line_reads_accepted() -> None:
    ctx = RunContext(load_profile("demo"), "rerank", "/tmp/unused")
    summary = training_summary(ctx, [StageResult("rerank", False, {}, 2, 2, {})])
    assert summary["splits"] == {} and summary["balanced"]
    assert accounting_line(summary) == "inputs 2 = accepted 2 + rejected 0"
