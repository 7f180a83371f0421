"""The package runs on every Python its metadata accepts (requires-python >= 3.10): no standard-library name that
came in 3.11 or later, no syntax of 3.11 (`except*`), and no builtin TimeoutError caught for asyncio's (the same
class only from 3.11: the router did not start on 3.10 when a replica's first poll timed out, hunt 194).
`enum.StrEnum` (3.11) broke every import of the model config on 3.10 (hunt 182). A static check, since CI runs one
Python; the list is of the 3.11-3.13 names a project like this one would reach for."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NEWER = {  # module -> names added after 3.10
    "enum": {"StrEnum", "ReprEnum", "verify", "EnumCheck", "FlagBoundary", "global_enum", "member", "nonmember",
             "property", "show_flag_values"},
    "asyncio": {"timeout", "timeout_at", "Timeout", "TaskGroup", "Runner", "Barrier", "BrokenBarrierError",
                "QueueShutDown"},
    "typing": {"Self", "Never", "LiteralString", "assert_never", "assert_type", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "override", "get_overloads",
               "clear_overloads", "TypeAliasType", "get_protocol_members", "is_protocol", "ReadOnly", "TypeIs"},
    "datetime": {"UTC"},
    "hashlib": {"file_digest"},
    "contextlib": {"chdir"},
    "itertools": {"batched"},
    "math": {"cbrt", "exp2", "sumprod"},
    "operator": {"call"},
    "inspect": {"markcoroutinefunction", "getasyncgenstate", "getasyncgenlocals"},
    "logging": {"getLevelNamesMapping", "getHandlerByName", "getHandlerNames"},
}
NEWER_MODULES = {"tomllib", "wsgiref.types"}
NEWER_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}


def uses_of_newer_names(tree: ast.AST) -> list[str]:
    found = []
    modules: dict[str, str] = {}  # local name -> module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in NEWER_MODULES:
                    found.append(f"import {alias.name}")
                modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in NEWER_MODULES:
                found.append(f"from {node.module} import ...")
            found += [f"from {node.module} import {a.name}" for a in node.names if a.name in NEWER.get(node.module, ())]
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.attr in NEWER.get(modules.get(node.value.id, ""), ())):
            found.append(f"{node.value.id}.{node.attr}")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            found.append(node.id)
        elif type(node).__name__ == "TryStar":
            found.append("except*")
        elif "asyncio" in modules.values() and _catches_builtin_timeout(node):
            found.append("TimeoutError caught where asyncio's is meant (3.10: asyncio.TimeoutError is another class)")
    return found


def _catches_builtin_timeout(node: ast.AST) -> bool:
    """`except TimeoutError` or `contextlib.suppress(TimeoutError)` in a module that uses asyncio: on 3.10 an
    asyncio timeout (`wait_for`) raises asyncio.TimeoutError, which the builtin does not catch."""
    if isinstance(node, ast.ExceptHandler) and node.type is not None:
        types = node.type.elts if isinstance(node.type, ast.Tuple) else [node.type]
    elif isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "suppress":
        types = node.args
    else:
        return False
    return any(isinstance(t, ast.Name) and t.id == "TimeoutError" for t in types)


def test_requires_python_is_3_10():
    assert re.search(r'^requires-python = ">=3.10"$', (REPO / "pyproject.toml").read_text(), re.MULTILINE)


def test_the_package_uses_nothing_newer_than_python_3_10():
    offenders = {}
    for path in sorted((REPO / "hybridcache").rglob("*.py")):
        found = uses_of_newer_names(ast.parse(path.read_text(), str(path)))
        if found:
            offenders[str(path.relative_to(REPO))] = found
    assert offenders == {}


def test_the_check_finds_what_it_looks_for():
    source = ("import asyncio\nfrom enum import StrEnum\nimport tomllib\nasync def f():\n    async with "
              "asyncio.timeout(1):\n        pass\ntry:\n    pass\nexcept* ValueError:\n    pass\n"
              "with contextlib.suppress(TimeoutError):\n    pass\ntry:\n    pass\nexcept (OSError, TimeoutError):\n"
              "    pass\n")
    timeout = "TimeoutError caught where asyncio's is meant (3.10: asyncio.TimeoutError is another class)"
    assert sorted(uses_of_newer_names(ast.parse(source))) == sorted([
        "from enum import StrEnum", "import tomllib", "asyncio.timeout", "except*", timeout, timeout])
