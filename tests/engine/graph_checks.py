"""The graph-replay check shared by the one-rank and the tensor-parallel CUDA graph tests."""

from __future__ import annotations

import contextlib

import torch

GRAPH_PROMPTS = torch.randint(0, 256, (32, 40), generator=torch.Generator().manual_seed(0)).tolist()


def greedy_tokens(llm) -> list[list[int]]:
    """Greedy tokens of 32 equal-length prompts decoding 400 tokens in lockstep (every decode step is a 32-row
    bucket), the cache cleared first."""
    from hybridcache import SamplingParams

    llm.engine.clear_cache()
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate(GRAPH_PROMPTS, params, use_tqdm=False)]


def replay_and_eager_tokens(llm) -> tuple[list[list[int]], list[list[int]]]:
    """`greedy_tokens` with graph replay, then with the very same captured batches run eagerly (`without_replay`)."""
    runs = []
    for mode in (contextlib.nullcontext, llm.engine.runner.without_replay):
        with mode():
            runs.append(greedy_tokens(llm))
    return runs[0], runs[1]
