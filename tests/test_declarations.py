"""A stage's profile section and its own reason codes are declared beside its logic and found
without a central list: adding a stage is its logic module, its stage module, one line in the
pipeline's stage list and its test (docs/adding-a-stage.md)."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import yaml

import rde.profile
from rde.common import declarations, reasons
from rde.common.declarations import REASON_MARKER, SECTION_MARKER, DeclarationError, declaring_modules, profile_section
from rde.common.reasons import Reason, declare_reason, known_codes, reasons_markdown, unregistered
from storage import Artifact
from tasks.framework.context import RunContext
from tasks.framework.runner import run_pipeline
from tasks.framework.stage import Pipeline

ROOT = Path(__file__).resolve().parents[1]

LOGIC = '''
"""Keep the numbers below ``toy_parity.count`` of one parity (the toy's logic)."""
from pydantic import Field
from models.specs import Strict
from rde.common.declarations import profile_section
from rde.common.reasons import declare_reason

WRONG_PARITY = declare_reason("wrong_parity", "toy-parity", "a number of the other parity than toy_parity.keep")


@profile_section("toy_parity", "The toy stage's parity filter.")
class ParitySpec(Strict):
    """Which numbers the toy stage keeps."""

    count: int = Field(10, ge=0, description="Numbers 0..count-1 are its input.")
    keep: str = Field("even", pattern="^(even|odd)$", description="The parity kept.")


def split(numbers, spec):
    want = 0 if spec.keep == "even" else 1
    return [n for n in numbers if n % 2 == want], [n for n in numbers if n % 2 != want]
'''

STAGE = '''
import pyarrow as pa
from tasks.framework.stage import Stage, StageRun, Work, Write
from TOYLOGIC.parity import WRONG_PARITY, split

NUMBERS = pa.schema([pa.field("n", pa.int64(), nullable=False)])
REJECTS = pa.schema([pa.field("n", pa.int64(), nullable=False), pa.field("reason", pa.string(), nullable=False)])


class ToyParity(Stage):
    """Keep one parity; the other is rejected."""

    name = "toy-parity"
    version = "1"
    writes = (Write("kept", "numbers", NUMBERS), Write("wrong", "rejects", REJECTS, rejects=True))
    config = ("toy_parity",)
    balance = True

    def run(self, run: StageRun) -> Work:
        spec = run.section("toy_parity")
        kept, wrong = split(range(spec.count), spec)
        return Work.one({"kept": pa.table({"n": kept}, schema=NUMBERS),
                         "wrong": pa.table({"n": wrong, "reason": [WRONG_PARITY] * len(wrong)}, schema=REJECTS)},
                        {"input_rows": spec.count, "accepted": len(kept),
                         "rejected": {WRONG_PARITY: len(wrong)} if wrong else {}})
'''

STAGE_LIST = '''
from TOYTASKS.parity import ToyParity
STAGES = (ToyParity(),)
'''


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """The registries as copies, so what a test declares is gone after it (the bundled modules'
    declarations made first: a module first imported into a copy would not declare again)."""
    declarations.import_declaring(SECTION_MARKER)
    declarations.import_declaring(REASON_MARKER)
    monkeypatch.setattr(declarations, "SECTIONS", dict(declarations.SECTIONS))
    monkeypatch.setattr(declarations, "_imported", set())
    monkeypatch.setattr(reasons, "MEANINGS", dict(reasons.MEANINGS))
    monkeypatch.setattr(reasons, "TRANSIENT", set(reasons.TRANSIENT))
    monkeypatch.setattr(reasons, "_DECLARED", set(reasons._DECLARED))


def test_a_stage_written_in_its_own_files_is_configured_run_and_documented(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registries: None) -> None:
    logic, tasks = f"toylogic_{tmp_path.name}", f"toytasks_{tmp_path.name}"
    for package, files in ((logic, {"parity.py": LOGIC}),
                           (tasks, {"parity.py": STAGE.replace("TOYLOGIC", logic),
                                    "__init__.py": STAGE_LIST.replace("TOYTASKS", tasks)})):
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").touch()
        for name, text in files.items():
            (tmp_path / package / name).write_text(textwrap.dedent(text), encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(declarations, "DECLARING_PACKAGES", (*declarations.DECLARING_PACKAGES, logic))
    # found by its source: nothing has imported it yet
    assert declaring_modules(SECTION_MARKER)[-1] == f"{logic}.parity" and f"{logic}.parity" not in sys.modules
    assert f"{logic}.parity" in declaring_modules(REASON_MARKER)

    monkeypatch.setattr(rde.profile, "Profile", rde.profile.compose_profile())
    assert "toy_parity" in rde.profile.Profile.model_fields
    data = yaml.safe_load((ROOT / "profiles" / "demo.yaml").read_text(encoding="utf-8"))
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump({**data, "toy_parity": {"count": 7}}), encoding="utf-8")
    profile = rde.profile.load_profile(str(path), {"toy_parity": {"keep": "odd"}})  # a --set override
    assert (profile.toy_parity.count, profile.toy_parity.keep) == (7, "odd")
    with pytest.raises(rde.profile.ProfileError, match=r"toy_parity\.keep: String should match"):
        rde.profile.load_profile(str(path), {"toy_parity": {"keep": "both"}})
    assert rde.profile.load_profile("demo").toy_parity.count == 10  # unset: the section's defaults

    stages = __import__(tasks).STAGES
    (result,) = run_pipeline(RunContext(profile, "toy", str(tmp_path / "artifacts")), Pipeline("toy", stages), None)
    assert (result.stats["accepted"], result.stats["rejected"]) == (3, {"wrong_parity": 4})
    rejected = Artifact(str(tmp_path / "artifacts" / "toy" / profile.name / "wrong")).rows()
    assert [(r["n"], r["reason"]) for r in rejected] == [(n, "wrong_parity") for n in (0, 2, 4, 6)]
    assert unregistered(["wrong_parity"]) == []
    assert ("| `wrong_parity` | toy-parity | a number of the other parity than toy_parity.keep |"
            in reasons_markdown())


def test_the_bundled_declarations_are_found() -> None:
    assert declaring_modules(SECTION_MARKER) == ["rde.secmm.cgds", "rde.secmm.mecf", "rde.secmm.near_duplicates"]
    assert "near_duplicates" in rde.profile.Profile.model_fields
    assert rde.profile.Profile.model_fields["near_duplicates"].annotation.__module__ == "rde.secmm.near_duplicates"
    assert "rde.training.pair_selection" in declaring_modules(REASON_MARKER)
    assert unregistered(["over_max_pairs", "check_set_identity", "near_duplicate", "made_up"]) == ["made_up"]


def test_a_declaration_twice_or_misnamed_is_refused(registries: None) -> None:
    class One(rde.profile.ProfileCore.__base__):  # a Strict model
        pass

    class Other(rde.profile.ProfileCore.__base__):
        pass

    profile_section("toy_once", "Once.")(One)
    profile_section("toy_once", "Once.")(One)  # the same model again (a module imported twice): fine
    with pytest.raises(DeclarationError, match="declared twice"):
        profile_section("toy_once", "Twice.")(Other)
    with pytest.raises(DeclarationError, match="lower-case"):
        profile_section("Toy-Section", "Bad name.")
    assert declare_reason("toy_code", "toy", "a code the toy declares") == "toy_code"
    assert declare_reason("toy_code", "toy", "a code the toy declares") == "toy_code"  # imported twice
    assert reasons.MEANINGS["toy_code"] == ("toy", "a code the toy declares")
    declare_reason("toy_code", "toy-two", "what it means for the second stage")  # a second use
    assert reasons.MEANINGS["toy_code"] == ("toy, toy-two",
                                            "a code the toy declares; what it means for the second stage")
    before = reasons.MEANINGS["blurry"]
    declare_reason(Reason.BLURRY, "toy", "a toy image below its sharpness bound")  # a shared code reused
    assert reasons.MEANINGS["blurry"] == (f"{before[0]}, toy", f"{before[1]}; a toy image below its sharpness bound")
    with pytest.raises(ValueError, match="lower-case"):
        declare_reason("Toy Code", "toy", "a code no column can hold")
    assert declare_reason("toy_flaky", "toy", "may pass on another try", transient=True) in reasons.TRANSIENT


def test_a_reused_shared_code_reads_as_one_row_for_both_stages() -> None:
    """near-duplicates declares its use of DAP's code beside its logic; the row is the one the
    registry held when both uses were written in it."""
    assert known_codes() >= {"near_duplicate"}
    assert reasons.MEANINGS["near_duplicate"] == (
        "dap, near-duplicates", "text-embedding cosine ≥ queries.near_duplicate_cosine with a kept query; an image "
        "whose embedding cosine to a sharper kept image of its domain is above near_duplicates.threshold (detail "
        "names it)")
