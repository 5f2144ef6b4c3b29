"""What a logic module declares beside its code: its profile section and its own reason codes.

A stage's parameters belong next to the logic that reads them, and a reason code only one stage
writes belongs next to the code that writes it, so adding a stage does not edit a central list. A
module declares a section with ``@profile_section("name", "description")`` on its pydantic model
and a code with ``declare_reason(...)`` (``rde.common.reasons``); ``rde.profile`` composes the
sections into ``Profile`` and the reasons registry takes the codes.

How they are found: nothing imports a logic module just to learn its declarations, so
``import_declaring(marker)`` reads the source of the pipeline packages (``DECLARING_PACKAGES``), a
few hundred kilobytes of text, and imports exactly the modules whose text holds the marker at the
start of a line. A profile load therefore imports the section-declaring modules, not every
pipeline (which would pull torch into ``rde validate``); a new module is found without being listed
anywhere, and a new pipeline package is added to ``DECLARING_PACKAGES``.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, Field

# the packages whose modules may declare sections or reasons (the pipelines' logic and the shared logic)
DECLARING_PACKAGES = ("rde.common", "rde.secmm", "rde.largefine", "rde.training", "rde.vedje", "rde.evaluation")
SECTION_MARKER = "@profile_section("
REASON_MARKER = "declare_reason("

Model = TypeVar("Model", bound=type[BaseModel])


class DeclarationError(ValueError):
    """Two modules declare one section name, or a name no profile key can be."""


# section name → (its model, the one-line description the profile reference shows), in the order
# the modules were imported (``import_declaring`` imports them sorted by path, so the order is fixed)
SECTIONS: dict[str, tuple[type[BaseModel], str]] = {}
_imported: set[str] = set()


def profile_section(name: str, description: str) -> Callable[[Model], Model]:
    """Declare the decorated model as the profile section ``name`` (a top-level key of every
    profile, defaulting to the model's defaults), described by ``description`` in the profile
    reference."""
    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        raise DeclarationError(f"profile section {name!r}: a section name is lower-case words joined by _")

    def register(model: Model) -> Model:
        known = SECTIONS.get(name)
        if known is not None and (known[0].__module__, known[0].__qualname__) != (model.__module__,
                                                                                   model.__qualname__):
            raise DeclarationError(f"profile section {name!r} is declared twice: {known[0].__module__}."
                                   f"{known[0].__qualname__} and {model.__module__}.{model.__qualname__}")
        SECTIONS[name] = (model, description)
        return model
    return register


def declaring_modules(marker: str) -> list[str]:
    """The modules of ``DECLARING_PACKAGES`` whose source has a line starting with ``marker`` (after
    indentation or an assignment), sorted by path; this module and the reasons registry, which
    define the markers, are not counted."""
    line = re.compile(r"^\s*(?:[A-Za-z_][A-Za-z0-9_]*\s*=\s*)?" + re.escape(marker), re.MULTILINE)
    found = []
    for package in DECLARING_PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise DeclarationError(f"declaring package {package!r} is not an importable package")
        for path in sorted(p for folder in spec.submodule_search_locations for p in Path(folder).glob("*.py")):
            module = f"{package}.{path.stem}" if path.stem != "__init__" else package
            if module in {__name__, "rde.common.reasons"}:
                continue
            if line.search(path.read_text(encoding="utf-8")):
                found.append(module)
    return found


def import_declaring(marker: str) -> None:
    """Import every module that declares with ``marker`` (once per process per marker)."""
    if marker in _imported:
        return
    for module in declaring_modules(marker):
        importlib.import_module(module)
    _imported.add(marker)


def section_fields() -> dict[str, Any]:
    """The declared sections as ``create_model`` fields: ``name → (model, Field(default, description))``,
    the default being the model's defaults (as every other section's)."""
    import_declaring(SECTION_MARKER)
    return {name: (model, Field(model(), description=description))
            for name, (model, description) in SECTIONS.items()}
