"""One owner of a sequence's tokens, end to end: async scheduling (a sampled token fed as `PENDING_TOKEN`, its value
given a step later), MTP verify rows (kept drafts and the rollback) and preemption (re-admission with the same list)
in one run. Greedy tokens equal a synchronous run without MTP and without caching, and after every step the cache
is intact (its trie nodes equal the sequences' lists) and reads each running sequence's very `Seq.token_ids`."""

from __future__ import annotations

import pytest

from hybridcache.config import EngineConfig
from hybridcache.engine.engine import LLMEngine

from .model_folders import write_tiny_model
from .spec_helpers import make_engine, oracle, spec, tokens_of
from .test_cache_equivalence import run_workload


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("owner"), "qwen3_5_text", seed=1)


def test_async_mtp_and_preemption_equal_a_synchronous_run(model_dir):
    workload = {"seed": 1}
    off = tokens_of(run_workload(make_engine(model_dir, None, enable_prefix_caching=False, async_scheduling=False),
                                 **workload))
    engine = LLMEngine(model_dir, EngineConfig(
        block_size=16, kernel_block_size=8, max_num_batched_tokens=256, max_num_seqs=6, async_scheduling=True,
        num_blocks=16, max_model_len=224, speculative_config={**spec(2), "disable_by_batch_size": 2}))
    oracle(engine, off, seed=3)
    decided = []
    speculating = engine._speculating
    engine._speculating = lambda: decided.append(speculating()) or decided[-1]
    check = engine.check_integrity

    def check_one_owner() -> None:
        check()
        scheduler = engine.scheduler
        for seq in scheduler.running:
            assert scheduler.cache._seqs[seq.seq_id].token_ids is seq.token_ids, seq.seq_id

    engine.check_integrity = check_one_owner
    assert tokens_of(run_workload(engine, check_every_step=True, **workload)) == off
    assert True in decided and False in decided  # verify steps and overlapped plain steps
    assert engine.drafter.stats.num_accepted_tokens > 0
    assert engine.stats()["num_preemptions"] > 0
