"""The ``rde`` command: help texts, and clear one-line errors (no tracebacks) for bad input."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from typer.testing import CliRunner

from rde.cli import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_commands() -> None:
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ("build-secmm", "profile", "pool", "artifacts", "train-vedje", "index-cache", "rerank", "clips"):
        assert command in result.output
    result = runner.invoke(app, ["build-secmm", "--help"])
    assert result.exit_code == 0 and "--input" in result.output and "--set" in result.output


def test_profile_validate_reports_key(tmp_path: Path) -> None:
    bad = tmp_path / "p.yaml"
    bad.write_text((ROOT / "profiles" / "demo.yaml").read_text().replace("min_width: 32", "min_width: wide"))
    result = runner.invoke(app, ["profile", "validate", str(bad)])
    assert result.exit_code == 2
    assert "denoise.min_width" in result.output and "Traceback" not in result.output
    ok = runner.invoke(app, ["profile", "validate", "production"])
    assert ok.exit_code == 0 and "ok" in ok.output


def _rde(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ}
    return subprocess.run([sys.executable, "-m", "rde.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=120)


def test_bad_inputs_give_messages_not_tracebacks(tmp_path: Path) -> None:
    for args, message in [
        (["build-secmm", "--input", str(tmp_path / "missing-folder")], "does not exist or is not a folder"),
        (["build-secmm", "--input", str(tmp_path / "missing.parquet")], "does not exist"),
        (["build-secmm", "--set", "denoise.min_height=-3"], "denoise.min_height"),
        (["build-secmm", "--set", "nonsense"], "--set expects key.path=value"),
        (["build-secmm", "--profile", "nope"], "not found"),
    ]:
        result = _rde(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr + result.stdout, args
