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


@pytest.mark.parametrize("field, value", [("stop", 5), ("stop_token_ids", 7)])
def test_a_scalar_where_a_list_belongs_names_the_field(field, value):
    """(None is no scalar: vLLM's empty default, test_llm_vllm_api.py.)"""
    with pytest.raises(TypeError, match=f"^{field} must be"):
        SamplingParams(**{field: value})


def test_seed_out_of_range_names_seed():
    for seed in (2**64, 2**63, -(2**63) - 1):
        with pytest.raises(ValueError, match="^seed must be an integer in"):
            SamplingParams(seed=seed)
    top = SamplingParams(seed=2**63 - 1, n=4, temperature=1.0)
    assert make_generator(top, 3, "cpu") is not None  # seed + index still fits torch's generator
    assert make_generator(SamplingParams(seed=-(2**63), temperature=1.0), 0, "cpu") is not None


@pytest.mark.parametrize("params, field", [
    (SamplingParams(stop_token_ids=[3, 10**6]), "stop_token_ids"),
    (SamplingParams(logit_bias={2**31 - 1: 1.0}), "logit_bias"),
])
def test_token_ids_outside_the_vocabulary_are_refused_and_change_nothing(params, field):
    """Out-of-vocabulary ids used to be accepted (and a logit_bias entry looped over at every step)."""
    llm = LLM(block_size=16, max_model_len=64, max_num_seqs=2)
    vocab = llm.engine.model_config.vocab_size
    with pytest.raises(ValueError, match=f"^{field} holds .* the vocabulary has {vocab} tokens"):
        llm.engine.add_request("bad", "abc", params)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_integrity()
    last = SamplingParams(temperature=0, max_tokens=2, stop_token_ids=[vocab - 1], logit_bias={vocab - 1: -1.0})
    assert llm.generate("abc", last, use_tqdm=False)[0].outputs[0].token_ids  # the last id is a token id


def test_a_cuda_device_the_machine_lacks_is_a_value_error_naming_it():
    """It used to be torch's AssertionError ("Torch not compiled with CUDA enabled") or invalid device ordinal."""
    import torch

    missing = f"cuda:{torch.cuda.device_count()}"
    with pytest.raises(ValueError, match=f"^device {missing}: this machine has {torch.cuda.device_count()} CUDA "
                                         "devices"):
        LLM(device=missing, max_model_len=64, max_num_seqs=2)
