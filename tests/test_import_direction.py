"""Imports run one way: entry points → flows → tasks → pipeline logic (rde) → models, storage.

Read from the source with ``ast`` (every ``import``, also those inside functions, since a lazy
import is still a dependency), so a new upward import fails here and not in a newcomer's head.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# lower number = higher layer; a module may import its own layer and the layers below it
LAYERS = {"flows": 1, "tasks": 2, "rde": 3, "models": 4, "storage": 4}
# entry points: they start flows and read their results, so they sit above everything
ENTRY_POINTS = {"rde.cli"}
# models and storage are both at the bottom, but only in this direction
SIBLING_EDGES = {("models", "storage")}


def _modules() -> dict[str, Path]:
    found = {}
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute or relative import in the file."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing package
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                base = package[: len(package) - node.level + 1]
                out.append((node.lineno, ".".join([*base, *([node.module] if node.module else [])])))
            elif node.module:
                out.append((node.lineno, node.module))
    return out


def upward_imports() -> list[str]:
    """Every import that runs against the layer order, as ``file:line imports module``."""
    bad = []
    for module, path in _modules().items():
        if module in ENTRY_POINTS:
            continue
        own = module.split(".")[0]
        for line, target in _imports(path, module):
            top = target.split(".")[0]
            if top not in LAYERS or top == own:
                continue
            if LAYERS[top] < LAYERS[own] or (LAYERS[top] == LAYERS[own] and (own, top) not in SIBLING_EDGES):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_imports_run_one_way() -> None:
    assert upward_imports() == []


@pytest.mark.parametrize(("source", "text", "target"), [
    ("models/backends/fake.py", "from rde.profiles import ModelSpec\n", "rde.profiles"),
    ("rde/fake.py", "def f():\n    from tasks.context import RunContext\n", "tasks.context"),  # lazy
    ("storage/fake.py", "import models.backends\n", "models.backends"),
    ("tasks/fake.py", "from flows.build_secmm import build_secmm\n", "flows.build_secmm"),
])
def test_an_upward_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, text: str,
                                   target: str) -> None:
    """The check can fail: a planted upward import (also a lazy one) is reported with its line,
    while an allowed sibling edge and an entry point's imports are not."""
    for package in LAYERS:
        (tmp_path / package).mkdir()
    (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / source).write_text(text)
    (tmp_path / "models" / "ok.py").write_text("from storage import Artifact\n")
    (tmp_path / "rde" / "cli.py").write_text("from flows.build_secmm import build_secmm\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert upward_imports() == [f"{source}:{text.count(chr(10))} imports {target}"]
