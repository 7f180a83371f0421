"""The token ids a completions or chat body becomes, as the server renders them (app.py), for the callers
that need them without generating: the dry-run match (`POST /v1/cache/match`) and the router.

Images are not loaded here: a chat message's image parts are dropped from the text (the router predicts
such prompts as text; their spans make them a miss wherever the blocks hold images).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridcache.server.errors import APIError
from hybridcache.server.protocol import ChatCompletionRequest, CompletionRequest, parse_request


def body_prompt_ids(body: dict[str, Any], tokenizer: Any, default_template_kwargs: dict[str, Any] | None = None,
                    check_text: Callable[[list, str], None] | None = None) -> list[list[int]]:
    """Every prompt of a decoded JSON body: a chat body (it has `messages`) renders through the chat template
    with its tools, `reasoning_effort` and `chat_template_kwargs` (over `default_template_kwargs`),
    `add_generation_prompt` and `continue_final_message`; a completions body's prompts are encoded (token-id
    prompts kept). `check_text(prompts, param)` sees the prompts before they are encoded (the server refuses a
    text too long to fit). `truncate_prompt_tokens` is not applied here. Raises `APIError(400)` naming the
    problem."""
    if isinstance(body, dict) and "messages" in body:
        chat: ChatCompletionRequest = parse_request(ChatCompletionRequest, body)
        messages = [_text_only(m.as_template_input()) for m in chat.messages]
        kwargs = chat.template_kwargs(default_template_kwargs or {})
        try:
            text = tokenizer.apply_chat_template(
                messages, add_generation_prompt=chat.add_generation_prompt, tools=chat.tool_dicts(),
                continue_final_message=chat.continue_final_message, template_kwargs=kwargs)
        except Exception as error:  # noqa: BLE001 - template errors are the client's
            raise APIError(400, f"the chat template could not render these messages: {error}",
                           param="messages") from None
        if check_text is not None:
            check_text([text], "messages")
        return [tokenizer.encode(text)]
    completion: CompletionRequest = parse_request(CompletionRequest, body)
    prompts = completion.prompts()
    if check_text is not None:
        check_text(prompts, "prompt")
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


IMAGE_STAND_IN = "\ufffc"  # OBJECT REPLACEMENT CHARACTER: where an image was, in a prompt predicted as text


def _text_only(message: dict[str, Any]) -> dict[str, Any]:
    """The message with its content as text: text parts as they are, any other part (an image) as
    `IMAGE_STAND_IN`, so that no cached text-only prompt matches past an image (dropped, the texts around it met
    and matched a prompt without the image: a false hit predicted)."""
    content = message.get("content")
    if isinstance(content, list):
        text = "".join(p.get("text", "") if p.get("type") == "text" else IMAGE_STAND_IN
                       for p in content if isinstance(p, dict))
        message = {**message, "content": text}
    return message
