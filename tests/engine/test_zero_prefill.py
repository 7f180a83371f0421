"""Zero-prefill hits (an identical prompt computes only its sample) and prompts shared in flight (`n > 1`,
prefix-sharing prompts of one batch prefill the shared part once), end to end through `LLM`."""

import pytest
import torch

from hybridcache import LLM, SamplingParams

from .model_folders import write_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def model_dir(request, tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def make_llm(model_dir, **options) -> LLM:
    defaults = dict(block_size=16, kernel_block_size=8, max_num_batched_tokens=1024, max_num_seqs=8,
                    max_model_len=1024)
    return LLM(model_dir, **{**defaults, **options})


def prefill_tokens(llm: LLM) -> int:
    return llm.engine.stats()["num_prefill_tokens"]


def test_identical_resend_computes_no_prefill_token(model_dir):
    prompt = prompt_of(600)
    llm = make_llm(model_dir)
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    before = prefill_tokens(llm)
    assert before == 600
    second = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens >= 599
    assert prefill_tokens(llm) == before
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    uncached = make_llm(model_dir, enable_prefix_caching=False).generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == uncached.outputs[0].token_ids
    llm.engine.check_integrity()


def test_n_completions_prefill_the_prompt_once(model_dir):
    prompt = prompt_of(500, seed=1)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, n=8)
    llm = make_llm(model_dir)
    out = llm.generate([prompt], params, use_tqdm=False)[0]
    assert prefill_tokens(llm) == 500
    uncached = make_llm(model_dir, enable_prefix_caching=False).generate([prompt], params, use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [c.token_ids for c in uncached.outputs]
    llm.engine.check_integrity()


def test_prefix_sharing_prompts_of_one_batch_fork_from_the_first(model_dir):
    shared = prompt_of(300, seed=2)
    prompts = [shared + prompt_of(200, seed=3), shared + prompt_of(150, seed=4), shared]
    llm = make_llm(model_dir)
    outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert prefill_tokens(llm) == 500 + 150  # the shared 300 once, each rest once, the third only samples
    assert [o.num_cached_tokens for o in outs] == [0, 300, 300]
    uncached = make_llm(model_dir, enable_prefix_caching=False).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in uncached]
    llm.engine.check_integrity()


def test_seed_mode_keeps_the_old_rules(model_dir):
    """LMDeploy's seed design: an identical resend is not a full hit, n completions each prefill."""
    prompt = prompt_of(100, seed=5)
    llm = make_llm(model_dir, cache_mode="seed")
    llm.generate([prompt], GREEDY, use_tqdm=False)
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens < 100
