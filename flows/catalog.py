"""Every pipeline's stages as the stages declare them: the one source of the stage tables of the
pipeline pages (``scripts/gen_reference.py`` writes them between generated-section markers) and of
``rde describe PIPELINE``.

A row is read from the stage objects of the flow's ``Pipeline``: its name, whether it works over its
whole input or per shard, its device (``resources``), its reads and writes, its declared ``config``
and whether it runs for every profile (``applies``). Nothing here is written by hand, except how to
build the pipelines whose stages follow a run (the training method, the evaluated models, the
queries to rerank): they are built with placeholders (``<objective>``, ``<model>``) in those names.

The reject reasons a stage can write are not declared by the stage: they are read from the reason
registry (``rde.common.reasons.meanings()``), whose entries name the stages that use each code (the
codes every stage must use, checked by the runner). ``REGISTRY_NAMES`` says how a name used there
maps to stages where it is not a stage name itself; ``tests/test_describe.py`` fails when the
registry names something that is neither a stage of a pipeline here nor in that map.
"""

from __future__ import annotations

import ast
import inspect
import re
import textwrap
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from typing import Any

from rde.common.reasons import meanings
from tasks.framework.stage import Pipeline, Stage

# a name in the registry's "stages" column → the stages it stands for (a name that is a stage's own
# name maps to itself); an empty tuple: a user of the code that is not a stage of any pipeline
REGISTRY_NAMES: dict[str, tuple[str, ...]] = {
    "tiers": ("qa-tiers", "adv-tier"),  # the generation checks of both tier stages (tasks/largefine/tier_stage.py)
    "motion clips": (),  # `rde clips motion` (entry/motion_clips.py): a tool, not a stage
}


@dataclass(frozen=True)
class StageRow:
    """One stage as declared: what the stage tables show."""

    name: str
    per_shard: bool
    device: str  # "cpu" or "gpu"
    holds_slot: bool  # a GPU stage's shard tasks hold a slot of the GPU concurrency limit
    batch_size: str | None  # the profile field that sets its batch size
    reads: tuple[str, ...]
    optional_reads: tuple[str, ...]
    writes: tuple[str, ...]
    rejects: str | None  # the write that holds its rejected rows
    shared: tuple[str, ...]  # writes shared by the profile's flows
    config: tuple[str, ...]
    reasons: tuple[str, ...]  # the reject reason codes the registry lists for it
    rejects_from_upstream: bool  # its rejects gather earlier stages'
    when: str | None  # the condition under which it runs, when not for every profile
    version: str

    @property
    def work(self) -> str:
        return "per shard" if self.per_shard else "whole"

    @property
    def device_text(self) -> str:
        text = self.device
        if self.device == "gpu" and self.per_shard and self.holds_slot:
            text += ", holds a slot"
        return text


@dataclass(frozen=True)
class PipelineTable:
    """A pipeline's stages in order, and the note on its placeholders when it has any."""

    name: str
    rows: tuple[StageRow, ...]
    note: str = ""


class UnknownPipeline(ValueError):
    """A pipeline name that is none of ``pipeline_names()``."""

    def __init__(self, name: str) -> None:
        self.name = name
        super().__init__(f"no pipeline {name!r}; the pipelines are: {', '.join(pipeline_names())}")


def _static(module: str) -> Callable[[], Pipeline]:
    return lambda: import_module(module).PIPELINE


def _training(flow: str, method: str) -> Callable[[], Pipeline]:
    def build() -> Pipeline:
        from tasks.training.features import TrainingFeatures
        from tasks.training.train import Train

        # the stage's cfg only feeds its key at run time; the declarations do not read it
        train = Train(method, None)  # type: ignore[arg-type]
        return Pipeline(flow, (TrainingFeatures(), train), until={"features": "training-features",
                                                                   "train": train.name})
    return build


def _rerank() -> Pipeline:
    from tasks.vedje.rerank import Rerank

    return Pipeline("rerank", (Rerank(None),))


@dataclass(frozen=True)
class _Model:
    """A stand-in for one evaluated model (a ``RetrieverSpec``): only what the stages name by."""

    text: str = "<model>"
    kind: str = "model"
    slug: str = "<model>"


@dataclass(frozen=True)
class _Plan:
    """A stand-in for an ``EvaluationPlan`` of one model: the folders the stages' names use."""

    models: tuple[_Model, ...] = (_Model(),)
    folder: str = "<benchmark>-<labels>"

    def model_folder(self, spec: _Model) -> str:
        return f"{self.folder}/{spec.slug}"

    def vectors_folder(self, spec: _Model) -> str:
        return f"<benchmark>/{spec.slug}"


def _evaluate() -> Pipeline:
    from tasks.evaluation import FLOW_NAME
    from tasks.evaluation.compare import Compare
    from tasks.evaluation.embed_gallery import EmbedGallery
    from tasks.evaluation.score_model import ScoreModel

    plan, model = _Plan(), _Model()
    return Pipeline(FLOW_NAME, (EmbedGallery(model, plan), ScoreModel(model, plan),  # type: ignore[arg-type]
                                Compare(plan)))  # type: ignore[arg-type]


# pipeline name → how to build it and the note on its placeholders; in the order of the docs' pages
PIPELINES: dict[str, tuple[Callable[[], Pipeline], str]] = {
    "build-secmm": (_static("flows.build_secmm"), ""),
    "build-largefine": (_static("flows.build_largefine"), ""),
    "train-saft": (_training("train-saft", "<objective>"),
                   "`<objective>` is `training.saft_objective` (`train_saft`, `train_itc`, ...)."),
    "train-gtr": (_training("train-gtr", "gtr-<weighting>"),
                  "`<weighting>` is `training.gtr_weighting` (`train_gtr-ada`, ...)."),
    "train-vedje": (_static("flows.train_vedje"), ""),
    "index-cache": (_static("flows.index_cache"), ""),
    "rerank": (_rerank, ""),
    "evaluate": (_evaluate, "Two stages per evaluated model (`<model>`: its slug; a scores file has no "
                            "`embed-gallery` stage), then one `compare`; `<benchmark>` and `<labels>` name the "
                            "benchmark and its label set."),
}


def pipeline_names() -> tuple[str, ...]:
    return tuple(PIPELINES)


def pipeline(name: str) -> Pipeline:
    """The pipeline ``name`` as its flow builds it (with placeholders where its stages follow the run)."""
    if name not in PIPELINES:
        raise UnknownPipeline(name)
    return PIPELINES[name][0]()


def registry_stages(entry: str) -> tuple[str, ...]:
    """The stage names one "stages" cell of the reason registry names (``"videos (tracks)"`` is the
    stage ``videos``; ``REGISTRY_NAMES`` maps the names that are not a stage's own)."""
    out: list[str] = []
    for part in entry.split(","):
        name = re.sub(r"\s*\(.*?\)\s*$", "", part.strip())
        out += REGISTRY_NAMES.get(name, (name,))
    return tuple(out)


def stage_reasons(stage: str) -> tuple[str, ...]:
    """The reason codes the registry lists for ``stage``, in the registry's order (the declared codes
    after the shared ones)."""
    return tuple(str(code) for code, (stages, _) in meanings().items() if stage in registry_stages(stages))


def _when(stage: Stage) -> str | None:
    """The condition of a stage that does not run for every profile: the expression its ``applies``
    returns (``input.kind == "video"``), or a plain word when it is more than one ``return``."""
    method = type(stage).applies
    if method is Stage.applies:
        return None
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(method))).body[0].body  # type: ignore[attr-defined]
    except (OSError, TypeError, SyntaxError):
        return "for some profiles"
    body = [n for n in body if not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return "for some profiles"
    expr = body[0].value
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id == "bool" and expr.args:
        expr = expr.args[0]
    return re.sub(r"\bprofile\.", "", ast.unparse(expr)).replace("'", '"')


def stage_row(stage: Stage) -> StageRow:
    res = stage.resources
    return StageRow(
        name=stage.name, per_shard=stage.per_shard, device=res.device, holds_slot=res.hold_slot,
        batch_size=res.batch_size, reads=tuple(stage.reads), optional_reads=tuple(stage.optional_reads),
        writes=tuple(w.name for w in stage.writes), rejects=stage.rejects_write,
        shared=tuple(w.name for w in stage.writes if w.shared), config=tuple(stage.config),
        reasons=stage_reasons(stage.name), rejects_from_upstream=stage.rejects_from_upstream,
        when=_when(stage), version=stage.version)


def describe(name: str) -> PipelineTable:
    """The stage table of pipeline ``name``; ``UnknownPipeline`` (naming the known ones) otherwise."""
    found = pipeline(name)
    return PipelineTable(name, tuple(stage_row(s) for s in found.stages), PIPELINES[name][1])


def reads_text(row: StageRow, code: Callable[[str], str] = str) -> list[str]:
    """The reads of a row as shown: optional ones marked."""
    return [code(r) for r in row.reads] + [f"{code(r)} (optional)" for r in row.optional_reads]


def writes_text(row: StageRow, code: Callable[[str], str] = str) -> list[str]:
    """The writes of a row as shown: the rejects and shared ones marked."""
    out = []
    for w in row.writes:
        marks = [m for m, on in (("rejects", w == row.rejects), ("shared", w in row.shared)) if on]
        out.append(code(w) + (f" ({', '.join(marks)})" if marks else ""))
    return out


def reasons_text(row: StageRow, code: Callable[[str], str] = str) -> list[str]:
    """The reasons of a row as shown, and a note when its rejects gather earlier stages'."""
    out = [code(r) for r in row.reasons]
    if row.rejects_from_upstream:
        out.append("those of the earlier stages it gathers")
    return out


def as_dict(table: PipelineTable) -> dict[str, Any]:
    """The table as plain data (``rde describe --json``)."""
    return {"pipeline": table.name, "note": table.note,
            "stages": [{"name": r.name, "work": r.work, "device": r.device, "holds_slot": r.holds_slot,
                        "batch_size": r.batch_size, "reads": list(r.reads), "optional_reads": list(r.optional_reads),
                        "writes": list(r.writes), "rejects": r.rejects, "shared": list(r.shared),
                        "config": list(r.config), "reasons": list(r.reasons),
                        "rejects_from_upstream": r.rejects_from_upstream, "when": r.when, "version": r.version}
                       for r in table.rows]}
