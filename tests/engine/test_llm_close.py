"""`LLM.close()` and `with LLM(...) as llm:` free the engine (the tensor-parallel case, workers included, is in
tests/distributed/test_shutdown.py)."""

from __future__ import annotations

import gc
import weakref

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.engine.engine import EngineDeadError


def test_close_frees_the_runner_and_refuses_work_after():
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with LLM(block_size=16, max_model_len=64, max_num_seqs=2) as llm:
        assert len(llm.generate("abc", params, use_tqdm=False)[0].outputs[0].token_ids) == 3
        llm.engine.add_request("left running", "xyz", params)  # close() aborts what still runs
        runner = weakref.ref(llm.engine.runner)
    gc.collect()
    assert runner() is None  # nothing holds the model and the pools any more
    assert not llm.engine.has_unfinished_requests()
    for call in (lambda: llm.generate("abc", params, use_tqdm=False), llm.engine.check_integrity):
        with pytest.raises(EngineDeadError, match="closed"):
            call()
    llm.close()  # idempotent
