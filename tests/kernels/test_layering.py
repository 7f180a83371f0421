"""The kernel seam's import rules, checked on the source (AST): layers and models reach kernels only
through `hybridcache.kernels.backend`; the copy kernels import each other one way (no cycle)."""

from __future__ import annotations

from tests.source_imports import PACKAGE, imported_modules


def test_layers_and_models_reach_kernels_only_through_the_backend():
    for folder in ("layers", "models"):
        for path in sorted((PACKAGE / folder).rglob("*.py")):
            kernels = {n for n in imported_modules(path) if n.startswith("hybridcache.kernels")}
            assert kernels <= {"hybridcache.kernels.backend", "hybridcache.kernels.backend.KernelBackend"}, (
                path,
                kernels,
            )


def test_the_copy_kernels_have_no_import_cycle():
    folder = PACKAGE / "kernels" / "copy"
    edges = {
        path.stem: {n.rsplit(".", 1)[-1] for n in imported_modules(path) if n.startswith("hybridcache.kernels.copy.")}
        for path in folder.glob("*.py")
    }

    def reaches(start: str, goal: str, seen: frozenset[str] = frozenset()) -> bool:
        nexts = edges.get(start, set())
        return any(nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in nexts)

    assert edges["block_copy"] >= {"geometry", "reference", "triton"}
    assert not [name for name in edges if reaches(name, name)]
