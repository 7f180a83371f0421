"""The memory split (`hybridcache.engine.memory`) and the CPU engine's defaults."""

from __future__ import annotations

import pytest
import torch

from hybridcache.engine.memory import DEFAULT_TOKENS_PER_CHECKPOINT, MemoryPlan, plan_memory, pool_bytes
from hybridcache.state_spec import AttentionSpec, RecurrentSpec, StateTensorSpec

GIB = 1 << 30
# The docstring's model: random Qwen3-Next 1.39B in bf16, block 64.
KV = 4 * 2 * 64 * 2 * 256 * 2
STATE = 12 * (32 * 128 * 128 + 8192 * 3) * 4


def plan(budget: int, **kwargs) -> MemoryPlan:
    options = dict(kv_bytes_per_block=KV, state_bytes_per_slot=STATE, max_num_seqs=64, block_size=64, min_blocks=10)
    return plan_memory(budget, **{**options, **kwargs})


def test_pool_bytes_of_specs():
    attention = AttentionSpec(num_kv_heads=2, head_dim=256, dtype=torch.bfloat16)
    recurrent = RecurrentSpec((StateTensorSpec("conv", (8192, 3), torch.float32),
                               StateTensorSpec("ssm", (32, 128, 128), torch.float32)))
    specs = [recurrent, recurrent, recurrent, attention] * 4
    assert pool_bytes(specs, 64) == (KV, STATE)


def test_docstring_example():
    got = plan(100 * GIB)
    assert (got.num_blocks, got.num_checkpoint_slots, got.num_runtime_slots) == (78471, 2450, 64)
    assert got.num_slots == 2514
    assert got.kv_bytes + got.state_bytes <= 100 * GIB
    # nothing left that could buy another pair
    assert 100 * GIB - got.kv_bytes - got.state_bytes < STATE + KV * DEFAULT_TOKENS_PER_CHECKPOINT // 64


def test_split_rule_one_slot_per_tokens_per_checkpoint():
    for budget in (2 * GIB, 10 * GIB, 77 * GIB):
        got = plan(budget, tokens_per_checkpoint=4096)
        blocks_per_slot = got.num_blocks / got.num_checkpoint_slots
        assert 4096 // 64 <= blocks_per_slot < 4096 // 64 + 1 + (STATE + KV * 64) / KV / got.num_checkpoint_slots


def test_explicit_counts_take_their_share_first():
    slots = plan(10 * GIB, num_checkpoint_slots=100)
    assert slots.num_checkpoint_slots == 100
    assert slots.num_blocks == (10 * GIB - 164 * STATE) // KV
    blocks = plan(10 * GIB, num_blocks=1000)
    assert blocks.num_blocks == 1000
    assert blocks.num_checkpoint_slots == (10 * GIB - 64 * STATE - 1000 * KV) // STATE
    both = plan(10 * GIB, num_blocks=1000, num_checkpoint_slots=5)
    assert (both.num_blocks, both.num_checkpoint_slots) == (1000, 5)


def test_too_small_budgets_fail():
    with pytest.raises(ValueError, match="no device memory"):
        plan(-1)
    with pytest.raises(ValueError, match="need"):
        plan(GIB, num_blocks=10_000)
    with pytest.raises(ValueError, match="need"):
        plan(GIB, num_checkpoint_slots=1_000)
    with pytest.raises(ValueError, match="max_model_len"):
        plan(64 * STATE + 5 * KV)


def test_models_without_one_kind_of_layer():
    dense_attention = plan(GIB, state_bytes_per_slot=0)
    assert dense_attention.num_checkpoint_slots == 0 and dense_attention.num_blocks == GIB // KV
    recurrent_only = plan(4 * GIB, kv_bytes_per_block=0, min_blocks=0)
    assert recurrent_only.num_checkpoint_slots == (4 * GIB - 64 * STATE) // STATE


def test_fixed_plan_and_description():
    got = MemoryPlan.fixed(num_blocks=10, num_runtime_slots=2, num_checkpoint_slots=3, kv_bytes_per_block=KV,
                           state_bytes_per_slot=STATE)
    assert got.budget_bytes == 10 * KV + 5 * STATE
    assert "10 blocks" in got.describe() and "2 runtime + 3 checkpoint slots" in got.describe()


def test_cpu_engine_keeps_its_defaults(tmp_path, caplog):
    """On the CPU: max_model_len capped at 8192, 2 x max_num_seqs sequences of KV, 32 checkpoint slots; the
    startup summary is logged once."""
    import logging

    from hybridcache.config import EngineConfig
    from hybridcache.engine.engine import LLMEngine

    from .model_folders import write_tiny_model

    folder = write_tiny_model(tmp_path, "qwen3_5_text", max_position_embeddings=100_000)
    with caplog.at_level(logging.INFO, logger="hybridcache.engine"):
        engine = LLMEngine(folder, EngineConfig(max_num_seqs=2))
    assert engine.max_model_len == 8192
    assert engine.num_blocks == 2 * 2 * 8192 // 64
    assert engine.memory_plan.num_checkpoint_slots == 32 and engine.memory_plan.num_slots == 34
    summaries = [r.getMessage() for r in caplog.records if r.name == "hybridcache.engine"]
    assert len(summaries) == 1 and "max_model_len 8192" in summaries[0] and "cuda graphs off" in summaries[0]
