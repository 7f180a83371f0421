"""The layering rules of docs/design.md, checked on the source (AST) so that they stay true.

Every package and top-level module of hybridcache (a *unit*) is declared in `ALLOWED` with the units it may
import; the declared graph has no cycle, so dependencies run one way:

    server, bench, cli -> llm -> engine -> scheduler -> cache -> copy_kinds
    router -> server (request parsing), cache (events, hashes); router/cli.py adds `serve --data-parallel-size`
    bench -> router: the replica simulator routes with the router's own policy and index (pure Python)
    distributed -> engine -> models -> layers -> kernels -> forward_batch -> copy_kinds
    config: a leaf; cli.py and the subcommand modules share engine_args.py, not each other
    kernels import nothing of cache or layers; cache imports nothing of hybridcache but the leaf copy_kinds
    engine.py never calls the prefix cache: the scheduler is its only driver

A new package (or module) is added to `ALLOWED` with its dependencies; a new edge is added there on purpose.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

from hybridcache.config import CACHE_MODES
from hybridcache.scheduler.save_plan import POLICIES
from tests.source_imports import PACKAGE, imported_modules

FACADE = "hybridcache"  # the package's __init__ (`from hybridcache import LLM`)

# unit -> the units it may import (a unit: a subpackage or a top-level module of hybridcache)
ALLOWED: dict[str, set[str]] = {
    FACADE: set(),  # imports its names lazily, by module path
    "copy_kinds": set(),
    "config": set(),
    "schema_checks": set(),  # which JSON schemas xgrammar would read without enforcing
    "guided_kimi": set(),  # Kimi's tool-call section as grammar rules, for both of guided's backends
    "guided_llguidance": {"guided_kimi"},  # guided's fallback compiler (llguidance)
    "guided_python": set(),  # the Python-call tool formats (lfm2, olmo3, pythonic) as grammar rules
    "guided": {"guided_kimi", "guided_llguidance", "guided_python", "schema_checks"},
    "sampling": {"config", "guided"},  # is_integer; a request's constraint is checked to be a GuidedSpec
    "multimodal": set(),
    "state_spec": set(),
    "fp8_format": set(),  # how an FP8 weight is scaled: read by kernels, layers and models
    "tokenizer": set(),
    "detokenizer": {"sampling", "tokenizer"},  # a completion's text and stop strings, from its SamplingParams
    "extras": set(),  # the optional dependency groups and the error naming a missing one
    "arg_types": set(),  # argparse types of the command lines' counts, sizes and ports
    "images": set(),
    "mm_processor": {"images", "models", "multimodal", "tokenizer"},  # tokenizer: TextParts
    "outputs": {"sampling"},
    "generation_config": {"sampling"},
    "cache": {"copy_kinds"},
    "scheduler": {"cache", "config", "multimodal", "sampling"},
    "forward_batch": {"copy_kinds"},
    "kernels": {"forward_batch", "fp8_format"},
    "layers": {"forward_batch", "fp8_format", "kernels", "state_spec"},
    "models": {"forward_batch", "fp8_format", "kernels", "layers", "state_spec"},
    "model_path": {"models"},
    "engine_args": {"arg_types", "config", "model_path", "models"},  # model_path: a `tokenizer=` hub id
    "engine": {
        "cache", "config", "copy_kinds", "detokenizer", "engine_args", "forward_batch", "guided", "kernels", "layers",
        "models", "mm_processor", "multimodal",
        "outputs", "sampling", "scheduler", "state_spec", "tokenizer",
    },
    "distributed": {"engine", "forward_batch", "layers", "models"},
    "llm": {"engine", "engine_args", "generation_config", "images", "mm_processor", "model_path", "multimodal",
            "outputs", "sampling"},
    "cli": {FACADE, "engine_args", "extras", "generation_config", "model_path", "vllm_argv"},
    "vllm_argv": set(),  # vLLM's spellings of the flags, rewritten before argparse (a leaf)
    "__main__": {"cli"},
    "server": {"arg_types", "cache", "engine", "engine_args", "extras", "generation_config", "guided", "images",
               "mm_processor", "model_path", "models", "multimodal", "outputs", "sampling", "tokenizer"},
    "router": {"arg_types", "cache", "engine_args", "extras", "model_path", "server", "tokenizer"},
    "async_llm": {"llm", "outputs", "sampling", "server"},  # LLM's engine on the server's engine thread
    "bench": {FACADE, "arg_types", "cache", "config", "engine", "engine_args", "extras", "model_path", "models",
              "router", "scheduler", "tokenizer"},
}


def unit_of_file(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    if rel == Path("__init__.py"):
        return FACADE
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


@functools.cache
def units() -> frozenset[str]:
    return frozenset(unit_of_file(path) for path in PACKAGE.rglob("*.py"))


def unit_of_import(name: str) -> str | None:
    """The unit an imported name belongs to; None outside hybridcache. `hybridcache.X` where X is no module
    (`from hybridcache import LLM`) is the facade."""
    parts = name.split(".")
    if parts[0] != "hybridcache":
        return None
    if len(parts) == 1 or parts[1] not in units():
        return FACADE
    return parts[1]


def imported_units(path: Path) -> set[str]:
    return {unit for name in imported_modules(path) if (unit := unit_of_import(name)) is not None}


@functools.cache
def actual_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {unit: set() for unit in units()}
    for path in PACKAGE.rglob("*.py"):
        unit = unit_of_file(path)
        graph[unit] |= imported_units(path) - {unit}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as a list of nodes (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, [*path, nxt])) is not None:
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])) is not None:
            return cycle
    return None


def imports_under(module: str, names: set[str]) -> set[str]:
    return {name for name in names if name == module or name.startswith(module + ".")}


def test_every_unit_is_declared():
    assert units() == set(ALLOWED), (sorted(units() - set(ALLOWED)), sorted(set(ALLOWED) - units()))


def test_the_declared_graph_has_no_cycle():
    assert find_cycle(ALLOWED) is None, find_cycle(ALLOWED)


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("unit", sorted(ALLOWED))
def test_every_unit_imports_only_what_it_is_allowed(unit):
    graph = actual_graph()
    assert graph[unit] <= ALLOWED[unit], f"{unit} imports undeclared {sorted(graph[unit] - ALLOWED[unit])}"


def test_the_packages_have_no_cycle():
    assert find_cycle(actual_graph()) is None


def test_kernels_import_nothing_of_the_cache_or_the_layers():
    for path in sorted((PACKAGE / "kernels").rglob("*.py")):
        assert not imported_units(path) & {"cache", "layers", "scheduler", "engine", "models"}, path


@pytest.mark.parametrize("layer", ["scheduler", "cache"])
def test_scheduler_and_cache_import_nothing_from_the_engine(layer):
    for path in sorted((PACKAGE / layer).rglob("*.py")):
        assert not imports_under("hybridcache.engine", imported_modules(path)), path


def test_the_cache_imports_nothing_above_it():
    """The cache imports nothing of hybridcache but the pure-Python leaf `copy_kinds` (its `Pool`, `Phase`,
    `CopyKind`), and that leaf imports only the standard library."""
    for path in sorted((PACKAGE / "cache").rglob("*.py")):
        above = {n for n in imported_modules(path) if n.startswith("hybridcache.") and
                 not n.startswith(("hybridcache.cache", "hybridcache.copy_kinds"))}
        assert not above, (path, above)
    assert imported_modules(PACKAGE / "copy_kinds.py") <= {"__future__", "__future__.annotations", "enum"}


def test_the_engine_never_imports_the_distributed_package():
    for path in sorted((PACKAGE / "engine").rglob("*.py")):
        assert not imports_under("hybridcache.distributed", imported_modules(path)), path


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


def test_every_engine_eviction_name_is_a_registered_cache_policy():
    """The engine's option spellings (`hybridcache.config.EVICTION_POLICIES`) map onto the cache's one registry."""
    from hybridcache.cache.policy import EVICTION_POLICIES as REGISTERED
    from hybridcache.config import EVICTION_POLICIES as SPELLINGS

    assert set(SPELLINGS.values()) == set(REGISTERED)
