"""Token logprobs (`hybridcache.sampling.TokenLogprob`) in the two OpenAI shapes.

Chat: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}`.
Completions: `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}`.
Prompt logprobs (vLLM's shape, both endpoints): `[null, {"<token id>": {"logprob", "rank", "decoded_token"}}, ...]`.
A token's text is its own decode (special tokens included); a token that is only part of a UTF-8 character
decodes to U+FFFD, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from hybridcache.sampling import PromptLogprobs, TokenLogprob


class _Decoder(Protocol):
    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


def _entry(tokenizer: _Decoder, token_id: int, logprob: float) -> dict[str, Any]:
    text = tokenizer.decode([token_id], skip_special_tokens=False)
    return {"token": text, "logprob": max(logprob, -9999.0), "bytes": list(text.encode("utf-8"))}


def chat_logprobs(tokenizer: _Decoder, entries: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = []
    for entry in entries:
        item = _entry(tokenizer, entry.token_id, entry.logprob)
        item["top_logprobs"] = [_entry(tokenizer, t, lp) for t, lp in entry.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(tokenizer: _Decoder, entries: Sequence[TokenLogprob], text_offset: int = 0,
                        with_top: bool = True) -> dict[str, Any]:
    """`text_offset`: where the first token's text starts in the choice's text (after an echoed prompt)."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    offset = text_offset
    for entry in entries:
        text = tokenizer.decode([entry.token_id], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(max(entry.logprob, -9999.0))
        offsets.append(offset)
        offset += len(text)
        if with_top:
            top = {tokenizer.decode([t], skip_special_tokens=False): max(lp, -9999.0) for t, lp in entry.top}
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops if with_top else None,
            "text_offset": offsets}


def prompt_logprobs_json(entries: PromptLogprobs) -> list[dict[str, dict[str, Any]] | None]:
    """`RequestOutput.prompt_logprobs` as JSON: token ids become string keys, logprobs are floored at -9999."""
    return [None if entry is None else {
        str(token): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.decoded_token}
        for token, lp in entry.items()
    } for entry in entries]
