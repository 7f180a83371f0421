"""MTP speculative decoding on the CUDA backend (skipped without a CUDA device): the verify kernels
(`gated_delta/triton_verify.py`, `conv/triton_verify.py`) in the engine.

- fp32 (IEEE: the runner sets TRITON_F32_DEFAULT): greedy tokens with MTP on equal MTP off, token for token, on the
  cache-equivalence workload (prefix caching on: shared prompts, resends, n = 2), with oracle drafts that are
  partly right so verify rows accept every count of drafts and roll back; the cache's integrity after every step.
- bf16 (CUDA graphs on for decode-only steps, the head's hidden rows kept by the graphs): through `LLM`, with the
  random head; greedy agreement is reported, not asserted (a random model's nearly flat bf16 logits flip where the
  verify kernel's and fla's roundings differ: docs/design.md, "CUDA backend").
"""

from __future__ import annotations

import pytest
import torch

from .model_folders import write_tiny_model
from .spec_helpers import make_engine, oracle, send_twice, tokens_of
from .test_cache_equivalence import run_workload

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize(("k", "kv"), [(2, "auto"), (3, "auto"), (2, "fp8")])
def test_cuda_greedy_mtp_equals_no_mtp_fp32(tmp_path_factory, k, kv):
    """(kv "fp8": the target's and the head's KV in e4m3, one pool tensor, on both sides.)"""
    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    # a pool of CPU size: check_integrity after every step walks every block in Python (a pool sized from the
    # GPU's memory, millions of blocks of this tiny model, takes seconds a step)
    options = {"device": "cuda", "dtype": "float32", "enforce_eager": True, "num_blocks": 4096,
               "kv_cache_dtype": kv}
    off = tokens_of(run_workload(make_engine(folder, None, enable_prefix_caching=False, **options)))
    engine = make_engine(folder, k, **options)
    oracle(engine, off, seed=k)
    assert tokens_of(run_workload(engine, check_every_step=True)) == off
    stats = engine.drafter.stats
    kv_dtype = torch.float8_e4m3fn if kv == "fp8" else torch.float32
    assert [pool.dtype for pool in engine.runner.pools.kv_groups] == [kv_dtype]
    print(f"k={k} kv {kv} fp32 CUDA: drafts {stats.num_draft_tokens}, accepted {stats.num_accepted_tokens}, "
          f"per position {stats.accepted_per_position}, cache hits {engine.stats()['cache'].num_hits}")
    assert stats.num_accepted_tokens > 0 and all(n > 0 for n in stats.accepted_per_position), stats
    assert stats.num_accepted_tokens < stats.num_draft_tokens  # and some rejected: rollbacks ran


@needs_cuda
def test_cuda_seeded_sampling_with_mtp_equals_without_and_after_a_zero_prefill_hit(tmp_path_factory):
    """fp32: a seeded request's tokens with MTP (oracle drafts, partly right) equal MTP off, and its resend (a
    zero-prefill hit, which drafts a step later) draws the same: each emitted token costs the generator one draw,
    the judge's `_draw` the same exponential race on the device generator as `sample_async`'s rows (the CPU twin
    is test_speculative.py's)."""
    from hybridcache.sampling import SamplingParams

    folder = write_tiny_model(tmp_path_factory.mktemp("seeded"), "qwen3_5_text", seed=1)
    options = {"device": "cuda", "dtype": "float32", "enforce_eager": True, "num_blocks": 4096}
    prompt = [(37 * i + 11) % 256 for i in range(170)]
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True, n=2)

    off = send_twice(make_engine(folder, None, **options), prompt, params)
    wanted = [c.token_ids for c in off[0].outputs]
    engine = make_engine(folder, 2, **options)
    oracle(engine, {o.request_id: [c.token_ids for c in o.outputs] for o in off}, seed=5)
    on = send_twice(engine, prompt, params)
    assert on[1].num_cached_tokens == len(prompt)
    assert [[c.token_ids for c in o.outputs] for o in on] == [wanted, wanted]
    assert 0 < engine.drafter.stats.num_accepted_tokens < engine.drafter.stats.num_draft_tokens


@needs_cuda
def test_cuda_llm_bf16_with_graphs(tmp_path_factory):
    from hybridcache import LLM
    from hybridcache.sampling import SamplingParams

    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = [[(7 * i + j) % 256 for j in range(150 + 13 * i)] for i in range(4)]
    off = [o.outputs[0].token_ids for o in LLM(folder, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2
                                               ).generate(prompts, params, use_tqdm=False)]
    on_llm = LLM(folder, device="cuda", dtype="bfloat16", gpu_memory_utilization=0.2,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    assert on_llm.engine.runner.graph_batch_sizes  # decode-only steps replay graphs that keep the hidden rows
    on = [o.outputs[0].token_ids for o in on_llm.generate(prompts, params, use_tqdm=False)]
    same = sum(next((j for j, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x)) for x, y in zip(on, off))
    print(f"bf16 CUDA, random head: {same} of {sum(map(len, off))} tokens agree up to each completion's first "
          f"difference; spec stats {on_llm.engine.drafter.stats}")
    assert all(len(x) == 40 for x in on)
    on_llm.engine.check_integrity()


@needs_cuda
def test_cuda_verify_graphs_replay_equals_eager(tmp_path_factory):
    """bf16 verify steps (every row k drafts) replay their captured graphs; the same static batches run eagerly
    (`without_replay`) give the same greedy tokens, rollbacks included (the random head's drafts are rejected)."""
    import contextlib

    from hybridcache import LLM
    from hybridcache.sampling import SamplingParams

    folder = write_tiny_model(tmp_path_factory.mktemp("next"), "qwen3_next")
    llm = LLM(folder, device="cuda", dtype="bfloat16", max_num_seqs=8, gpu_memory_utilization=0.2,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    runner = llm.engine.runner
    assert runner._verify_graphs is not None and runner._verify_graphs.sizes == (1, 2, 4, 8)
    loads = []
    load = runner._verify_graphs.load
    runner._verify_graphs.load = lambda batch, size: (loads.append(size), load(batch, size))
    prompts = torch.randint(0, 256, (8, 40), generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    runs = []
    for mode in (contextlib.nullcontext, runner.without_replay):
        with mode():
            llm.engine.clear_cache()
            runs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)])
    print(f"verify graphs: {len(loads)} verify steps through the graphs (buckets {sorted(set(loads))})")
    assert loads and runs[0] == runs[1]
    llm.engine.check_integrity()
