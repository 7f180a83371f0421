"""What a source file imports, read from its AST (for the tests that check the project's layering rules)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "hybridcache"


def imported_modules(path: Path) -> set[str]:
    """Every module an `import` / `from ... import` anywhere in the file names (function bodies included);
    for `from a import b` both `a` and `a.b` (b may be a module)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names
