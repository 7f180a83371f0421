"""The layering rules of docs/design.md, checked on the source (AST) so that they stay true.

    engine  ->  scheduler  ->  cache          (never upward)
    config: a leaf; cli.py and the subcommand modules share engine_args.py, not each other
    engine.py never calls the prefix cache: the scheduler is its only driver
"""

from __future__ import annotations

import ast

import pytest

from hybridcache.config import CACHE_MODES
from hybridcache.scheduler.save_plan import POLICIES
from tests.source_imports import PACKAGE, imported_modules


def imports_under(module: str, names: set[str]) -> set[str]:
    return {name for name in names if name == module or name.startswith(module + ".")}


@pytest.mark.parametrize("layer", ["scheduler", "cache"])
def test_scheduler_and_cache_import_nothing_from_the_engine(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        assert not imports_under("hybridcache.engine", imported_modules(path)), path


def test_the_cache_imports_nothing_above_it():
    for path in sorted((PACKAGE / "cache").rglob("*.py")):
        above = {n for n in imported_modules(path) if n.startswith("hybridcache.") and
                 not n.startswith(("hybridcache.cache", "hybridcache.copy_kinds"))}
        assert not above, (path, above)


def test_config_is_a_leaf():
    names = imported_modules(PACKAGE / "config.py")
    assert not {n for n in names if n.startswith("hybridcache")}, names


def test_cli_and_subcommands_do_not_import_each_other():
    for sub in ("server/cli.py", "bench/cli.py"):
        assert not imports_under("hybridcache.cli", imported_modules(PACKAGE / sub)), sub
    assert not imports_under("hybridcache.server", imported_modules(PACKAGE / "cli.py"))


def test_the_engine_never_calls_the_prefix_cache():
    """engine.py reads no `.cache` attribute, and `PrefixCache` appears only as `Scheduler(PrefixCache(...))`:
    the cache is built and handed to the scheduler, never kept or called."""
    tree = ast.parse((PACKAGE / "engine" / "engine.py").read_text())
    nodes = list(ast.walk(tree))
    assert not [n for n in nodes if isinstance(n, ast.Attribute) and n.attr == "cache"]
    handed_over = {
        id(arg.func)
        for n in nodes
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Scheduler"
        for arg in n.args
        if isinstance(arg, ast.Call)
    }
    uses = [n for n in nodes if isinstance(n, ast.Name) and n.id == "PrefixCache"]
    assert uses and all(id(n) in handed_over for n in uses)


def test_every_cache_mode_has_a_policy():
    assert tuple(POLICIES) == CACHE_MODES
