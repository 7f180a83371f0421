"""Nothing compiles after start-up: once `LLM(...)` returns on CUDA, serving requests of any shape compiles no Triton
kernel (a kernel compiled while serving stalls its request by 0.5-3 s on a fresh machine). CUDA with the cuda extra
only; skipped without them.

The engine compiles at start-up what it can launch: the profiling forward (prefill kernels, fla's autotuned ones),
the MoE block's tiles and sort buckets (`moe/grouped.compile_tiles`), one save per KV group and a prefill and a
decode on the real pools (`ModelRunner._compile_copies`, `_compile_on_pools`), the decode graphs; run-time counts
(tokens, pairs, splits) are left unspecialised (`do_not_specialize`) and block tables are padded to 16 columns. This
test serves a mix of shapes that start-up did not run (fresh prompts of 1 to 1,500 tokens around every multiple of
16 and of the sort's buckets, prefix hits and extensions of them, mixed prefill + decode batches of 1 to 40
sequences) and fails on any Triton compile it sees, naming the kernel, the part of its key that differs from
start-up's and the engine frames that launched it. Every other hybrid family's test file runs the same on its tiny
folders (`hybrid_family_checks.test_serving_compiles_no_kernel_after_start_up`).
"""

from __future__ import annotations

import traceback

import pytest
import torch

from .markers import needs_cuda_engine
from .model_folders import prompts_of, write_tiny_model


class CompileRecorder:
    """Triton's `jit_cache_hook`: called for every kernel specialisation a process has not run yet (compiled, or
    loaded from the disk cache), before it is built; records its name and key (start-up's apart, until
    `start_serving`) and lets the compile go ahead."""

    def __init__(self) -> None:
        self.seen: list[str] = []  # "name key=..." of each compile once serving started
        self.callers: list[str] = []  # the engine's frames that launched each of them, innermost last
        self.startup: dict[str, list[str]] = {}  # kernel name -> the keys start-up compiled
        self._serving = False

    def __call__(self, *, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 (Triton's names)
        if self._serving:
            self.seen.append(f"{fn.name} key={key}")
            self.callers.append(_engine_frames())
        else:
            self.startup.setdefault(fn.name, []).append(str(key))
        return None

    def start_serving(self) -> None:
        """From here on every compile is one start-up did not do."""
        self._serving, self.seen, self.callers = True, [], []

    def explain(self) -> str:
        """Each compile seen while serving, with the parts of its key that differ from the nearest key start-up
        compiled for the same kernel (a key is Triton's list of (type, specialisation) per argument, then the
        launch options), or that start-up never compiled the kernel."""
        lines = []
        for entry, caller in zip(self.seen, self.callers, strict=True):
            name, key = entry.split(" key=", 1)
            parts = key.split("), (")
            known = [k.split("), (") for k in self.startup.get(name, [])]
            if not known:
                lines.append(f"{name}: never compiled at start-up; key {key}; launched from {caller}")
                continue
            nearest = min(known, key=lambda k: sum(a != b for a, b in zip(k, parts)) + abs(len(k) - len(parts)))
            diff = [f"#{i}: start-up {b!r}, serving {a!r}" for i, (a, b) in enumerate(zip(parts, nearest)) if a != b]
            lines.append(f"{name}: {'; '.join(diff) or 'same parts'} (of {len(known)} start-up key(s)); key {key}; "
                         f"launched from {caller}")
        return "\n".join(lines)


def _engine_frames(depth: int = 8) -> str:
    """The innermost `depth` frames of the current stack in the hybridcache package, outermost first."""
    frames = [f for f in traceback.extract_stack() if "/hybridcache/" in f.filename][-depth:]
    return " > ".join(f"{f.filename.rsplit('/hybridcache/', 1)[1]}:{f.lineno} {f.name}" for f in frames)


@pytest.fixture
def compile_recorder():
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None:
        pytest.skip("this Triton has no knobs.runtime.jit_cache_hook")
    recorder = CompileRecorder()
    saved, knobs.runtime.jit_cache_hook = knobs.runtime.jit_cache_hook, recorder
    try:
        yield recorder
    finally:
        knobs.runtime.jit_cache_hook = saved


def serve_mixed_shapes(llm) -> int:
    """Requests of many shapes, one at a time and in batches; returns the number of requests served."""
    from hybridcache import SamplingParams

    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    few = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    lengths = (1, 2, 3, 15, 16, 17, 31, 33, 63, 64, 65, 100, 127, 128, 129, 200, 255, 257, 300, 511, 513, 777, 1500)
    prompts = prompts_of(lengths, seed=1)
    served = 0
    for prompt in prompts:  # fresh prompts, one at a time
        llm.generate([prompt], one, use_tqdm=False)
        served += 1
    for i, prompt in enumerate(prompts):  # a full hit, then extensions of every length class past a cached prefix
        extension = prompts_of((1 + 7 * i,), seed=100 + i)[0]
        llm.generate([prompt], one, use_tqdm=False)
        llm.generate([prompt + extension], few, use_tqdm=False)
        served += 2
    for size in (2, 3, 5, 8, 13, 24, 40):  # mixed prefill + decode steps; 40 sequences exceed max_num_seqs
        batch = prompts_of([17 + 29 * j for j in range(size)], seed=size)
        llm.generate(batch, few, use_tqdm=False)
        served += size
    return served


@needs_cuda_engine
def test_serving_compiles_no_kernel_after_start_up(tmp_path, compile_recorder):
    from hybridcache import LLM
    from hybridcache.kernels.norm import triton as fused_norm

    folder = write_tiny_model(tmp_path, "qwen3_next")
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=32, gpu_memory_utilization=0.2)
    compile_recorder.start_serving()  # what start-up compiled is start-up's
    served = serve_mixed_shapes(llm)
    assert served > 100
    assert compile_recorder.seen == [], f"kernels compiled while serving:\n{compile_recorder.explain()}"
    # the recorder does see compiles: a norm of a width and dtype the model never runs is one
    fused_norm.rms_norm(torch.randn(3, 48, device="cuda", dtype=torch.float16),
                        torch.ones(48, device="cuda", dtype=torch.float16), 1e-6)
    assert any("rms_norm" in entry for entry in compile_recorder.seen)
