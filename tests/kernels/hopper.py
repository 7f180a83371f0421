"""Compile a Triton kernel for the H200 (sm90) on a machine without a GPU: Triton's front end, its Hopper passes
and ptxas all run on the CPU, so a kernel the interpreter runs but the compiler rejects fails in the test suite,
not on the device. Import it only after `pytest.importorskip("triton")`."""

from __future__ import annotations

import re

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)
_GLOBAL_MEMORY = re.compile(r"\b(ld\.global|st\.global|atom\.|red\.|cp\.async)")


def compile_for_hopper(kernel, pointers: dict[str, str], ints: list[str], constants: dict, num_warps: int = 4,
                       floats: tuple[str, ...] = ()):
    """`kernel` compiled for sm90 with these argument types (pointers by name, e.g. "*bf16"; `ints` i32; `floats`
    fp32; `constants` the constexpr values, defaulted ones optional), in the kernel's own parameter order; KeyError
    names a parameter that was given no type. Returns the compiled kernel (`.asm["ptx"]`, `.asm["ttgir"]`, ...).

    A kernel with a `PDL` parameter (`kernels/pdl.py`) is compiled as the engine launches it on an H200, PDL=True
    unless `constants` says otherwise, and its PTX is checked against pdl.py's contract: the wait for the kernel
    before comes ahead of every global load, store, atomic and async copy."""
    if any(param.name == "PDL" for param in kernel.params):
        constants = {"PDL": True, **constants}
    # a constexpr the kernel defaults takes its default, as a launch that does not pass it
    constants = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **constants}
    types = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(floats, "fp32"),
             **dict.fromkeys(constants, "constexpr")}
    signature = {param.name: types[param.name] for param in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    compiled = triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": 4})
    if constants.get("PDL"):
        check_pdl_first(compiled.asm["ptx"])
    return compiled


def check_pdl_first(ptx: str) -> None:
    """Raise AssertionError unless `griddepcontrol.wait` precedes every global memory access of `ptx`."""
    wait = ptx.find("griddepcontrol.wait")
    first = _GLOBAL_MEMORY.search(ptx)
    assert wait >= 0, "a PDL kernel without griddepcontrol.wait"
    assert first is None or wait < first.start(), f"global memory touched before the PDL wait: {first.group(0)}"
