"""The layout keeps its promises: ``rde/`` is plain logic (no Prefect, no Dask), the architecture
page's Layout names every module, and a stage's ``run`` stays short (its logic lives in ``rde/``).

Read from the files on disk with ``ast`` and the page's text, so a new module, a new import or a
grown stage body fails here, naming the file."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
from source_imports import file_imports

ROOT = Path(__file__).resolve().parent.parent
ORCHESTRATION = ("prefect", "prefect_dask", "dask", "distributed")  # what rde/ never imports
DOCUMENTED = ("rde", "models", "tasks", "flows", "storage", "entry")  # packages whose modules Layout names
# at most this many lines of a stage's ``run`` body (its docstring aside): a run reads its inputs, calls
# its pipeline's logic and returns what it wrote (the longest today: rerank's, 29 lines)
RUN_LINES = 30


def orchestration_imports(root: Path) -> list[str]:
    """Every import of Prefect or Dask under ``rde/``, as ``file:line imports module``."""
    bad = []
    for path in sorted((root / "rde").rglob("*.py")):
        for line, module in file_imports(path, ".".join(path.relative_to(root).with_suffix("").parts)):
            if module.split(".")[0] in ORCHESTRATION:
                bad.append(f"{path.relative_to(root)}:{line} imports {module}")
    return bad


def test_rde_imports_no_prefect_and_no_dask() -> None:
    """``rde/``: plain logic, testable without Prefect; the task runners, the Dask runner and the
    server's automations live in ``tasks/framework/``."""
    assert orchestration_imports(ROOT) == []


@pytest.mark.parametrize(("text", "module"), [
    ("import prefect\n", "prefect"),
    ("def f():\n    from prefect.task_runners import TaskRunner\n", "prefect.task_runners"),  # lazy
    ("def f():\n    import distributed\n", "distributed"),
    ("from dask import array\n", "dask"),
])
def test_an_orchestration_import_under_rde_is_found(tmp_path: Path, text: str, module: str) -> None:
    (tmp_path / "rde" / "common").mkdir(parents=True)
    (tmp_path / "rde" / "common" / "ok.py").write_text("import numpy\nfrom storage import Artifact\n")
    (tmp_path / "rde" / "common" / "fake.py").write_text(text)
    assert orchestration_imports(tmp_path) == [f"rde/common/fake.py:{text.count(chr(10))} imports {module}"]


def layout_sections(page: str) -> dict[str, str]:
    """The Layout block's text per entry: a top-level folder (``tasks``) or, indented under
    ``rde/``, a pipeline's package (``rde/secmm``), with its continuation lines."""
    block = page.split("## Layout", 1)[1].split("```", 2)[1]
    sections: dict[str, str] = {}
    key = None
    for line in block.splitlines():
        if m := re.match(r"^( {0,2})([a-z_]+)/\s", line):
            key = f"rde/{m.group(2)}" if m.group(1) else m.group(2)
        if key:
            sections[key] = f"{sections.get(key, '')} {line}"
    return sections


def unnamed_modules(root: Path) -> list[str]:
    """Every module of the documented packages whose name (its file's stem) is not a word of its
    package's entry in the Layout block (``rde/<pipeline>/`` modules: of that pipeline's entry)."""
    sections = layout_sections((root / "docs" / "architecture.md").read_text(encoding="utf-8"))
    missing = []
    for package in DOCUMENTED:
        for path in sorted((root / package).rglob("*.py")):
            if path.name == "__init__.py":
                continue
            parts = path.relative_to(root).parts
            entry = f"rde/{parts[1]}" if package == "rde" and len(parts) > 2 else package
            if not re.search(rf"(?<![\w.]){re.escape(path.stem)}(?!\w)", sections.get(entry, "")):
                missing.append(str(path.relative_to(root)))
    return missing


def test_the_layout_names_every_module() -> None:
    """docs/architecture.md's Layout is the map a newcomer reads first: every module under rde/,
    models/, tasks/, flows/, storage/ and entry/ is named in its package's entry."""
    assert unnamed_modules(ROOT) == []


def test_a_module_missing_from_the_layout_is_found(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "architecture.md").write_text(
        "## Layout\n\n```\nflows/     build_secmm\nrde/       plain logic:\n  secmm/     dap, cgds\n"
        "  common/    profiles\nstorage/   schemas\n```\n\n## Next\n")
    for module in ("flows/build_secmm.py", "rde/secmm/dap.py", "rde/secmm/cgds.py", "rde/secmm/profiles.py",
                   "rde/common/profiles.py", "rde/common/dap_grammar.py", "storage/schemas.py", "storage/__init__.py"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text("")
    # profiles is named under common/, not under secmm/; dap does not name dap_grammar
    assert unnamed_modules(tmp_path) == ["rde/common/dap_grammar.py", "rde/secmm/profiles.py"]


def _stage_classes(root: Path) -> list[tuple[Path, ast.ClassDef]]:
    """Every class under ``tasks/`` (the framework aside) that derives, directly or through another
    such class (``TierStage``), from ``Stage``."""
    classes = [(path, node) for path in sorted((root / "tasks").rglob("*.py")) if "framework" not in path.parts
               for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))) if isinstance(node, ast.ClassDef)]
    stages, grown = {"Stage"}, True
    while grown:
        before = len(stages)
        stages |= {node.name for _, node in classes
                   if any(isinstance(b, ast.Name) and b.id in stages for b in node.bases)}
        grown = len(stages) > before
    return [(path, node) for path, node in classes if node.name in stages]


def long_runs(root: Path, limit: int = RUN_LINES) -> dict[str, int]:
    """``file:Class.run`` → its body's lines (docstring aside), for each stage's ``run`` over ``limit``."""
    long = {}
    for path, cls in _stage_classes(root):
        for fn in cls.body:
            if isinstance(fn, ast.FunctionDef) and fn.name == "run":
                body = fn.body[1:] if len(fn.body) > 1 and isinstance(fn.body[0], ast.Expr) and isinstance(
                    fn.body[0].value, ast.Constant) and isinstance(fn.body[0].value.value, str) else fn.body
                lines = fn.end_lineno - body[0].lineno + 1
                if lines > limit:
                    long[f"{path.relative_to(root)}:{cls.name}.run"] = lines
    return long


def test_every_stage_run_is_short() -> None:
    """A stage declares and wires; its algorithm is plain logic in ``rde/<pipeline>/`` (the caption
    pool's generate-and-check loop, MECF's per-domain union, the reranking loop), testable without
    Prefect. Shorten a stage that grows past the bound the same way."""
    assert len(_stage_classes(ROOT)) >= 20 and long_runs(ROOT) == {}


def test_a_long_stage_run_is_found(tmp_path: Path) -> None:
    (tmp_path / "tasks" / "secmm").mkdir(parents=True)
    body = "".join(f"        x{i} = {i}\n" for i in range(RUN_LINES))
    (tmp_path / "tasks" / "secmm" / "tier.py").write_text(
        "from tasks.framework.stage import Stage\n\n\nclass TierStage(Stage):\n    pass\n\n\n"
        "class Short(TierStage):\n    def run(self, run):\n        \"\"\"Docstring.\n\n        Aside.\"\"\"\n"
        f"{body}\n"
        "class Long(TierStage):\n    def run(self, run):\n" + body + "        return x0\n\n\n"
        "class NotAStage:\n    def run(self, run):\n" + body + "        return x0\n")
    assert long_runs(tmp_path) == {"tasks/secmm/tier.py:Long.run": RUN_LINES + 1}
