"""The generated reference pages (scripts/gen_reference.py): they match the code, and the generator
refuses an undocumented profile key, command, option or argument, naming it, so the pages cannot
silently lose one."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated

import pytest
import typer
from pydantic import Field
from reference_script import load_generator

from models.specs import Strict
from rde.common.pool_config import DenoiseSpec
from rde.common.reasons import known_codes, meanings
from rde.profile import Profile

ROOT = Path(__file__).resolve().parents[1]


gen = load_generator()


def test_the_committed_reference_pages_are_what_the_code_gives(capsys: pytest.CaptureFixture[str]) -> None:
    assert gen.main(["--check"]) == 0, capsys.readouterr().err


def test_a_stale_page_fails_the_check_and_a_rerun_fixes_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    for page in ("profile.md", "cli.md", "reasons.md"):
        shutil.copy(gen.REFERENCE_DIR / page, tmp_path / page)
    monkeypatch.setattr(gen, "REFERENCE_DIR", tmp_path)
    (tmp_path / "cli.md").write_text("# Command line\n\nedited by hand\n", encoding="utf-8")
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "cli.md is out of date with the code: run scripts/gen_reference.py" in err
    assert "profile.md" not in err
    assert gen.main([]) == 0
    assert gen.main(["--check"]) == 0


def test_a_profile_key_without_description_fails_naming_the_key(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    class DenoiseWithNewKey(DenoiseSpec):
        new_threshold: float = 0.5

    class ProfileWithNewKey(Profile):
        denoise: DenoiseWithNewKey = Field(DenoiseWithNewKey(), description="The filters that reject images.")

    monkeypatch.setattr(gen, "Profile", ProfileWithNewKey)
    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "profile key denoise.new_threshold (DenoiseWithNewKey.new_threshold): no description" in err
    assert "1 undocumented" in err  # the documented keys are not named


def test_keys_in_lists_and_maps_of_sections_are_walked() -> None:
    class Item(Strict):
        documented: int = Field(1, description="Documented.")
        bare_in_list: int = 2

    class Entry(Strict):
        bare_in_map: int = 3

    class Tiny(Strict):
        items: list[Item] = Field(default_factory=list, description="Items.")
        by_name: dict[str, Entry] = Field(default_factory=dict, description="Entries by name.")
        bare: str = "x"

    named = "\n".join(gen.undocumented_keys(Tiny))
    assert "items[].bare_in_list" in named
    assert "by_name.<name>.bare_in_map" in named
    assert "profile key bare " in named
    assert "documented" not in named.replace("undocumented", "")


def test_a_cli_option_or_command_without_help_fails_naming_it(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from entry import cli

    # a copy of the command list, restored after the test: the commands below are added to the copy only
    monkeypatch.setattr(cli.app, "registered_commands", list(cli.app.registered_commands))

    @cli.app.command("with-bare-option")
    def _with_bare_option(knob: Annotated[int, typer.Option()] = 1,
                          target: Annotated[str, typer.Argument()] = "x") -> None:
        """A command whose option and argument have no help."""

    @cli.app.command("without-docstring")
    def _without_docstring() -> None:
        pass

    assert gen.main(["--check"]) == 1
    err = capsys.readouterr().err
    assert "option `rde with-bare-option --knob`: no help= text" in err
    assert "argument `rde with-bare-option TARGET`: no help= text" in err
    assert "command `rde without-docstring`: no help text" in err
    assert "3 undocumented" in err


def test_every_reason_code_is_on_the_reasons_page() -> None:
    page = (ROOT / "docs" / "reference" / "reasons.md").read_text(encoding="utf-8")
    missing = [code for code in sorted(known_codes()) if f"| `{code}` |" not in page]
    assert not missing, f"reason codes missing from docs/reference/reasons.md: {missing}"
    assert all(meaning in page for _, meaning in meanings().values())
