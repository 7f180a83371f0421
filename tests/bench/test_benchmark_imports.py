"""Every name a script under benchmarks/ imports from hybridcache exists: a script is not run by the default suite,
so a rename in the package would otherwise break it silently (benchmarks/block_copy_gpu.py imported `copy_slots`
for days after it was removed). Read from the scripts' source: nothing of them runs."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).parents[2] / "benchmarks").glob("*.py"))


def hybridcache_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of each `from hybridcache... import name` in the script."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [(node.module, alias.name) for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("hybridcache")
            for alias in node.names]


def test_there_are_scripts_and_they_import_the_package():
    assert len(SCRIPTS) > 20 and sum(bool(hybridcache_imports(path)) for path in SCRIPTS) > 20


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_what_a_benchmark_imports_from_hybridcache_exists(script):
    for module_name, name in hybridcache_imports(script):
        module = importlib.import_module(module_name)
        if not hasattr(module, name):
            importlib.import_module(f"{module_name}.{name}")  # a submodule; raises naming it when there is none
