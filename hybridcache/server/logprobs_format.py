"""Token logprobs (`CompletionOutput.logprobs`, vLLM's shape) in the two OpenAI shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
Prompt logprobs (vLLM's shape, both endpoints): `[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`.
Echoed prompt logprobs (completions with `echo` and `logprobs`, as OpenAI's legacy API and vLLM): the prompt's tokens
lead the completions shape, the first with `null` logprob and top logprobs (nothing precedes it).
A token's text is the engine's `Logprob.decoded_token` (special tokens included; a token that holds bytes of a
UTF-8 character is "" until the token that completes the character, which carries it whole, as vLLM's:
`detokenizer.token_text`), so completions' `text_offset`s add up along the text and chat `bytes` join into it.
With `as_ids` (vLLM's `return_tokens_as_token_ids`) every token is named
"token_id:<id>" instead, text offsets counting those names, as vLLM's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hybridcache.sampling import Logprob, PromptLogprobs, SampleLogprobs, top_logprobs


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _name(token_id: int, text: str | None, as_ids: bool) -> str:
    """How logprobs name a token: its text, or "token_id:<id>" (`as_ids`)."""
    return f"token_id:{token_id}" if as_ids else text or ""


def _entry(token_id: int, lp: Logprob, as_ids: bool) -> dict[str, Any]:
    text = _name(token_id, lp.decoded_token, as_ids)
    return {"token": text, "logprob": max(lp.logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(token_ids: Sequence[int], entries: SampleLogprobs, k: int, as_ids: bool = False) -> dict[str, Any]:
    """`entries[i]`: token `token_ids[i]`'s entry, asked for with `logprobs=k` (`top_logprobs` holds the k
    likeliest)."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        item = _entry(token_id, entry[token_id], as_ids)
        item["top_logprobs"] = [_entry(t, lp, as_ids) for t, lp in top_logprobs(entry, token_id, k)]
        content.append(item)
    return {"content": content}


def completion_logprobs(token_ids: Sequence[int], entries: SampleLogprobs, text_offset: int = 0,
                        as_ids: bool = False) -> dict[str, Any]:
    """`entries[i]`: token `token_ids[i]`'s entry. `text_offset`: where the first token's text starts in the
    choice's text (after an echoed prompt). Each `top_logprobs` entry holds the sampled token first, then the k
    likeliest (as vLLM: k + 1 entries at most, k when the sampled token is among them; `logprobs: 0` gives the
    sampled token alone): the engine's entry, keyed by text (by "token_id:<id>" with `as_ids`). Two tokens that
    decode alike share a key, which holds the later one's logprob (as vLLM's dict comprehension)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = _name(token_id, entry[token_id].decoded_token, as_ids)
        tokens.append(text)
        token_logprobs.append(max(entry[token_id].logprob, -9999.0))
        offsets.append(offset)
        offset += len(text)
        top: dict[str, float] = {}
        for top_id, lp in entry.items():
            top[_name(top_id, lp.decoded_token, as_ids)] = max(lp.logprob, -9999.0)
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def trim_prompt_entry(entry: dict[int, Logprob], k: int) -> dict[int, Logprob]:
    """A prompt-logprobs entry (the prompt token first, then the likeliest tokens, best first) cut to the prompt
    token and the k likeliest: what a request for k gets when the engine computed more."""
    first = next(iter(entry))
    return {token: lp for token, lp in entry.items() if token == first or lp.rank <= k}


def prompt_logprobs_json(entries: PromptLogprobs, k: int | None = None) -> list[dict[str, dict[str, Any]] | None]:
    """`RequestOutput.prompt_logprobs` as JSON: token ids become string keys, logprobs are floored at -9999.
    `k`: keep only the k likeliest tokens besides the prompt token (None: all that were computed)."""
    return [None if entry is None else {
        str(token): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token, lp in (entry if k is None else trim_prompt_entry(entry, k)).items()
    } for entry in entries]


def echo_logprobs(tokenizer: _Decoder, prompt_ids: Sequence[int], entries: PromptLogprobs,
                  k: int, as_ids: bool = False) -> dict[str, Any]:
    """The prompt's part of an echoed completion's logprobs: `tokens` (the first token's own decode, then each
    entry's text, as the module docstring says),
    `token_logprobs` (`None` for the first token, then each prompt token's logprob given the tokens before it),
    `top_logprobs` (`None`, then `{token text: logprob}` of the prompt token and the k likeliest tokens, as vLLM
    gives them) and `text_offset` (from 0: the echoed prompt starts the choice's text)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(prompt_ids, entries):
        own = entry[token_id].decoded_token if entry is not None else \
            tokenizer.decode([token_id], skip_special_tokens=False)
        text = _name(token_id, own, as_ids)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            tops.append(None)
            continue
        token_logprobs.append(max(entry[token_id].logprob, -9999.0))
        tops.append({_name(t, lp.decoded_token, as_ids): max(lp.logprob, -9999.0)
                     for t, lp in trim_prompt_entry(entry, k).items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def join_logprobs(first: dict[str, Any], then: dict[str, Any] | None) -> dict[str, Any]:
    """Two completions-shape logprobs, one after the other (an echoed prompt's, then the generated tokens');
    `then`'s `text_offset`s are already absolute."""
    if then is None:
        return first
    return {key: list(first[key]) + list(then[key] or [None] * len(then["tokens"])) for key in first}
