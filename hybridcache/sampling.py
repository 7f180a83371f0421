"""Sampling parameters (validated at construction) and the sampler that turns logits into tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

_SEED_LIMIT = 1 << 63  # seeds are 64-bit signed integers (torch's generator takes seed + completion index)


def _as_tuple(name: str, value: object, expected: str) -> tuple:
    """`value` (a list, tuple or other iterable) as a tuple; a TypeError naming the field for anything else."""
    try:
        return tuple(value)
    except TypeError:
        raise TypeError(f"{name} must be {expected}, got {type(value).__name__} {value!r}") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one request's completions, in the shape vLLM users know.

    temperature 0 means greedy (deterministic). `top_k` 0 or -1 disables top-k; `top_p` 1.0 disables
    nucleus sampling. `seed` makes random sampling reproducible (completion i of n uses seed + i).
    `stop` holds strings that end a completion (the text is cut before the stop string).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        # Accept lists from callers but store tuples, so the object stays hashable and immutable.
        stop_token_ids = _as_tuple("stop_token_ids", self.stop_token_ids, "a list of integers")
        object.__setattr__(self, "stop_token_ids", stop_token_ids)
        stop = (self.stop,) if isinstance(self.stop, str) else _as_tuple("stop", self.stop, "a list of strings")
        object.__setattr__(self, "stop", stop)
        checks = [
            (isinstance(self.temperature, (int, float)) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
             f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (isinstance(self.n, int) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}"),
            (self.seed is None or (isinstance(self.seed, int) and -_SEED_LIMIT <= self.seed < _SEED_LIMIT),
             f"seed must be an integer in [-2**63, 2**63), got {self.seed!r}"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}"),
            (all(isinstance(s, str) and s for s in stop), f"stop must hold non-empty strings, got {stop!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def make_generator(params: SamplingParams, index: int, device: torch.device | str) -> torch.Generator | None:
    """The random generator of completion `index` of a request, or None for greedy sampling."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.seed is None:
        generator.seed()
    else:
        generator.manual_seed(params.seed + index)
    return generator


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """Sample one token per row.

    logits: [num_seqs, vocab] fp32; params[i] and generators[i] belong to row i.
    Greedy rows take the argmax. Other rows apply temperature, then top-k, then top-p (keeping at least the
    most likely token), then draw from their own generator, so a row's draw does not depend on the others.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, generator) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        scores = logits[row].float() / p.temperature
        if p.top_k > 0:
            kth = torch.topk(scores, min(p.top_k, scores.numel())).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            outside = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = int(torch.multinomial(probs, 1, generator=generator).item())
    return tokens
