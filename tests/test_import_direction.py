"""Imports run one way: entry points → flows → tasks → pipeline logic → common → models, storage.

Read from the source with ``ast`` (every ``import``, also those inside functions, since a lazy
import is still a dependency), so a new upward import fails here and not in a newcomer's head.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from source_imports import file_imports

ROOT = Path(__file__).resolve().parent.parent
# lower number = higher layer; a unit (the longest matching prefix) may import itself and the layers
# below it. Entry points start flows and read their results, so they sit above everything; each
# pipeline's logic is a unit of its own, and pipelines share code only through rde.common.
# tasks: the pipelines' stage modules, above the stage framework they are written against;
# rde.profile: the profile, composed of every pipeline's config sections, below the framework that loads it
LAYERS = {"entry": 0, "flows": 1, "tasks": 2, "tasks.framework": 2.5, "rde.profile": 2.75, "rde.secmm": 3,
          "rde.largefine": 3, "rde.training": 3, "rde.vedje": 3, "rde.evaluation": 3, "rde.common": 4,
          "rde": 5, "models": 5, "storage": 5}  # rde itself: its version only
PACKAGES = ("entry", "flows", "tasks", "rde", "models", "storage")
# models and storage are both at the bottom, but only in this direction
SIBLING_EDGES = {("models", "storage")}


def unit(module: str) -> str | None:
    """The layer unit a module belongs to: the longest prefix of it in LAYERS."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in LAYERS:
            return ".".join(parts[:n])
    return None


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def upward_imports() -> list[str]:
    """Every import that runs against the layer order, as ``file:line imports module``."""
    bad = []
    for module, path in _modules().items():
        own = unit(module)
        if own is None:
            continue
        for line, target in file_imports(path, module):
            top = unit(target)
            if top is None or top == own:
                continue
            if LAYERS[top] < LAYERS[own] or (LAYERS[top] == LAYERS[own] and (own, top) not in SIBLING_EDGES):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {target}")
    return bad


def test_imports_run_one_way() -> None:
    assert upward_imports() == []


@pytest.mark.parametrize(("source", "text", "target"), [
    ("models/backends/fake.py", "from rde.common.profiles import ModelSpec\n", "rde.common.profiles"),
    ("rde/fake.py", "def f():\n    from tasks.framework.context import RunContext\n",
     "tasks.framework.context"),  # lazy
    ("storage/fake.py", "import models.backends\n", "models.backends"),
    ("tasks/fake.py", "from flows.build_secmm import build_secmm\n", "flows.build_secmm"),
])
def test_an_upward_import_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, text: str,
                                   target: str) -> None:
    """The check can fail: a planted upward import (also a lazy one) is reported with its line,
    while an allowed sibling edge and an entry point's imports are not."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / source).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / source).write_text(text)
    (tmp_path / "models" / "ok.py").write_text("from storage import Artifact\n")
    (tmp_path / "entry" / "cli.py").write_text("from flows.build_secmm import build_secmm\n")
    (tmp_path / "rde" / "secmm" / "ok.py").parent.mkdir(exist_ok=True)
    (tmp_path / "rde" / "secmm" / "ok.py").write_text("from rde.common.profiles import Profile\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert upward_imports() == [f"{source}:{text.count(chr(10))} imports {target}"]


def import_cycles() -> list[list[str]]:
    """Project modules that import each other in a circle (lazy imports and ``TYPE_CHECKING`` ones
    count: a circle hides which of the two is the lower one), each circle once, from its smallest name."""
    modules = _modules()
    graph = {m: sorted({t for _, t in file_imports(p, m) if t in modules and t != m}) for m, p in modules.items()}
    cycles, state = set(), {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = "open"
        for nxt in graph[node]:
            if state.get(nxt) == "open":
                ring = path[path.index(nxt):]
                start = ring.index(min(ring))
                cycles.add(tuple(ring[start:] + ring[:start]))
            elif nxt not in state:
                visit(nxt, [*path, nxt])
        state[node] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return [list(c) for c in sorted(cycles)]


def test_no_two_modules_import_each_other() -> None:
    assert import_cycles() == []


def test_an_import_circle_is_found(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check can fail: two modules of one package, one importing the other lazily."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    (tmp_path / "models" / "a.py").write_text("from models.b import f\n")
    (tmp_path / "models" / "b.py").write_text("def f():\n    from models.a import g\n")
    monkeypatch.setitem(globals(), "ROOT", tmp_path)
    assert import_cycles() == [["models.a", "models.b"]]


def _stage_modules() -> list[str]:
    """Every module of a pipeline's stages: ``tasks/<pipeline>/<module>.py`` (the framework aside)."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in (ROOT / "tasks").glob("*/*.py")
                  if p.parent.name != "framework" and p.name != "__init__.py")


def test_every_stage_class_is_named_after_its_stage() -> None:
    """``denoise`` is ``Denoise``, ``adv-tier`` ``AdvTier``: a newcomer who reads a stage's name in a
    log finds its class by that name. Per-method stages (``Train``) name their stage at construction."""
    import importlib
    import inspect

    from tasks.framework.stage import Stage

    found = []
    for module in map(importlib.import_module, _stage_modules()):
        for name, cls in inspect.getmembers(module, inspect.isclass):
            stage = cls.__dict__.get("name")
            if issubclass(cls, Stage) and cls.__module__ == module.__name__ and isinstance(stage, str):
                found.append((name, "".join(part.capitalize() for part in stage.split("-"))))
    # case aside: LargeFine and WebDataset keep their own spelling
    assert len(found) >= 20 and [f for f in found if f[0].lower() != f[1].lower()] == []


def test_each_stage_has_one_module_named_after_it() -> None:
    """One stage, one place: each module of ``tasks/<pipeline>/`` holds at most one stage class, and a
    stage module is named after its stage (``adv-tier`` in ``adv_tier.py``; ``videos`` in
    ``videos.py``). Per-method and per-method-named stages (``train_<method>``) live in ``train.py``."""
    import importlib
    import inspect

    from tasks.framework.stage import Stage

    wrong = []
    for module in map(importlib.import_module, _stage_modules()):
        stages = [cls for _, cls in inspect.getmembers(module, inspect.isclass)
                  if issubclass(cls, Stage) and cls.__module__ == module.__name__ and "name" in cls.__dict__]
        leaf = module.__name__.rsplit(".", 1)[1]
        names = [cls.__dict__["name"] for cls in stages]
        if len(stages) > 1 or (names and leaf not in {n.replace("-", "_") for n in names}
                               and not names[0].startswith(f"{module.__name__.split('.')[1]}-{leaf}")):
            wrong.append((module.__name__, names))
    assert wrong == []


def test_no_module_of_rde_models_tasks_flows_or_storage_is_over_400_lines() -> None:
    """A module a newcomer can read in one sitting: the pipelines' logic, the models, the stages and
    their framework, the flows and the store each stay at 400 lines or fewer (split along a seam)."""
    long = {str(p.relative_to(ROOT)): n for package in ("rde", "models", "tasks", "flows", "storage")
            for p in (ROOT / package).rglob("*.py") if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400}
    assert long == {}


def test_the_framework_knows_no_pipeline() -> None:
    """``tasks/framework`` imports no stage module and no pipeline's logic: a new pipeline brings its
    stages, the framework stays as it is."""
    bad = []
    for module, path in _modules().items():
        if module.startswith("tasks.framework"):
            bad += [f"{path.relative_to(ROOT)}:{line} imports {target}" for line, target in file_imports(path, module)
                    if (target.startswith("tasks.") and not target.startswith("tasks.framework"))
                    or target.startswith(("rde.secmm", "rde.largefine", "rde.training", "rde.vedje", "flows"))]
    assert bad == []
