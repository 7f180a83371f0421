"""The sparse MoE block's shared expert on the side CUDA stream (`kernels/streams.py`, `layers/mlp.py`) gives the
bits of the same kernels run on one stream (every fork run inline).

Next-1b's MoE shapes (hidden 2,048, 16 experts of 512, top-4, a shared expert of 512) in bf16 on `CudaBackend`,
three blocks chained (x + block(x), so later forks reuse memory the earlier ones freed), at 1, 16 and 64 tokens:
- eager: the one fused input GEMM on the main stream, SwiGLU + down on the side stream == the same on one stream,
  bit for bit, twice (the second time every side-stream allocation reuses memory the first freed);
- in a captured CUDA graph: the forward captured once (after an eager warm-up, as the engine does) and replayed
  twice with new inputs copied in, each replay == the forward run eagerly on one stream, bit for bit;
- FP8 experts and shared expert with the shared expert not stacked with the experts (inputs that do not fuse):
  the shared expert's gate | up and down on the side stream, eagerly and replayed, == one stream.
The forks really take the side stream (counted), and the CPU reference backend never does (it runs inline).
All on CUDA (skipped without it) but the last.
"""

from __future__ import annotations

import pytest
import torch

import hybridcache.kernels.backend as kernel_backend
from hybridcache.kernels import streams
from hybridcache.kernels.backend import ReferenceBackend
from hybridcache.layers.mlp import SparseMoeBlock
from tests.kernels.interpreter import needs_cuda

HIDDEN, EXPERTS, TOP_K, WIDTH, SHARED, BLOCKS = 2048, 16, 4, 512, 512, 3
TOKENS = pytest.mark.parametrize("tokens", [1, 16, 64])


class _Step:
    """What the MoE block reads of a step: its backend."""

    def __init__(self, backend: object) -> None:
        self.backend = backend


def make_blocks(device: str, seed: int = 0) -> list[SparseMoeBlock]:
    torch.manual_seed(seed)
    blocks = []
    for _ in range(BLOCKS):
        with torch.device(device):  # made there (next-1b's experts: seconds to draw on the CPU)
            block = SparseMoeBlock(HIDDEN, num_experts=EXPERTS, top_k=TOP_K, moe_intermediate_size=WIDTH,
                                   shared_expert_intermediate_size=SHARED, norm_topk_prob=True)
        with torch.no_grad():
            for param in block.parameters():
                param.normal_(0, param.shape[-1] ** -0.5)
        blocks.append(block.to(torch.bfloat16))
    return blocks


def forward(blocks: list[SparseMoeBlock], x: torch.Tensor, step: _Step) -> torch.Tensor:
    for block in blocks:
        x = x + block(x, step)
    return x


def inputs(tokens: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)


def counting_fork(monkeypatch: pytest.MonkeyPatch, *, inline: bool = False) -> list[bool]:
    """Patch the layer's fork: record whether each call was given a side stream; `inline`: run every fork on the
    current stream (the one-stream run of the same kernels)."""
    taken: list[bool] = []

    def fork(stream, fn, *args):
        taken.append(stream is not None)
        return streams.fork(None if inline else stream, fn, *args)

    monkeypatch.setattr(kernel_backend, "fork", fork)
    return taken


def one_stream(blocks: list[SparseMoeBlock], x: torch.Tensor, step: _Step, monkeypatch: pytest.MonkeyPatch
               ) -> torch.Tensor:
    """The forward with every fork run inline: the same kernels on one stream."""
    with monkeypatch.context() as patch:
        counting_fork(patch, inline=True)
        out = forward(blocks, x, step)
    torch.cuda.synchronize()
    return out


@needs_cuda
@TOKENS
@torch.inference_mode()
def test_side_stream_equals_one_stream_eagerly(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    step = _Step(kernel_backend.get_backend("cuda"))
    blocks = make_blocks("cuda")
    x = inputs(tokens, seed=tokens)
    want = one_stream(blocks, x, step, monkeypatch)
    taken = counting_fork(monkeypatch)
    for _ in range(2):  # the second time every side-stream allocation reuses memory the first freed
        got = forward(blocks, x, step)
        torch.cuda.synchronize()
        assert torch.equal(got, want)
    assert taken == [True] * (2 * BLOCKS)


@needs_cuda
@TOKENS
@torch.inference_mode()
def test_side_stream_in_a_cuda_graph(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    step = _Step(kernel_backend.get_backend("cuda"))
    blocks = make_blocks("cuda", seed=1)
    taken = counting_fork(monkeypatch)
    static = inputs(tokens, seed=100)
    captured = capture(lambda: forward(blocks, static, step))
    assert taken == [True] * (2 * BLOCKS)
    for seed in (7, 8):
        x = inputs(tokens, seed)
        got = replay(captured, static, x)
        assert torch.equal(got, one_stream(blocks, x, step, monkeypatch))


def capture(run) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """(graph, its output) of `run` captured after an eager warm-up on a stream of its own, as the engine captures
    its decode graphs. The capture fails at its end if a fork was left unjoined."""
    warm = torch.cuda.Stream()
    warm.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warm):
        run()
    torch.cuda.current_stream().wait_stream(warm)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph, out


def replay(captured: tuple[torch.cuda.CUDAGraph, torch.Tensor], static: torch.Tensor, x: torch.Tensor
           ) -> torch.Tensor:
    """The graph's output for input x (copied into its static input), cloned."""
    graph, out = captured
    static.copy_(x)
    graph.replay()
    torch.cuda.synchronize()
    return out.clone()


@needs_cuda
@pytest.mark.parametrize("tokens", [16, 64])
def test_an_unstacked_fp8_shared_expert_on_the_side_stream(tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """FP8 experts and shared expert beside a bf16 router (the inputs do not fuse) with the shared expert run by the
    layer (`fuses_shared_expert` made False): its gate | up and down on the side stream, the FP8 routed experts on
    the main one, then `sigmoid_gate_add` after the join; equal to the same kernels on one stream, eagerly and
    replayed from a graph."""
    from hybridcache.fp8_format import BLOCK
    from hybridcache.kernels import cuda_backend
    from tests.kernels.test_fp8_shared_expert import moe_block

    monkeypatch.setattr(cuda_backend.CudaBackend, "fuses_shared_expert", lambda self, experts, shared: False)
    with torch.no_grad():
        block = moe_block(BLOCK, torch.Generator().manual_seed(3)).to("cuda", torch.bfloat16)
    assert not block.inputs.fused()
    step = _Step(kernel_backend.get_backend("cuda"))
    with torch.inference_mode():
        static = torch.randn(tokens, 256, device="cuda").to(torch.bfloat16)
        want = one_stream([block], static, step, monkeypatch)
        taken = counting_fork(monkeypatch)
        assert torch.equal(forward([block], static, step), want)
        captured = capture(lambda: forward([block], static, step))
        assert taken == [True] * 3
        x = torch.randn(tokens, 256, device="cuda").to(torch.bfloat16)
        assert torch.equal(replay(captured, static, x), one_stream([block], x, step, monkeypatch))


def test_the_reference_backend_runs_the_shared_expert_inline(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    block = SparseMoeBlock(64, num_experts=6, top_k=2, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                           norm_topk_prob=True)
    taken = counting_fork(monkeypatch)
    with torch.no_grad():
        out = block(torch.randn(5, 64), _Step(ReferenceBackend()))
    assert out.shape == (5, 64) and taken == [False]
    assert block.inputs.weight is not None  # the one fused input GEMM
