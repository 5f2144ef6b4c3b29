"""scripts/gen_reference.py loaded as a module (scripts/ is no package), for the tests that call it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_generator() -> ModuleType:
    """The script as a module, kept in ``sys.modules`` (its dataclasses look their module up there)."""
    if "gen_reference" in sys.modules:
        return sys.modules["gen_reference"]
    spec = importlib.util.spec_from_file_location("gen_reference", ROOT / "scripts" / "gen_reference.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
