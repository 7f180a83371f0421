"""What `LLM.generate` returns: one `RequestOutput` per prompt, holding `n` `CompletionOutput`s."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.sampling import PromptLogprobs, TokenLogprob


@dataclass
class CompletionOutput:
    """One sampled completion. finish_reason: 'stop' (EOS, stop token or stop string), 'length'
    (max_tokens or the model length limit), 'abort', or None while it is still running. cached_tokens: prompt
    tokens this completion's sequence took from the prefix cache when it was first admitted. logprobs: one
    entry per token of `token_ids` when the request asked for logprobs, else None. num_draft_tokens /
    num_accepted_tokens: speculative decoding: the draft tokens its steps fed and the ones accepted (0 when off)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    cached_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass
class RequestOutput:
    """A request's result. `cached_tokens`: prompt tokens whose computation the prefix cache skipped
    (for n > 1, the smallest over its completions, each of which runs the prompt as its own sequence).
    `prompt_logprobs` (when the request's `SamplingParams.prompt_logprobs` is set, as vLLM's): one entry per
    prompt token, None for the first, then {token id: Logprob} holding the prompt token and the k likeliest
    tokens at that position."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
