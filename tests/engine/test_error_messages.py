"""Errors name the field the user sent (issue 13): engine options and sampling parameters."""

from __future__ import annotations

import pytest

from hybridcache import LLM, SamplingParams
from hybridcache.sampling import make_generator


def test_llm_block_size_48_works_with_a_fitting_kernel_page():
    llm = LLM(block_size=48, max_model_len=96, max_num_seqs=2)
    assert (llm.engine.config.block_size, llm.engine.config.kernel_block_size) == (48, 16)
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1


@pytest.mark.parametrize("field, value", [("stop", 5), ("stop_token_ids", 7), ("stop", None)])
def test_a_scalar_where_a_list_belongs_names_the_field(field, value):
    with pytest.raises(TypeError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_seed_out_of_range_names_seed():
    for seed in (2**64, 2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="^seed must be an integer in"):
            SamplingParams(seed=seed)
    top = SamplingParams(seed=2**63 - 1, n=4, temperature=1.0)
    assert make_generator(top, 3, "cpu") is not None  # seed + index still fits torch's generator
    assert make_generator(SamplingParams(seed=-(2**63), temperature=1.0), 0, "cpu") is not None
