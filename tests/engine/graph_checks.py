"""The graph-replay check shared by the one-rank and the tensor-parallel CUDA graph tests."""

from __future__ import annotations

import torch

GRAPH_PROMPTS = torch.randint(0, 256, (32, 40), generator=torch.Generator().manual_seed(0)).tolist()


def replay_and_eager_tokens(llm) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of 32 equal-length prompts decoding 400 tokens in lockstep (every decode step is a 32-row
    bucket), with graph replay and then with the very same captured batches run eagerly (`without_replay`),
    the cache cleared before each run."""
    from hybridcache import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    runs = []
    for mode in ("replay", "eager"):
        llm.engine.clear_cache()
        if mode == "replay":
            outputs = llm.generate(GRAPH_PROMPTS, params, use_tqdm=False)
        else:
            with llm.engine.runner.without_replay():
                outputs = llm.generate(GRAPH_PROMPTS, params, use_tqdm=False)
        runs.append([list(o.outputs[0].token_ids) for o in outputs])
    return runs[0], runs[1]
