"""The imports a source file makes, read with ``ast`` (lazy ones inside functions included), for the
structure tests that check which modules may import which."""

from __future__ import annotations

import ast
from pathlib import Path


def file_imports(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every absolute or relative import in the file at ``path``, whose
    own dotted name is ``module`` (a relative import is resolved against its package)."""
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
