"""Compile a Triton kernel for the H200 (sm90) on a machine without a GPU: Triton's front end, its Hopper passes
and ptxas all run on the CPU, so a kernel the interpreter runs but the compiler rejects fails in the test suite,
not on the device. Import it only after `pytest.importorskip("triton")`."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

HOPPER = GPUTarget("cuda", 90, 32)


def compile_for_hopper(kernel, pointers: dict[str, str], ints: list[str], constants: dict, num_warps: int = 4,
                       floats: tuple[str, ...] = ()):
    """`kernel` compiled for sm90 with these argument types (pointers by name, e.g. "*bf16"; `ints` i32; `floats`
    fp32; `constants` the constexpr values), in the kernel's own parameter order; KeyError names a parameter that
    was given no type. Returns the compiled kernel (`.asm["ptx"]`, `.asm["ttgir"]`, ...)."""
    types = {**pointers, **dict.fromkeys(ints, "i32"), **dict.fromkeys(floats, "fp32"),
             **dict.fromkeys(constants, "constexpr")}
    signature = {param.name: types[param.name] for param in kernel.params}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=HOPPER, options={"num_warps": num_warps, "num_stages": 4})
