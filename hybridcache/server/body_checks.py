"""Checks on a decoded JSON request body before its schema is validated: every problem is an
`APIError(400)` whose `param` names the field, as a dotted path (`messages.0.content`).

- Strings (values and keys) must be encodable as UTF-8: JSON's `\\ud800` escape decodes to a lone surrogate,
  which no tokenizer and no response can encode.
- Nesting is at most `MAX_JSON_DEPTH` levels (the walk is iterative: no recursion on client data); the
  error names the top-level field that holds the deep value.
- Fields this server does not implement (`UNSUPPORTED_FIELDS`, `UNSUPPORTED_MESSAGE_FIELDS`) are refused
  unless they hold a neutral value (what leaving them out means), so a request never silently loses a
  field it relies on. Only an assistant message's content may be null (a message of tool calls).

Worked example: `{"messages": [{"role": "user", "content": "a\\ud800b"}]}` fails with param
`messages.0.content`; `{"min_p": 0.1}` fails with param `min_p`; `{"min_p": 0}` passes.
"""

from __future__ import annotations

import json
from typing import Any

from hybridcache.server.errors import APIError

MAX_JSON_DEPTH = 128

# Request fields this server does not implement, with the values that mean "off" (sending one of those is
# the same as leaving the field out). Implementing a field = removing its entry here and handling it in
# protocol.py.
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "use_beam_search": (None, False),
    "length_penalty": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none"),
    "bad_words": (None, []),
    "allowed_token_ids": (None,),
    "prompt_embeds": (None,),
    "audio": (None,),
    "prediction": (None,),
    "modalities": (None, ["text"]),
    "chat_template": (None,),
    "documents": (None,),
    "verbosity": (None,),
    "web_search_options": (None,),
    "logprob_token_ids": (None,),
    "priority": (None, 0),
    "thinking_token_budget": (None, -1),
    "repetition_detection": (None,),
}

# Why some of them are refused, where more can be said than "not implemented" (the 400's message adds it).
UNSUPPORTED_REASONS: dict[str, str] = {
    "chat_template": "a request may not bring its own chat template (vLLM too refuses one unless started with "
                     "--trust-request-chat-template): the model folder's template, or the server's --chat-template, "
                     "renders every request",
    "bad_words": "not implemented; logit_bias of -100 on a word's token ids keeps it out",
    "allowed_token_ids": "not implemented; logit_bias, or a guided_choice / guided_regex constraint, limits the "
                         "tokens",
    "priority": "this server has no priority scheduling (requests are served first come, first served); vLLM too "
                "refuses a priority other than 0 unless started with --scheduling-policy priority",
    "logprob_token_ids": "not implemented; logprobs with top_logprobs (chat) or logprobs k (completions) give the "
                         "likeliest tokens' logprobs",
    "thinking_token_budget": "not implemented; reasoning_effort \"none\" (or chat_template_kwargs "
                             "{\"enable_thinking\": false}) turns thinking off, and max_tokens bounds the reasoning "
                             "and the answer together",
    "repetition_detection": "not implemented; max_tokens bounds a reply that repeats itself",
}

# Fields of a chat message this server does not implement (same rule).
UNSUPPORTED_MESSAGE_FIELDS: dict[str, tuple[Any, ...]] = {
    "function_call": (None,),
    "audio": (None,),
}


def check_body(data: dict[str, Any]) -> None:
    """Raise APIError(400) naming the field for the first problem of a decoded request object (see the
    module docstring)."""
    _check_strings_and_depth(data)
    _refuse_unsupported(data, UNSUPPORTED_FIELDS, "")
    messages = data.get("messages")
    if messages is not None and data.get("continue_final_message") is True \
            and data.get("add_generation_prompt") is True:  # vLLM's rule; either alone opens the reply its own way
        raise APIError(400, "Cannot set both `continue_final_message` and `add_generation_prompt` to true: send "
                       "add_generation_prompt: false (or leave it out) to continue the final message",
                       param="add_generation_prompt")
    if isinstance(messages, list):
        for i, message in enumerate(messages):
            if not isinstance(message, dict):
                continue
            _refuse_unsupported(message, UNSUPPORTED_MESSAGE_FIELDS, f"messages.{i}.")
            if "content" in message and message["content"] is None and message.get("role") != "assistant":
                raise APIError(400, f"messages.{i}.content is null; only an assistant message may have null "
                               "content (a string or a list of text parts)", param=f"messages.{i}.content")


def _is_neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # bool is an int in Python: True must not pass as 1, nor False as 0
    return any(isinstance(value, bool) == isinstance(n, bool) and value == n for n in neutral)


def _refuse_unsupported(obj: dict[str, Any], fields: dict[str, tuple[Any, ...]], prefix: str) -> None:
    for name, neutral in fields.items():
        if name in obj and not _is_neutral(obj[name], neutral):
            shown = ", ".join(json.dumps(n) for n in neutral)
            reason = f": {UNSUPPORTED_REASONS[name]}" if not prefix and name in UNSUPPORTED_REASONS else ""
            raise APIError(400, f"{prefix}{name} is not supported by this server (leave it out or send {shown})"
                           f"{reason}", param=f"{prefix}{name}", code="unsupported_parameter")


def check_nested_value(name: str, value: Any) -> None:
    """The body's checks (encodable strings, at most `MAX_JSON_DEPTH` levels) on a value a field held as JSON text
    and the server decoded (`guided_json` sent as a string): an APIError(400) naming `name`."""
    _check_strings_and_depth({name: value})


def _check_strings_and_depth(data: Any) -> None:
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            _check_text(value, path or "body")
        elif isinstance(value, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                field = path.split(".", 1)[0]
                raise APIError(400, f"{field} is nested more than {MAX_JSON_DEPTH} levels deep (at {path[:200]})",
                               param=field)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, item in items:
                if isinstance(key, str) and not _encodable(key):
                    shown = key.encode("utf-8", "backslashreplace").decode("utf-8")  # names it, encodable
                    field = f"{path}.{shown}" if path else shown
                    raise APIError(400, f"the key {field} holds a lone UTF-16 surrogate", param=field)
                stack.append((item, f"{path}.{key}" if path else str(key), depth + 1))


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _check_text(text: str, path: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise APIError(400, f"{path} holds a lone UTF-16 surrogate ({text[error.start]!r} at character "
                       f"{error.start}); send valid Unicode text", param=path) from None
