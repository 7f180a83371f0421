"""The memory plan (`hybridcache.engine.memory`): runtime slots + one pool of blocks for KV and checkpoint states,
and the CPU engine's defaults."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridcache.engine.memory import MemoryPlan, engine_share, plan_memory, pool_bytes, state_pages
from hybridcache.state_spec import AttentionSpec, RecurrentSpec, StateTensorSpec

GIB = 1 << 30
# The docstring's model: random Qwen3-Next 1.39B in bf16, block 64 (fp32 ssm, bf16 conv, a 4 KiB last_hidden).
KV = 4 * 2 * 64 * 2 * 256 * 2
STATE = 12 * (32 * 128 * 128 * 4 + 8192 * 3 * 2) + 2048 * 2
K = 50


def plan(budget: int, **kwargs) -> MemoryPlan:
    options = dict(kv_bytes_per_block=KV, state_bytes_per_slot=STATE, max_num_seqs=64, block_size=64, min_blocks=10)
    return plan_memory(budget, **{**options, **kwargs})


def test_pool_bytes_of_specs():
    attention = AttentionSpec(num_kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    recurrent = RecurrentSpec((StateTensorSpec("conv", (8192, 3), torch.bfloat16),
                               StateTensorSpec("ssm", (32, 128, 128), torch.float32)))
    specs = [recurrent, recurrent, recurrent, attention] * 4
    last_hidden = StateTensorSpec("last_hidden", (2048,), torch.bfloat16)
    assert pool_bytes(specs, 64, (last_hidden,)) == (KV, STATE)
    assert pool_bytes(specs, 64) == (KV, STATE - 4096)


def test_state_pages():
    assert state_pages(STATE, KV) == K  # 24.57 MiB / 512 KiB = 49.13
    assert state_pages(50 * KV, KV) == 50 and state_pages(50 * KV + 1, KV) == 51
    assert (state_pages(1, KV), state_pages(KV, KV), state_pages(KV + 1, KV)) == (1, 1, 2)
    assert state_pages(STATE, 0) == 1  # no attention layer: a page store of slot-sized rows
    with pytest.raises(ValueError, match="last_hidden"):
        state_pages(0, KV)


def test_docstring_example():
    got = plan(100 * GIB)
    assert (got.num_blocks, got.num_runtime_slots, got.state_pages) == (201_655, 64, K)
    assert (got.kv_bytes, got.state_bytes) == (201_655 * KV, 64 * STATE)
    assert 0 <= 100 * GIB - got.kv_bytes - got.state_bytes < KV  # nothing left that could buy another block
    assert got.num_blocks // K == 4_033  # checkpoint states, when the pool holds nothing else
    assert got.describe() == ("pool 98.5 GiB: 201,655 blocks of 512 KiB, KV and checkpoint states (a state = 50 "
                              "blocks) + 64 runtime state slots 1.5 GiB, of a 100 GiB budget")


def test_explicit_counts():
    """num_blocks: the pool is that many blocks (KV and checkpoint states alike); without it, the budget's rest."""
    blocks = plan(10 * GIB, num_blocks=1000)
    assert (blocks.num_blocks, blocks.kv_bytes, blocks.budget_bytes) == (1000, 1000 * KV, 10 * GIB)
    rest = plan(10 * GIB)
    assert rest.num_blocks == (10 * GIB - 64 * STATE) // KV


def test_too_small_budgets_fail():
    with pytest.raises(ValueError, match="no device memory"):
        plan(-1)
    with pytest.raises(ValueError, match="need .* GiB; the budget is 1.00 GiB"):
        plan(GIB, num_blocks=10_000)
    with pytest.raises(ValueError, match="max_model_len"):
        plan(64 * STATE + 9 * KV)
    assert plan(64 * STATE + 10 * KV).num_blocks == 10  # exactly one sequence of max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        plan(GIB, num_blocks=9)
    with pytest.raises(ValueError, match=r"max_model_len \(with its 3 speculative tokens of lookahead\) needs 10"):
        plan(GIB, num_blocks=9, num_speculative_tokens=3)  # (min_blocks counts the lookahead's blocks)


def test_models_without_one_kind_of_layer():
    """No recurrent layer: a slot is last_hidden alone, one block holds a state. No attention layer: blocks are
    rows of a page store, S bytes each, one per state; a sequence still needs its (empty) blocks."""
    hidden = 2048 * 2
    dense_attention = plan(GIB, state_bytes_per_slot=hidden)
    assert dense_attention.state_pages == 1
    assert dense_attention.num_blocks == (GIB - 64 * hidden) // KV
    recurrent_only = plan(4 * GIB, kv_bytes_per_block=0, min_blocks=0)
    assert recurrent_only.state_pages == 1
    assert recurrent_only.num_blocks == (4 * GIB - 64 * STATE) // STATE
    assert recurrent_only.kv_bytes == recurrent_only.num_blocks * STATE


def test_fixed_plan_and_description():
    got = MemoryPlan.fixed(num_blocks=10 + 3 * K, num_runtime_slots=2, kv_bytes_per_block=KV,
                           state_bytes_per_slot=STATE)
    assert (got.num_blocks, got.state_pages, got.num_runtime_slots) == (10 + 3 * K, K, 2)
    assert got.budget_bytes == (10 + 3 * K) * KV + 2 * STATE
    assert "160 blocks of 512 KiB" in got.describe() and "2 runtime state slots" in got.describe()
    store = MemoryPlan.fixed(num_blocks=13, num_runtime_slots=2, kv_bytes_per_block=0, state_bytes_per_slot=STATE)
    assert (store.num_blocks, store.state_pages, store.kv_bytes) == (13, 1, 13 * STATE)


def test_cpu_runner_plan(tmp_path):
    """On the CPU (`build_runner`): 2 x max_num_seqs sequences of KV plus 32 checkpoint states of k blocks in the
    pool, max_num_seqs runtime slots; the runner's pools have those counts (no scratch rows without graphs)."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.rank_runner import RunnerSpec, build_runner
    from hybridcache.layers.parallel import TensorParallel

    from .model_folders import write_tiny_model

    folder = write_tiny_model(tmp_path, "qwen3_5_text")
    runner, got = build_runner(RunnerSpec(folder, EngineConfig(max_num_seqs=2), 512), TensorParallel(),
                               torch.device("cpu"))
    paged = runner.paged_states
    assert got.state_pages == paged.k == state_pages(paged.slot_bytes, paged.page_bytes) >= 1
    assert got.num_blocks == 2 * 2 * 512 // 64 + 32 * got.state_pages and got.num_runtime_slots == 2
    assert got.state_bytes == 2 * paged.slot_bytes and got.kv_bytes == got.num_blocks * paged.page_bytes
    assert {kv.shape[2] for kv in runner.pools.kv_groups} == {got.num_blocks * 64 // runner.pools.kernel_block_size}
    assert {state.shape[1] for state in runner.pools.state_groups} == {2}


def test_cpu_engine_keeps_its_defaults(tmp_path, caplog):
    """On the CPU: max_model_len capped at 8192, 2 x max_num_seqs sequences of KV plus 32 checkpoint states in the
    pool; the startup summary is logged once."""
    import logging

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    from .model_folders import write_tiny_model

    folder = write_tiny_model(tmp_path, "qwen3_5_text", max_position_embeddings=100_000)
    with caplog.at_level(logging.INFO, logger="hybridcache.engine"):
        engine = LLMEngine(folder, EngineConfig(max_num_seqs=2))
    assert engine.max_model_len == 8192
    plan = engine.memory_plan
    assert engine.num_blocks == plan.num_blocks == 2 * 2 * 8192 // 64 + 32 * plan.state_pages
    assert plan.num_runtime_slots == 2
    summaries = [r.getMessage() for r in caplog.records if r.name == "hybridcache.engine"]
    assert len(summaries) == 1 and "max_model_len 8192" in summaries[0] and "cuda graphs off" in summaries[0]


def test_vision_encoder_reserve_is_taken_first():
    """The vision encoder's reserve leaves the budget before the runtime slots and the pool; the line says so."""
    reserve = 3 * GIB
    got = plan(100 * GIB, encoder_bytes=reserve)
    assert got.encoder_bytes == reserve and got.budget_bytes == 100 * GIB
    assert got.num_blocks == (100 * GIB - reserve - 64 * STATE) // KV
    assert got.num_blocks == plan(100 * GIB).num_blocks - 6_144  # 3 GiB of 512 KiB blocks
    assert 0 <= 100 * GIB - reserve - got.kv_bytes - got.state_bytes < KV
    assert got.describe().endswith("+ 64 runtime state slots 1.5 GiB + vision encoder 3 GiB reserved, of a 100 GiB "
                                   "budget")
    assert "vision encoder" not in plan(100 * GIB).describe()
    with pytest.raises(ValueError, match="after the vision encoder's 3.00 GiB"):
        plan(10 * GIB, encoder_bytes=reserve, num_blocks=(10 * GIB - 64 * STATE) // KV)  # fits only without it
    with pytest.raises(ValueError, match="vision encoder's reserve .4.00 GiB"):
        plan(4 * GIB, encoder_bytes=4 * GIB)


def test_the_engine_share_is_its_own_whatever_other_processes_hold():
    """`gpu_memory_utilization` is this engine's share of the device (vLLM's meaning): the docstring's example, a
    100 GiB device of which another process holds 40 GiB."""
    assert engine_share(0.5, 100 * GIB, free_at_start=60 * GIB) == 50 * GIB
    assert engine_share(0.6, 100 * GIB, free_at_start=60 * GIB) == int(0.6 * 100 * GIB)  # all of what is free
    with pytest.raises(ValueError, match=r"gpu_memory_utilization 0.7 asks for 70.00 GiB of the device's 100.00 "
                                         r"GiB, but only 60.00 GiB were free when the engine started"):
        engine_share(0.7, 100 * GIB, free_at_start=60 * GIB)
    # two engines at 0.45 share one device: the second's share is not cut by the first's 45 GiB
    first = engine_share(0.45, 100 * GIB, free_at_start=99 * GIB)
    assert engine_share(0.45, 100 * GIB, free_at_start=99 * GIB - first) == first


def test_a_pool_sized_per_sequence_holds_the_speculative_lookahead(tmp_path):
    """With MTP (k drafts) a chunk that samples needs blocks 3k positions past its end (`Scheduler._lookahead`);
    the runner sized its pools for 2k (`rank_runner`), so a pool planned to the minimum (a tight CUDA budget) was a
    block short: a request near max_model_len was preempted and re-admitted forever (helper 101's hunt). One
    `blocks_per_sequence` now serves the engine's check, the runner's plan and the scheduler's lookahead."""
    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine
    from hybridcache.sampling import SamplingParams
    from hybridcache.scheduler.scheduler import blocks_per_sequence

    from .model_folders import write_tiny_model
    from .spec_helpers import spec

    assert blocks_per_sequence(58, 16, 3) == 5 and blocks_per_sequence(58, 16, 0) == 4
    folder = write_tiny_model(tmp_path, "qwen3_5_text")
    config = EngineConfig(block_size=16, kernel_block_size=8, max_model_len=58, max_num_seqs=1,
                          enable_prefix_caching=False, speculative_config=spec(3))
    engine = LLMEngine(folder, config)  # the CPU's default pool: 2 x max_num_seqs sequences + 32 states
    states = engine.memory_plan.num_blocks - 2 * blocks_per_sequence(58, 16, 3)
    assert states == 32 * engine.memory_plan.state_pages
    tight = LLMEngine(folder, dataclasses.replace(config, num_blocks=blocks_per_sequence(58, 16, 3)))
    tight.add_request("r", list(range(1, 41)), SamplingParams(temperature=0, max_tokens=18, ignore_eos=True))
    steps = 0
    while tight.has_unfinished_requests():
        outputs = tight.step()
        steps += 1
        assert steps < 40
    assert len(outputs[0].outputs[0].token_ids) == 18 and tight.scheduler.num_preemptions == 0


def test_cuda_budget_keeps_the_backends_workspace_out(monkeypatch):
    """The pools' bytes on CUDA: the share, less what loading took, the measured activation peak and the backend's
    workspace beyond it for the model's shapes (`KernelBackend.workspace_bytes`: Kimi's expanded MLA prefill at its
    cap), asked for the step's tokens. The measurement and the device's free memory are stood in for: only the
    arithmetic runs here."""
    from types import SimpleNamespace

    from hybridcache.engine import rank_runner
    from hybridcache.kernels.backend import ReferenceBackend
    from hybridcache.kernels.shapes import ModelShapes

    asked: list[tuple] = []

    class Backend:
        def workspace_bytes(self, shapes, num_tokens: int, dtype: torch.dtype) -> int:
            asked.append((shapes, num_tokens, dtype))
            return 300

    monkeypatch.setattr(rank_runner, "measure_activation_bytes", lambda *args, **kwargs: 1_000)
    monkeypatch.setattr(rank_runner.torch.cuda, "mem_get_info", lambda device: (60_000, 100_000))
    config = SimpleNamespace(block_size=16, kernel_block_size=16)
    shapes = ModelShapes(None, None, 128, 128)
    rest = (config, 512, torch.bfloat16, torch.float32, torch.device("cpu"), 50_000, 80_000, shapes)
    assert rank_runner._cuda_budget(None, Backend(), *rest) == 50_000 - (80_000 - 60_000) - 1_000 - 300
    assert asked == [(shapes, 512, torch.bfloat16)]
    assert rank_runner._cuda_budget(None, ReferenceBackend(), *rest) == 50_000 - 20_000 - 1_000
