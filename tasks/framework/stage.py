"""The stage contract: what a stage is, so that one lifecycle (``runner.py``) can run any of them.

A stage declares its name and own version, the artifacts it reads (by name, written by an earlier
stage of its pipeline) and writes (one name each, a kind and a schema; one of them may hold its
rejected rows), the profile config it uses (which is all it can read of the profile), what its
``lineage`` prepares for its work (``prepares``, a type), the resources it needs and whether every
input must end as one accepted or one rejected row (``balance``). Its work is either over the
whole input (``run``: k-means, kNN, a gallery draw; it may still return several shards, streamed)
or per shard (``shard_count`` + ``process``: one Prefect task each). Measure-then-decide is two
stages. Everything else (content key, skip when complete, shard resume, writing, manifests, the
balance check, Prefect tables and progress, the log line) is the runner's. A stage never builds
a key or a manifest.

Adding a stage to a flow is: subclass ``Stage`` in a module of its own
(``tasks/<pipeline>/<stage>.py``), add an instance to the flow's list (docs/adding-a-stage.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import pyarrow as pa

from models.backends.registry import ModelRegistry
from models.domains import DomainSet
from models.specs import ModelsSection
from storage import Artifact
from tasks.framework.context import RunContext


@dataclass(frozen=True)
class Write:
    """One artifact a stage writes: ``<flow root>/<name>``, of ``kind`` (the artifact type its
    manifest records: ``tier_captions``, ``rejects``), rows of ``schema``. ``name`` is its one name:
    its folder, the key of its table in the stage's ``Work`` and of its artifact in run summaries,
    and what later stages ``read``."""

    name: str
    kind: str
    schema: pa.Schema
    rejects: bool = False  # this artifact holds the stage's rejected rows (one ``reason`` each)
    # shared by the profile's flows: written once per stage key under ``shared/<profile>/<name>/<key>``
    # (``RunContext.shared_url``), so two flows running the same stage on the same inputs compute it once
    shared: bool = False


@dataclass(frozen=True)
class Resources:
    """What a stage's work needs, recorded in its manifests (``config.resources``). ``device="gpu"``:
    its shard tasks carry the profile's GPU tag (``prefect.gpu_concurrency_limit``) and, with
    ``hold_slot``, hold one slot of that global concurrency limit while computing, so a pool's GPUs
    are never oversubscribed (a whole-input stage runs in the flow's own process). ``batch_size``
    names the profile field that sets its batch size; the manifest records the value used."""

    device: Literal["cpu", "gpu"] = "cpu"
    hold_slot: bool = True
    batch_size: str | None = None  # the profile field that sets its batch size, e.g. "models.detector.batch_size"


@dataclass
class Work:
    """What a stage's work returns: shards of tables by ``Write.name`` (one dict per shard, any
    iterable: a generator streams, so only one shard is held at a time) and the stage's own counts:
    ``input_rows`` (counted from what it read), ``accepted``, ``rejected`` (reason → count),
    optional ``splits`` and any extras (numbers are summed over shards; others are kept). A
    streaming stage may fill ``stats`` while its shards are consumed."""

    shards: Iterable[dict[str, pa.Table]]
    stats: dict[str, Any]

    @classmethod
    def one(cls, tables: dict[str, pa.Table], stats: dict[str, Any]) -> Work:
        """A stage whose every output is one shard."""
        return cls([tables], stats)


@dataclass
class Lineage:
    """What a stage's outputs depend on beyond its reads and config sections: the models (their
    lineage), prompt versions, other inputs (a caption file's path, a listing's fingerprint; kept in
    the manifest's ``config`` too, where readers such as the cache index check them) and upstream
    artifacts outside the flow's folder. All of it feeds the stage key and the manifest."""

    models: dict[str, Any] = field(default_factory=dict)
    prompts: dict[str, str] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    upstream: list[Artifact] = field(default_factory=list)


@dataclass(frozen=True)
class Report:
    """What a stage adds to its standard table and log line: more tables (key suffix, rows,
    description), markdown artifacts (key suffix, text, description) and a log line."""

    tables: Sequence[tuple[str, list[dict[str, Any]], str]] = ()
    markdown: Sequence[tuple[str, str, str]] = ()
    log: str = ""


class DeclaredFields:
    """A profile section as a stage that declared some of its fields sees it: those fields read
    through, any other is an error (it would change the stage's work without changing its key)."""

    def __init__(self, stage: str, name: str, section: Any, fields: set[str]) -> None:
        self._stage, self._name, self._section, self._fields = stage, name, section, frozenset(fields)

    def __getattr__(self, field_name: str) -> Any:
        if field_name.startswith("_"):
            raise AttributeError(field_name)
        if field_name not in self._fields:
            raise AttributeError(f"stage {self._stage!r} reads {self._name}.{field_name} without declaring it in "
                                 f"`config` (declared of {self._name}: {sorted(self._fields)}); an undeclared field "
                                 "is not in its key")
        return getattr(self._section, field_name)


class DeclaredProfile:
    """The profile as a stage sees it: its declared sections whole, its declared fields as a
    ``DeclaredFields`` view, and what every stage may read because it does not change rows or is
    keyed otherwise (``ALWAYS``: the profile's name and artifacts root, the models, whose lineage a
    stage keys through ``lineage``, and the Prefect settings). Any other section is an error: it
    would change the stage's work without changing its key."""

    ALWAYS = frozenset({"name", "artifacts_root", "models", "prefect"})

    def __init__(self, stage: str, profile: Any, config: Sequence[str]) -> None:
        self._stage, self._profile, self._config = stage, profile, tuple(config)

    def __getattr__(self, section: str) -> Any:
        if section.startswith("_"):
            raise AttributeError(section)
        if section in self.ALWAYS or section in self._config:
            return getattr(self._profile, section)
        fields = {c.partition(".")[2] for c in self._config if c.startswith(f"{section}.")}
        if fields:
            return DeclaredFields(self._stage, section, getattr(self._profile, section), fields)
        raise AttributeError(f"stage {self._stage!r} reads config section {section!r} without declaring it in "
                             f"`config` (declared: {list(self._config)}); an undeclared section is not in its key")

    def __reduce__(self) -> tuple[Any, ...]:  # pickled for a Dask worker: rebuilt from its parts
        return DeclaredProfile, (self._stage, self._profile, self._config)


class StageRun:
    """What a stage's work sees: its declared config sections, its reads as artifacts, the model
    registry, where its outputs go. ``prepared`` holds what ``lineage`` computed for the work to
    reuse (a listing, a loaded prompt): one value of the type the stage declares in ``prepares``
    (a dataclass of its own), checked by the runner."""

    def __init__(self, stage: Stage, ctx: RunContext) -> None:
        self.stage = stage
        self._profile = ctx.profile  # the whole profile: only config_dump reads it, for the declared entries
        # the run's context with the profile as the stage declared it: what a stage (and the helpers it
        # hands ``run.ctx``) reads of the profile is in its key, or an error
        self.ctx = replace(ctx, profile=DeclaredProfile(stage.name, ctx.profile, stage.config))
        self.prepared: Any = None
        self.key = ""  # the stage key, set by the runner before the work (e.g. to name checkpoints)
        # a retry of transient rejects: the ids (``stage.retry_by``) of the only inputs ``process`` works on
        self.retry_only: frozenset[str] | None = None

    def check_prepared(self) -> None:
        """Raise unless ``lineage`` left a value of the declared ``prepares`` type (or none, when the
        stage declares none)."""
        kind = self.stage.prepares
        if (kind is None) != (self.prepared is None) or (kind is not None and not isinstance(self.prepared, kind)):
            want = kind.__name__ if kind else "nothing"
            raise TypeError(f"stage {self.stage.name!r}: lineage() prepared {type(self.prepared).__name__}, the "
                            f"stage declares `prepares = {want}`")

    def section(self, name: str) -> Any:
        """The profile section ``name``; only a section the stage declares, whole or by field. A
        section declared by field comes as a view of those fields only (``DeclaredFields``): a field
        that is not in the stage's key cannot be read."""
        fields = {c.partition(".")[2] for c in self.stage.config if c.startswith(f"{name}.")}
        if name not in self.stage.config and not fields:
            raise KeyError(f"stage {self.stage.name!r} reads config section {name!r} without declaring it in "
                           f"`config` (declared: {self.stage.config}); undeclared sections are not in its key")
        return getattr(self.ctx.profile, name)

    @property
    def models(self) -> ModelsSection:
        """The models section: which models a stage uses goes in its key through ``lineage``."""
        return self.ctx.profile.models

    def registry(self) -> ModelRegistry:
        """The profile's models; those that measure the domains (``DOMAIN_BACKENDS``) key them in
        their ``lineage``, so the registry reads them from the whole profile."""
        return ModelRegistry(self.ctx.profile.models, self._profile.domain_set)

    @property
    def domains(self) -> DomainSet:
        """The profile's domains; the stage must declare ``domains`` (their files are in its key).
        One set per profile, so the layouts and word sets cached by it are built once."""
        self.section("domains")
        return self._profile.domain_set

    @property
    def profile_name(self) -> str:
        return self.ctx.profile.name

    @property
    def artifacts_root(self) -> str:
        return self.ctx.profile.artifacts_root

    def input(self, name: str) -> Artifact:
        """An artifact the stage reads (declared in ``reads`` or ``optional_reads``)."""
        if name not in self.stage.reads and name not in self.stage.optional_reads:
            raise KeyError(f"stage {self.stage.name!r} reads {name!r} without declaring it in `reads`")
        return Artifact(self.ctx.artifact_url(name))

    def output_url(self, folder: str) -> str:
        """Where something under the flow's folder lives (an output's folder or a parent of it)."""
        return self.ctx.artifact_url(folder)

    def output_artifact(self, name: str) -> Artifact:
        """One of the stage's own outputs, by its ``Write.name``."""
        found = [w for w in self.stage.writes if w.name == name]
        if not found:
            raise KeyError(f"stage {self.stage.name!r} writes no {name!r}")
        return Artifact(self.ctx.artifact_url(found[0].name))

    def config_dump(self) -> dict[str, Any]:
        """The declared config as plain data (in the key and the manifest): ``section`` whole,
        ``section.field`` that field only."""
        dumped: dict[str, Any] = {}
        for entry in self.stage.config:
            section, _, name = entry.partition(".")
            value = getattr(self._profile, section)
            if name:
                value = getattr(value, name)
            plain = [v.model_dump() for v in value] if isinstance(value, list) and value and hasattr(
                value[0], "model_dump") else (value.model_dump() if hasattr(value, "model_dump") else value)
            dumped[entry] = plain
        return dumped

class Stage:
    """One stage of a pipeline (see the module docstring). Subclasses set the class attributes and
    implement ``run`` (whole input) or ``shard_count`` + ``process`` (per shard)."""

    # name and writes may also be set per instance (a stage whose folders follow its configuration)
    name: str
    version: ClassVar[str]  # bump when the stage changes what it writes: it and its readers rerun
    reads: ClassVar[tuple[str, ...]] = ()
    optional_reads: ClassVar[tuple[str, ...]] = ()  # in the key when complete (e.g. people's decisions)
    writes: tuple[Write, ...]
    config: ClassVar[tuple[str, ...]] = ()  # profile sections ("sampling") or fields ("queries.seed") it uses
    resources: ClassVar[Resources] = Resources()
    balance: ClassVar[bool] = False
    rejects_from_upstream: ClassVar[bool] = False  # its rejects gather earlier stages' (counted there)
    main: ClassVar[str | None] = None  # the write whose manifest holds the stats (default: the first)
    prepares: ClassVar[type | None] = None  # the type of what ``lineage`` prepares for the work (``run.prepared``)
    title: ClassVar[str] = ""  # the stage table's description in the Prefect UI
    row_unit: ClassVar[str] = "rows"  # what one input row is ("images"): the progress line's rate counts them
    # the column holding one input's id in every output: a per-shard stage that sets it can redo the inputs
    # rejected for a transient reason (``--retry-rejects``, tasks/framework/retry.py); ``process`` then
    # reads ``run.retry_only`` and works on those inputs only
    retry_by: ClassVar[str | None] = None

    def removed_stats(self, removed: dict[str, pa.Table]) -> dict[str, Any]:
        """What the rows ``removed`` (by write name) of a retried shard contributed to the shard's own
        derived counts besides accepted and rejected (e.g. words counted over its captions), so the
        retried shard no longer counts them. Work counters (calls, seconds) are not: they add up."""
        return {}

    @property
    def main_write(self) -> str:
        return self.main or self.writes[0].name

    @property
    def rejects_write(self) -> str | None:
        found = [w.name for w in self.writes if w.rejects]
        return found[0] if found else None

    @property
    def per_shard(self) -> bool:
        return type(self).process is not Stage.process

    def applies(self, profile: Any) -> bool:
        """Whether the stage runs for this profile (the videos stage only for video input); a stage
        that does not apply is left out of the run: no key, no table, no summary line."""
        return True

    def fans_out(self, run: StageRun) -> bool:
        """Whether this run of a per-shard stage may fan out over a pool when the profile fans out
        its device's stages (a stage whose shards share one costly step over the whole input, such
        as an index built over every row, says no for the runs where it has one)."""
        return True

    def lineage(self, run: StageRun) -> Lineage:
        """Models, prompts and other inputs the outputs depend on (called once, before the work). What
        it computed that the work reuses goes in ``run.prepared``, a value of type ``prepares``."""
        return Lineage()

    def run(self, run: StageRun) -> Work:
        """The work over the whole input."""
        raise NotImplementedError(f"stage {self.name!r} implements neither run() nor process()")

    def shard_count(self, run: StageRun) -> int:
        raise NotImplementedError(f"stage {self.name!r} processes per shard but has no shard_count()")

    def process(self, run: StageRun, index: int) -> Work:
        """The work on shard ``index`` (a Prefect task; may run in another process)."""
        raise NotImplementedError

    def report(self, run: StageRun, result: Any) -> Report:
        """More tables and a log line after the stage ran or was skipped (``result``: its StageResult)."""
        return Report()


class WiringError(ValueError):
    """A pipeline whose stages do not fit together (a read nobody writes first, a name twice)."""


@dataclass(frozen=True)
class Pipeline:
    """A flow's stages in order. ``until`` maps the flow's stop names (``--until``) to the stage
    they stop after; a stage's own name works too. Checked on creation: every read is written by
    an earlier stage, names and folders are unique."""

    name: str
    stages: tuple[Stage, ...]
    until: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise WiringError(f"{self.name}: stage names repeat: {names}")
        written: dict[str, str] = {}
        for stage in self.stages:
            for name in stage.reads:
                if name not in written:
                    raise WiringError(f"{self.name}: stage {stage.name!r} reads {name!r}, which no earlier stage "
                                      f"writes (written before it: {sorted(written)})")
            for w in stage.writes:
                if w.name in written:
                    raise WiringError(f"{self.name}: {w.name!r} is written by {written[w.name]!r} and "
                                      f"{stage.name!r}")
                written[w.name] = stage.name
        unknown = {k: v for k, v in self.until.items() if v not in names}
        if unknown:
            raise WiringError(f"{self.name}: until names stages it does not have: {unknown}")

    @property
    def stop_names(self) -> tuple[str, ...]:
        """What ``--until`` accepts: the flow's stop names, then every stage's name."""
        return tuple(dict.fromkeys([*self.until, *(s.name for s in self.stages)]))

    def upto(self, until: str | None) -> tuple[Stage, ...]:
        """The stages a run with ``until`` runs: a prefix of the list (of which only those that
        ``apply`` to the profile run)."""
        if until is None:
            return self.stages
        last = self.until.get(until, until)
        names = [s.name for s in self.stages]
        if last not in names:
            raise ValueError(f"until must be one of {self.stop_names}, got {until!r}")
        return self.stages[: names.index(last) + 1]
