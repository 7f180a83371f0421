"""The token ids a router predicts a request's hits for: the prompts each replica will run, as its routes
(server/app.py) make them, so that a prediction is the hit the replica's cache gives.

    completions, chat       the body's prompts, rendered as server/prompt_ids.py renders them (chat template,
                            tools, ...)
    POST /v1/responses      the chat request it runs as; one that continues a stored response: none (its
                            conversation is on its replica, router/responses.py)
    POST /v1/messages       the chat request it runs as (server/anthropic_protocol.py)

then, as the replica treats them:

    prompt_logprobs         none: such a request (also completions' `echo` with `logprobs`) computes its whole
                            prompt and takes nothing from the prefix cache
    truncate_prompt_tokens  the k ids it keeps (`Truncation`: the last k, or the first with `truncation_side:
                            "right"`; -1: as many as `max_model_len - max_tokens` leaves), a text tokenized by
                            the window that holds them only (`Truncation.text_window`), as the replica does
    a text over the limit   none: a text of more than `max_model_len x max_token_bytes` bytes is refused by the
                            replica by its size, before it is tokenized (limits.check_prompt_bytes), so it is not
                            tokenized here either (a 16 MiB prompt took the router 12 s and 4 GiB)

No prompts means every replica predicts 0: the request goes by load alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridcache.router.responses import RESPONSES_PATH
from hybridcache.server.anthropic_protocol import MESSAGES_PATH, MessagesRequest
from hybridcache.server.anthropic_protocol import chat_request as anthropic_chat_request
from hybridcache.server.prompt_ids import body_prompt_ids
from hybridcache.server.protocol import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    ChatCompletionRequest,
    CompletionRequest,
    Truncation,
    parse_request,
)
from hybridcache.server.responses_api import ResponsesRequest, chat_request, input_messages


@dataclass(frozen=True)
class PromptLimits:
    """What bounds the prompts a replica takes. max_model_len: the replicas' (the largest of their /v1/models
    cards; None: not known yet); token_bytes: the most UTF-8 bytes one token of the tokenizer stands for
    (`limits.max_token_bytes`; None: the tokenizer does not say)."""

    max_model_len: int | None = None
    token_bytes: int | None = None

    @property
    def limit_bytes(self) -> int | None:
        """The size over which a replica refuses a prompt text untokenized (None: no such limit known)."""
        if self.max_model_len is None or self.token_bytes is None:
            return None
        return self.max_model_len * self.token_bytes


class _Rendered(Exception):  # noqa: N818 - not an error: carries the prompts out of `body_prompt_ids`
    def __init__(self, prompts: list) -> None:
        super().__init__()
        self.prompts = prompts


def _stop_before_encoding(prompts: list, param: str) -> None:
    """`body_prompt_ids`'s `check_text` hook, called with the rendered prompts before any is encoded: takes
    them out, so that they are sized and cut here before being encoded."""
    raise _Rendered(prompts)


def routed_prompt_ids(path: str, body: Any, tokenizer: Any, template_kwargs: dict[str, Any] | None = None,
                      limits: PromptLimits = PromptLimits()) -> list[list[int]]:
    """The prompts (token ids) a request is predicted by (module docstring); [] for none. Raises
    `APIError(400)` for a body the replica would refuse as malformed."""
    if path == RESPONSES_PATH:
        request: ResponsesRequest = parse_request(ResponsesRequest, body)
        if request.previous_response_id:
            return []
        body = chat_request(request, input_messages(request.input))
    elif path == MESSAGES_PATH:  # (an image block is let through: `body_prompt_ids` predicts it as a stand-in)
        body = anthropic_chat_request(parse_request(MessagesRequest, body), takes_images=True)
    try:
        body_prompt_ids(body, tokenizer, template_kwargs, _stop_before_encoding)
    except _Rendered as rendered:
        prompts = rendered.prompts
    else:  # pragma: no cover - body_prompt_ids calls the hook for every body it accepts
        raise AssertionError("the prompts were encoded before the router saw them")
    chat = "messages" in body
    parsed = parse_request(ChatCompletionRequest if chat else CompletionRequest, body)
    if parsed.engine_prompt_logprobs() is not None:
        return []
    cut = _truncation(parsed, chat, limits.max_model_len)
    limit_bytes = limits.limit_bytes
    texts = [p for p in prompts if isinstance(p, str)]
    if cut is None and limit_bytes is not None and any(_over(text, limit_bytes) for text in texts):
        return []
    if cut is not None and limits.token_bytes is not None:  # the replica's window: token_bytes chars a token
        prompts = [cut.text_window(p, limits.token_bytes, 1) if isinstance(p, str) else p for p in prompts]
    ids = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]
    return ids if cut is None else [cut.apply(p) for p in ids]


def _over(text: str, limit_bytes: int) -> bool:
    """Whether `text` is over `limit_bytes` in UTF-8 (limits.check_prompt_bytes's rule)."""
    return len(text) > limit_bytes // 4 and len(text.encode("utf-8", "replace")) > limit_bytes


def _truncation(parsed: ChatCompletionRequest | CompletionRequest, chat: bool,
                max_model_len: int | None) -> Truncation | None:
    """What the replica keeps of the prompt (`_SamplingRequest.truncation`); None when it keeps it all or the
    request is a 400 there. -1 without a known `max_model_len`: None (the prompt predicted whole). A request
    without max_tokens is taken at the default the replica uses without a generation config's (completions: 16,
    chat: 0)."""
    k = parsed.truncate_prompt_tokens
    if k is None or k == 0 or k < -1:
        return None
    side = parsed.truncation_side or "left"
    if k > 0:
        return Truncation(k, side)
    if max_model_len is None:
        return None
    if chat:
        requested = parsed.requested_max_tokens() or 0
    else:
        requested = 1 if parsed.max_tokens == 0 else (parsed.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
    room = max_model_len - requested
    return Truncation(room, side) if room >= 1 else None
