"""What `LLM.generate` returns: one `RequestOutput` per prompt, holding `n` `CompletionOutput`s (vLLM's fields)."""

from __future__ import annotations

from dataclasses import dataclass, field

from hybridcache.sampling import PromptLogprobs, SampleLogprobs


@dataclass
class CompletionOutput:
    """One sampled completion. finish_reason: 'stop' (EOS, stop token or stop string), 'length'
    (max_tokens or the model length limit), 'abort', or None while it is still running. stop_reason (vLLM's): the
    stop string or stop token id that ended it; None for the tokenizer's EOS token (unless `ignore_eos`), a
    completed grammar, 'length', 'abort' and while it runs. The model's other EOS ids count as stop tokens (vLLM's
    `update_from_generation_config` adds them to `stop_token_ids`): a stop on one of them names it.
    num_cached_tokens: prompt tokens this completion's sequence took from the prefix cache when it was first
    admitted. logprobs (vLLM's shape, when the request asked for them, else None): per token of `token_ids`,
    {token id: Logprob(logprob, rank, decoded_token)} holding the sampled token first, then the `logprobs` likeliest
    tokens (ranks 1..k; the sampled token is not repeated). cumulative_logprob: the sum of the sampled tokens'
    logprobs when logprobs were asked for, else None. num_draft_tokens / num_accepted_tokens: speculative decoding:
    the draft tokens its steps fed and the ones accepted (0 when off)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_cached_tokens: int = 0
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float | None = None
    stop_reason: str | int | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def finished(self) -> bool:
        """Whether the completion has ended (vLLM's method)."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """A request's result. `num_cached_tokens`: prompt tokens whose computation the prefix cache skipped
    (for n > 1, the smallest over its completions, each of which runs the prompt as its own sequence).
    `prompt_logprobs` (when the request's `SamplingParams.prompt_logprobs` is set, as vLLM's): one entry per
    prompt token, None for the first, then {token id: Logprob} holding the prompt token and the k likeliest
    tokens at that position. `metrics`, `lora_request`, `encoder_prompt`, `encoder_prompt_token_ids` and
    `kv_transfer_params` are vLLM's members for what this engine does not do: always None."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished: bool = False
    prompt_logprobs: PromptLogprobs | None = None
    metrics: None = None
    lora_request: None = None
    encoder_prompt: None = None
    encoder_prompt_token_ids: None = None
    kv_transfer_params: None = None


def add_delta(total: RequestOutput, delta: RequestOutput) -> RequestOutput:
    """`total` (a request's outputs so far, added up) with the next DELTA output `delta` added, in place; returns
    `total`. Each completion's token ids, text and logprobs are extended by `delta`'s; the other fields, which a
    DELTA output holds whole, become `delta`'s (the prompt logprobs stay the first output's). Costs O(what is new),
    amortized: the lists are extended, not copied. `delta` must not be used after (its lists may now be `total`'s).

        total "ab" [5, 6], delta "c" [7] finish "stop"  ->  total "abc" [5, 6, 7] finish "stop"
    """
    completions = {c.index: c for c in total.outputs}
    for new in delta.outputs:
        old = completions.get(new.index)
        if old is None:
            total.outputs.append(new)
            continue
        old.text += new.text
        old.token_ids.extend(new.token_ids)
        if old.logprobs is None:
            old.logprobs = new.logprobs
        elif new.logprobs is not None:
            old.logprobs.extend(new.logprobs)
        for name in ("finish_reason", "num_cached_tokens", "cumulative_logprob", "stop_reason", "num_draft_tokens",
                     "num_accepted_tokens"):
            setattr(old, name, getattr(new, name))
    total.num_cached_tokens = delta.num_cached_tokens
    total.finished = delta.finished
    if total.prompt_logprobs is None:
        total.prompt_logprobs = delta.prompt_logprobs
    return total


@dataclass(frozen=True)
class RequestProgress:
    """What one step did for a FINAL_ONLY request that is still running, whose output comes only when it ends
    (`LLMEngine.step_progress`): each completion's output tokens so far and whether it has ended, and the prompt's
    and the cached tokens' counts as its `RequestOutput` would give them. For a caller that times tokens (the
    server's time to first token and inter-token latency) without building outputs every step."""

    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: tuple[int, ...]
    finished: tuple[bool, ...]
