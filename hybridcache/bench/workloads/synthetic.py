"""Generated workloads for shapes the traces lack; random token ids from `[0, min(vocab, 256))`, seeded.

`shared-prefix` (the SGLang generated-shared-prefix shape): G system prompts x M user questions. System
prompt lengths are drawn uniformly and moved off every multiple of 16, so a system prompt never ends on a
block boundary (B = 16, 32, 64, ... or 528 = 16 * 33); requests are shuffled and arrive `gap_s` apart::

    request (g, m) = system_prompt[g] (non-aligned length) + question[g][m];  output: fresh tokens

`group-sampling` (RL rollouts): P prompts, each sampled n times, all arriving together at t = 0; either as
n separate requests (`as_n=False`, in prompt order) or as one request with `n` completions (`as_n=True`).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from hybridcache.bench.workloads.base import SimRequest, Workload, random_tokens


def _off_grid(length: int) -> int:
    """`length` moved up by one when it is a multiple of 16."""
    return length + 1 if length % 16 == 0 else length


def shared_prefix_workload(
    *,
    seed: int = 0,
    num_groups: int = 16,
    questions_per_group: int = 32,
    system_len: tuple[int, int] = (1000, 3000),
    question_len: tuple[int, int] = (50, 400),
    output_len: tuple[int, int] = (32, 256),
    gap_s: float = 0.1,
    vocab: int = 256,
    num_requests: int | None = None,
) -> Workload:
    """G x M requests (see the module docstring); lengths are drawn uniformly in [lo, hi]."""
    rng = np.random.default_rng(seed)
    vocab = min(vocab, 256)
    systems = [random_tokens(rng, _off_grid(int(rng.integers(*system_len, endpoint=True))), vocab)
               for _ in range(num_groups)]
    pairs = [(g, m) for g in range(num_groups) for m in range(questions_per_group)]
    order = rng.permutation(len(pairs))
    pairs = [pairs[i] for i in order]
    if num_requests is not None:
        pairs = pairs[:num_requests]
    seeds = rng.integers(0, 2**62, size=len(pairs))

    def render() -> Iterator[SimRequest]:
        for i, ((g, m), s) in enumerate(zip(pairs, seeds)):
            r = np.random.default_rng(int(s))
            question = random_tokens(r, int(r.integers(*question_len, endpoint=True)), vocab)
            output = random_tokens(r, int(r.integers(*output_len, endpoint=True)), vocab)
            yield SimRequest(f"shared-prefix/{g}/{m}", systems[g] + question, output, arrival_s=i * gap_s,
                             session_id=f"shared-prefix/{g}")

    return Workload("shared-prefix", len(pairs), render)


def group_sampling_workload(
    *,
    seed: int = 0,
    num_prompts: int = 32,
    n: int = 8,
    as_n: bool = False,
    prompt_len: tuple[int, int] = (200, 2000),
    output_len: tuple[int, int] = (64, 512),
    vocab: int = 256,
    num_requests: int | None = None,
) -> Workload:
    """P prompts x n samples arriving together (see the module docstring). `num_requests` cuts the requests
    (with `as_n`, one request holds n samples)."""
    rng = np.random.default_rng(seed)
    vocab = min(vocab, 256)
    prompts = [random_tokens(rng, int(rng.integers(*prompt_len, endpoint=True)), vocab) for _ in range(num_prompts)]
    outputs = [[random_tokens(rng, int(rng.integers(*output_len, endpoint=True)), vocab) for _ in range(n)]
               for _ in range(num_prompts)]
    if as_n:
        requests = [SimRequest(f"group/{p}", prompts[p], outputs[p][0], session_id=f"group/{p}", n=n,
                               sibling_output_ids=tuple(outputs[p][1:])) for p in range(num_prompts)]
    else:
        requests = [SimRequest(f"group/{p}/{i}", prompts[p], outputs[p][i], session_id=f"group/{p}", turn=i)
                    for p in range(num_prompts) for i in range(n)]
    if num_requests is not None:
        requests = requests[:num_requests]
    requests = tuple(requests)
    return Workload("group-sampling-n" if as_n else "group-sampling", len(requests), lambda: iter(requests))
