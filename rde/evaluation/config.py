"""The ``evaluation`` profile section: what ``rde evaluate`` scores and compares (its benchmark,
models, labels, reference, cut-offs; read by ``plan.py``), and the hand-labelled check sets scored
besides the built benchmark (also read, through the profile, by build-secmm's evaluate stage and by
training, which keeps their identities out).

It sits beside the evaluation logic that reads most of it; ``rde.profile`` composes it into a
``Profile``, and the other pipelines read it from the profile they are handed, never importing it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from models.specs import Strict


class EvaluationSpec(Strict):
    """What ``evaluate`` scores besides the built benchmark: hand-labelled check sets (YAML files
    like data/check_set/queries.yaml, relevance by identity over a pool artifact)."""

    check_sets: list[str] = Field(default_factory=list, description="Hand-labelled check-set YAML files scored "
                                  "besides the built benchmark (their identities are kept out of training).")
    check_set_pool: str = Field("data/demo_pool", description="The pool artifact the check sets' identities "
                                "refer to.")
    benchmark: str | None = Field(None, description="rde evaluate: the benchmark scored (a build-secmm benchmark "
                                  "folder or s3:// prefix, its dataset folder, a check-set YAML or a clip set); "
                                  "unset: this profile's build-secmm benchmark.")
    models: list[str] = Field(default_factory=list, description="rde evaluate: the retrievers compared, as model "
                              "specs (transformers-clip:, sentence-transformers:, open-clip:, expert:, student:, "
                              "python:, scores:); empty: each of this profile's experts.")
    labels: Literal["verified", "pending", "all"] | None = Field(None, description="rde evaluate: which labels "
                                                                 "count as relevant; unset: verified when any "
                                                                 "exist, else pending (the unreviewed MECF union).")
    reference: str | None = Field(None, description="rde evaluate: the model the others' paired differences are "
                                  "taken against (one of models); unset: the first.")
    map_cutoffs: list[int] = Field([10, 20, 30], min_length=1, description="rde evaluate: the cut-offs K of "
                                   "mAP@K (the paper's 10, 20, 30).")
    run_depth: int = Field(100, ge=1, description="rde evaluate: items per query in each model's TREC run file.")
    embed_group_items: int = Field(4096, ge=1, description="rde evaluate: gallery items one embedding task "
                                   "encodes (consecutive gallery shards, each decoded alone; one task and "
                                   "one vectors shard per group, one shard-range run's unit with fan-out).")
    bootstrap_resamples: int = Field(10000, ge=100, description="rde evaluate: bootstrap resamples of the "
                                     "queries for each 95 % interval.")
