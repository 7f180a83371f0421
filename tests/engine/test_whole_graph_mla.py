"""Which one-sequence steps of a model with MLA layers leave their whole-step graph (whose MLA runs absorbed) for the
piecewise graphs, whose eager cores run it expanded (`prefill_graphs.leaves_whole_graph`); the steps CUDA runs this
way are checked against eager runs by the CUDA engine tests (tests/engine/test_kimi_linear_engine.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from hybridcache.engine.prefill_graphs import ABSORBED_MLA_S_PER_PAIR_HEAD, absorbed_mla_s_per_pair, leaves_whole_graph
from hybridcache.layers.parallel import TensorParallel
from hybridcache.models import ModelConfig
from hybridcache.models.random_weights import tiny_hf_config
from tests.models.kimi_helpers import released_kimi_config


def test_long_contexts_leave_the_whole_graph_short_turns_and_short_contexts_keep_it():
    kimi = released_kimi_config()  # 7 MLA layers of 32 heads
    per_pair = absorbed_mla_s_per_pair(SimpleNamespace(config=kimi, tp=TensorParallel()))
    assert per_pair == pytest.approx(7 * 32 * ABSORBED_MLA_S_PER_PAIR_HEAD)
    assert leaves_whole_graph(per_pair, 512, 16_000, 16)  # ~42 ms absorbed
    assert not leaves_whole_graph(per_pair, 512, 15_000, 16)  # ~40 ms: within the budget
    assert leaves_whole_graph(per_pair, 2048, 4_000, 16)
    assert not leaves_whole_graph(per_pair, 200, 16_200, 16)  # phase C's + 200 request: ~17 ms, its graph
    assert not leaves_whole_graph(per_pair, 64, 200_000, 16)  # 64 queries a key: eager would run it absorbed too
    rank = absorbed_mla_s_per_pair(SimpleNamespace(config=kimi, tp=TensorParallel(0, 2)))
    assert rank == pytest.approx(per_pair / 2)  # a rank of two holds 16 heads
    assert not leaves_whole_graph(rank, 512, 16_000, 16) and leaves_whole_graph(rank, 512, 31_000, 16)
    qwen = ModelConfig.from_dict(tiny_hf_config("qwen3_next").to_dict())
    assert absorbed_mla_s_per_pair(SimpleNamespace(config=qwen, tp=TensorParallel())) == 0.0
    assert not leaves_whole_graph(0.0, 4096, 10**6, 16)
