"""``train-saft``: SAFT fine-tuning (DSMM-TBIR Sec. 3.3): ITC + α·SASS + β·ISD with the profile's
teacher precomputed once, the text tower frozen by default; baselines (ITC, ITC+SASS, CUSA,
threshold hard negatives, ITC+ISS) through ``training.saft_objective``."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import training
from tasks.framework.context import RunContext, run_locked
from tasks.framework.task_runners import default_task_runner

FLOW_NAME = "train-saft"
STAGES = ("features", "train")


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def train_saft(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
               until: str | None = None) -> dict[str, Any]:
    """Features from the profile's build-largefine captions, then SAFT training and evaluation."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    cfg = training.train_config(ctx.profile, objective=ctx.profile.training.saft_objective)
    return training.run_training(ctx, until, cfg.objective, cfg)


if __name__ == "__main__":
    train_saft()
