"""``train-gtr``: GTR+ retrieval learning (Sec. 3.2): ITC + ITM with adaptive confidence weights
(2-component GMM on ŝ = γ·s + (1−γ)·q_txt refitted every epoch, weight C^β); baselines ``none`` and
``fix`` (q_txt) through ``training.gtr_weighting``. Plots the ŝ histograms per epoch (Fig. 7)."""

from __future__ import annotations

from typing import Any

from prefect import flow

from tasks import training
from tasks.framework.context import RunContext, run_locked
from tasks.framework.task_runners import default_task_runner

FLOW_NAME = "train-gtr"
STAGES = ("features", "train")


@flow(name=FLOW_NAME, task_runner=default_task_runner(), log_prints=True)
def train_gtr(profile: str = "demo", overrides: dict[str, Any] | None = None, output_root: str | None = None,
              until: str | None = None) -> dict[str, Any]:
    """Features from the profile's build-largefine captions, then confidence-weighted training."""
    return run_locked(FLOW_NAME, STAGES, profile, overrides, output_root, until, _run)


def _run(ctx: RunContext, until: str | None) -> dict[str, Any]:
    weighting = ctx.profile.training.gtr_weighting
    cfg = training.train_config(ctx.profile, objective="itc", weighting=weighting, use_itm=True)
    return training.run_training(ctx, until, f"gtr-{weighting}", cfg)


if __name__ == "__main__":
    train_gtr()
