"""A stand-in for the parts of flash-linear-attention that `kernels/gated_delta/fla.py` reaches, for CPU tests
(fla is kept out of the CPU test environment): `chunk.chunk_gated_delta_rule_fwd` and `chunk_fwd`'s solve
precision, a `Constexpr` in place of Triton's."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable


class Constexpr:
    """Stands in for `triton.language.constexpr`: a value in `.value`."""

    def __init__(self, value: object) -> None:
        self.value = value


def install_fake_fla(monkeypatch, forward: Callable, precision: object = "tf32") -> types.ModuleType:
    """Put a fake fla package in `sys.modules` (undone with `monkeypatch`) whose chunked forward is `forward` and
    whose fused solve names `precision` (a `Constexpr` of it; None: no such setting, as in another fla version).
    Returns the fake `chunk_fwd` module."""
    for name in ("fla", "fla.ops", "fla.ops.gated_delta_rule"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    chunk = types.ModuleType("fla.ops.gated_delta_rule.chunk")
    chunk.chunk_gated_delta_rule_fwd = forward
    chunk_fwd = types.ModuleType("fla.ops.gated_delta_rule.chunk_fwd")
    if precision is not None:
        chunk_fwd.SOLVE_TRIL_DOT_PRECISION = Constexpr(precision)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk", chunk)
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule.chunk_fwd", chunk_fwd)
    return chunk_fwd
