"""The stage contract and its one runner, on a toy pipeline: a stage is a small class, a flow is a
list of stages; keys, skip, per-stage versions, per-field config keys, balance and wiring are the
runner's. Adding a stage is writing it and adding it to the list."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from prefect import flow

from rde.common.reasons import Reason, known_codes, meanings, reasons_markdown
from rde.profile import load_profile
from storage import Artifact
from tasks.framework.accounting import AccountingError, UnregisteredReason
from tasks.framework.context import RunContext
from tasks.framework.runner import MissingInput, artifact_key, run_pipeline, run_stage
from tasks.framework.stage import Lineage, Pipeline, Resources, Stage, StageRun, WiringError, Work, Write

NUMBERS = pa.schema([pa.field("n", pa.int64(), nullable=False)])
REJECTS = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("reason", pa.string(), nullable=False)])
CALLS: list[str] = []


class Numbers(Stage):
    """0..count-1, where ``count`` comes from a config field (queries.per_request)."""

    name = "numbers"
    version = "1"
    writes = (Write("numbers", "numbers", NUMBERS),)
    config = ("queries.per_request",)

    def run(self, run: StageRun) -> Work:
        CALLS.append(self.name)
        count = run.section("queries").per_request
        return Work.one({"numbers": pa.table({"n": list(range(count))}, schema=NUMBERS)},
                        {"input_rows": count, "accepted": count})


class Evens(Stage):
    """Keeps even numbers; odd ones are rejected rows with a reason. Per shard (two shards)."""

    name = "evens"
    version = "1"
    reads = ("numbers",)
    writes = (Write("evens", "numbers", NUMBERS), Write("odd", "rejects", REJECTS, rejects=True))
    balance = True
    resources = Resources(device="gpu", hold_slot=False, batch_size="queries.per_request")
    lose_one = False  # a bug to plant: drop one accepted row on the floor
    reason = "wrong_category"  # a registered code (rde/common/reasons.py)

    def shard_count(self, run: StageRun) -> int:
        return 2

    def process(self, run: StageRun, index: int) -> Work:
        CALLS.append(f"{self.name}-{index}")
        values = sorted(run.input("numbers").to_pandas().n.tolist())
        mine = values[index::2]
        kept = [n for n in mine if n % 2 == 0][: None if not self.lose_one else -1]
        odd = [n for n in mine if n % 2]
        return Work.one({"evens": pa.table({"n": kept}, schema=NUMBERS),
                         "odd": pa.table({"n": odd, "reason": [self.reason] * len(odd)}, schema=REJECTS)},
                        {"input_rows": len(mine), "accepted": len(kept),
                         "rejected": {self.reason: len(odd)} if odd else {}})


class Squares(Stage):
    """The example of adding a stage: write it, add it to the list."""

    name = "squares"
    version = "1"
    reads = ("evens",)
    writes = (Write("squares", "numbers", NUMBERS),)

    def lineage(self, run: StageRun) -> Lineage:
        return Lineage(extra={"power": 2})

    def run(self, run: StageRun) -> Work:
        CALLS.append(self.name)
        values = run.input("evens").to_pandas().n.tolist()
        return Work.one({"squares": pa.table({"n": [v * v for v in values]}, schema=NUMBERS)},
                        {"input_rows": len(values), "accepted": len(values)})


def _ctx(tmp_path: Path, **queries: int) -> RunContext:
    return RunContext(load_profile("demo", {"queries": queries} if queries else None), "toy", str(tmp_path))


@flow(name="toy", validate_parameters=False)
def _in_flow(body: Callable[[], Any]) -> Any:
    """Per-shard stages submit Prefect tasks: they run inside a flow."""
    return body()


def _pipeline(ctx: RunContext, pipeline: Pipeline, until: str | None = None) -> list:
    return _in_flow(lambda: run_pipeline(ctx, pipeline, until))


def _ran(results: list) -> list[str]:
    return [r.stage for r in results if not r.skipped]


def test_a_pipeline_runs_skips_and_reruns_only_what_a_change_touches(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    toy = Pipeline("toy", (Numbers(), Evens()), until={"first": "numbers"})
    CALLS.clear()
    results = _pipeline(_ctx(tmp_path, per_request=7), toy)
    assert [(r.stage, r.input_rows, r.accepted, r.rejected, r.balanced) for r in results] == [
        ("numbers", 7, 7, {}, None), ("evens", 7, 4, {"wrong_category": 3}, True)]
    assert sorted(Artifact(str(tmp_path / "toy" / "demo" / "evens")).to_pandas().n) == [0, 2, 4, 6]
    assert sorted(Artifact(str(tmp_path / "toy" / "demo" / "odd")).to_pandas().n) == [1, 3, 5]
    # the manifest records the declared config and resources (the batch size read from its field)
    config = Artifact(str(tmp_path / "toy" / "demo" / "evens")).manifest().config
    assert config["resources"] == {"device": "gpu", "holds_gpu_slot": False,
                                   "batch_size_field": "queries.per_request", "batch_size": 7}
    # the same inputs: everything skipped, nothing computed
    CALLS.clear()
    assert _ran(_pipeline(_ctx(tmp_path, per_request=7), toy)) == [] and CALLS == []
    # a field the first stage does not declare (queries.per_domain) is not in its key
    assert _ran(_pipeline(_ctx(tmp_path, per_request=7, per_domain=3), toy)) == []
    # the field it declares is: both stages rerun
    assert _ran(_pipeline(_ctx(tmp_path, per_request=9), toy)) == ["numbers", "evens"]
    # adding a stage is adding it to the list: only it runs
    grown = Pipeline("toy", (Numbers(), Evens(), Squares()))
    CALLS.clear()
    results = _pipeline(_ctx(tmp_path, per_request=9), grown)
    assert _ran(results) == ["squares"] and CALLS == ["squares"]
    assert sorted(Artifact(str(tmp_path / "toy" / "demo" / "squares")).to_pandas().n) == [0, 4, 16, 36, 64]
    # a version bump reruns that stage and its readers, nothing upstream
    monkeypatch.setattr(Evens, "version", "2")
    assert _ran(_pipeline(_ctx(tmp_path, per_request=9), grown)) == ["evens", "squares"]
    # --until is a slice of the list, by stop name or by stage name
    assert [s.name for s in toy.upto("first")] == ["numbers"]
    assert [s.name for s in grown.upto("evens")] == ["numbers", "evens"]
    with pytest.raises(ValueError, match="until must be one of"):
        grown.upto("nothing")


class SharedNumbers(Numbers):
    """``Numbers`` with its output shared by the profile's flows (content-addressed)."""

    name = "shared-numbers"
    writes = (Write("numbers", "numbers", NUMBERS, shared=True),)


def test_a_shared_output_is_computed_once_for_two_flows_and_read_where_it_lies(tmp_path: Path) -> None:
    first, second = (RunContext(load_profile("demo", {"queries": {"per_request": 6}}), flow, str(tmp_path))
                     for flow in ("flow-a", "flow-b"))
    toy = Pipeline("toy", (SharedNumbers(), Evens()))
    CALLS.clear()
    a = _pipeline(first, toy)
    b = _pipeline(second, toy)
    # the second flow skips the shared stage and reads the first one's numbers; its own stage runs
    assert _ran(a) == ["shared-numbers", "evens"] and _ran(b) == ["evens"]
    assert CALLS.count("shared-numbers") == 1
    url = a[0].artifacts["numbers"]
    assert url == b[0].artifacts["numbers"] and "/shared/demo/numbers/" in url
    assert not (tmp_path / "flow-a" / "demo" / "numbers").exists()
    assert sorted(Artifact(str(tmp_path / "flow-b" / "demo" / "evens")).to_pandas().n) == [0, 2, 4]
    # another config is another key: another folder, the first one kept for the flow still using it
    third = RunContext(load_profile("demo", {"queries": {"per_request": 4}}), "flow-b", str(tmp_path))
    c = _pipeline(third, toy)
    assert _ran(c) == ["shared-numbers", "evens"] and c[0].artifacts["numbers"] != url
    assert Artifact(url).is_complete() and sorted(Artifact(str(tmp_path / "flow-b" / "demo" / "evens"))
                                                  .to_pandas().n) == [0, 2]


def test_the_runner_refuses_a_stage_that_loses_a_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(tmp_path, per_request=6)
    run_stage(ctx, Numbers())
    monkeypatch.setattr(Evens, "lose_one", True)
    with pytest.raises(AccountingError, match="rows lost"):
        _in_flow(lambda: run_stage(ctx, Evens()))
    assert not Artifact(str(tmp_path / "toy" / "demo" / "evens")).is_complete()


def test_the_runner_refuses_a_reason_code_the_registry_does_not_list(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    ctx = _ctx(tmp_path, per_request=6)
    run_stage(ctx, Numbers())
    monkeypatch.setattr(Evens, "reason", "odd")
    with pytest.raises(UnregisteredReason, match=r"codes \['odd'\] that rde/common/reasons.py does not register"):
        _in_flow(lambda: run_stage(ctx, Evens()))
    assert not Artifact(str(tmp_path / "toy" / "demo" / "evens")).is_complete()


def test_every_reason_is_registered_with_its_meaning_and_listed_in_the_docs() -> None:
    assert set(Reason) <= known_codes()
    assert {"check_set_identity", "over_max_pairs"} <= known_codes() - set(Reason)  # declared beside their logic
    assert all(stages and len(meaning) > 10 for stages, meaning in meanings().values())
    page = (Path(__file__).parents[1] / "docs" / "reference" / "reasons.md").read_text(encoding="utf-8")
    assert reasons_markdown() in page, ("docs/reference/reasons.md differs from rde.common.reasons.reasons_markdown(): "
                                        "run scripts/gen_reference.py")


def _entry_script_reasons() -> dict[str, set[str]]:
    """Reason codes the entry scripts (entry/*.py) write without a stage's runner to check them:
    string keys of a ``rejected``/``rejects`` counter (``rejected["no_motion"] += 1``) and the
    reason argument of ``rejected_row``/``reject_row`` calls, per file."""
    import ast

    found: dict[str, set[str]] = {}
    for path in sorted((Path(__file__).parents[1] / "entry").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            codes: list[Any] = []
            if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):  # written, not read
                target = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
                if "reject" in target:
                    codes.append(node.slice)
            elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "rejected_row", "reject_row"):
                codes += node.args[2:3] + [k.value for k in node.keywords if k.arg in ("reason", "reasons")]
            for code in codes:
                values = code.elts if isinstance(code, ast.List) else [code]
                found.setdefault(path.name, set()).update(
                    v.value for v in values if isinstance(v, ast.Constant) and isinstance(v.value, str))
    return found


def test_every_reason_an_entry_script_writes_is_registered() -> None:
    """The runner checks a stage's reasons; an entry script's counts (a motion clip set's) reach a
    stage later (vedje-features) or a report unchecked, so their codes are checked here."""
    from rde.common.reasons import unregistered

    found = _entry_script_reasons()
    assert {"no_motion", "split_gap"} <= found.get("motion_clips.py", set()), found  # the scan sees them
    assert {name: unregistered(codes) for name, codes in found.items() if unregistered(codes)} == {}


def test_a_stage_reads_only_what_it_declares(tmp_path: Path) -> None:
    ctx = _ctx(tmp_path)
    with pytest.raises(MissingInput, match=r"needs \['numbers'\]"):
        run_stage(ctx, Evens())  # nothing wrote numbers yet
    run = StageRun(Numbers(), ctx)
    with pytest.raises(KeyError, match="without declaring it"):
        run.section("sampling")
    with pytest.raises(KeyError, match="without declaring it"):
        run.input("gallery")
    assert run.config_dump() == {"queries.per_request": ctx.profile.queries.per_request}
    # declared by field: that field reads through; another field of the section is not in the key
    queries = run.section("queries")
    assert queries.per_request == ctx.profile.queries.per_request
    with pytest.raises(AttributeError, match=r"reads queries.seed without declaring it"):
        _ = queries.seed
    # the profile the stage (and every helper it hands ``run.ctx``) sees is the declared one
    assert run.ctx.profile.queries.per_request == ctx.profile.queries.per_request
    assert run.ctx.profile.models is ctx.profile.models and run.ctx.root == ctx.root
    with pytest.raises(AttributeError, match=r"reads config section 'sampling' without declaring it"):
        _ = run.ctx.profile.sampling
    with pytest.raises(AttributeError, match=r"reads queries.seed without declaring it"):
        _ = run.ctx.profile.queries.seed
    import pickle

    again = pickle.loads(pickle.dumps(run.ctx))  # a shard task's run travels to a Dask worker
    assert again.profile.queries.per_request == ctx.profile.queries.per_request


def test_what_lineage_prepares_is_of_the_type_the_stage_declares(tmp_path: Path) -> None:
    """``prepares`` names the type of ``run.prepared``: a stage that prepares something else, or
    prepares nothing when it declares a type, is stopped before its work."""
    from dataclasses import dataclass

    from tasks.framework.runner import prepare_stage

    @dataclass(frozen=True)
    class Plan:
        rows: int

    class Planned(Numbers):
        name = "planned"
        prepares = Plan
        made: object = Plan(3)

        def lineage(self, run: StageRun) -> Lineage:
            run.prepared = self.made
            return Lineage()

    ctx = _ctx(tmp_path)
    assert prepare_stage(ctx, Planned()).run.prepared == Plan(3)
    Planned.made = {"rows": 3}  # the untyped dict it replaces
    with pytest.raises(TypeError, match=r"stage 'planned': lineage\(\) prepared dict, the stage declares "
                                        r"`prepares = Plan`"):
        prepare_stage(ctx, Planned())
    with pytest.raises(TypeError, match=r"prepared Plan, the stage declares `prepares = nothing`"):
        prepare_stage(ctx, type("Unplanned", (Planned,), {"prepares": None, "name": "unplanned", "made": Plan(3)})())


def test_artifact_keys_are_what_prefect_accepts() -> None:
    """A stage named after its method (``train_saft``) still publishes under a valid key."""
    assert artifact_key("train-saft", "train_saft") == "train-saft-train-saft"
    assert artifact_key("build-secmm", "cgds-clusters") == "build-secmm-cgds-clusters"


def test_a_pipeline_that_does_not_fit_together_is_refused() -> None:
    with pytest.raises(WiringError, match="reads 'evens', which no earlier stage writes"):
        Pipeline("toy", (Numbers(), Squares(), Evens()))
    with pytest.raises(WiringError, match="stage names repeat"):
        Pipeline("toy", (Numbers(), Numbers()))
    with pytest.raises(WiringError, match="until names stages it does not have"):
        Pipeline("toy", (Numbers(),), until={"x": "evens"})


def test_every_rejects_artifact_of_every_flow_has_the_one_schema() -> None:
    """One rejects contract: each stage's rejected rows go to an artifact of ``REJECTS``, made by
    ``rejected_row`` (which refuses an unknown kind)."""
    from flows.build_largefine import PIPELINE as LARGEFINE
    from flows.build_secmm import PIPELINE as SECMM
    from flows.train_vedje import PIPELINE as VEDJE
    from rde.common.reasons import rejected_row
    from storage.schemas import REJECTS

    rejects = [(s.name, w) for p in (SECMM, LARGEFINE, VEDJE) for s in p.stages for w in s.writes if w.rejects]
    assert len(rejects) >= 9
    assert [name for name, w in rejects if not w.schema.equals(REJECTS) or w.kind != "rejects"] == []
    row = rejected_row("q-1", "dap", "near_duplicate", kind="query", domain="vehicle", text="a red car")
    assert pa.Table.from_pylist([row], schema=REJECTS).num_rows == 1 and row["all_reasons"] == ["near_duplicate"]
    with pytest.raises(ValueError, match="kind 'line' is not one of"):
        rejected_row("q-1", "dap", "near_duplicate", kind="line")


def test_build_secmm_is_a_list_of_stages_that_fits_together() -> None:
    from flows.build_secmm import PIPELINE

    assert [s.name for s in PIPELINE.stages] == ["videos", "ingest", "measure", "denoise", "near-duplicates",
                                                 "caption-pool", "caption-stats", "dap", "cgds", "mecf", "export",
                                                 "evaluate"]
    assert [s.name for s in PIPELINE.upto("queries")][-1] == "dap"
    assert all(s.version and s.writes for s in PIPELINE.stages)
