"""``rde evaluate``'s stages: per retriever, its gallery embedded per shard (``embed_gallery``) and its
queries ranked and scored (``score_model``); then every retriever compared (``compare``). The
stages follow the profile's ``evaluation`` section, so a fan-out worker builds the same ones."""

from __future__ import annotations

from typing import Any

from rde.evaluation.plan import plan_evaluation
from tasks.evaluation.compare import Compare
from tasks.evaluation.embed_gallery import EmbedGallery
from tasks.evaluation.score_model import ScoreModel
from tasks.framework.stage import Pipeline, Stage

FLOW_NAME = "evaluate"


def evaluation_pipeline(profile: Any, output_root: str | None = None) -> Pipeline:
    """The stages of the profile's evaluation: two per model (a scores file needs no gallery
    vectors), then the comparison."""
    plan = plan_evaluation(profile, output_root)
    stages: list[Stage] = []
    for spec in plan.models:
        if spec.kind != "scores":
            stages.append(EmbedGallery(spec, plan))
        stages.append(ScoreModel(spec, plan))
    return Pipeline(FLOW_NAME, (*stages, Compare(plan)))
