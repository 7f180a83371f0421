"""Tool-call tags that are special tokens. Kimi's `<|tool_calls_section_begin|>`, LFM2's `<|tool_call_start|>`,
Jamba's `<tool_calls>` (and Granite 4's or Nemotron's tags in some releases) are special tokens of their
tokenizers, so a completion decoded the default way (`skip_special_tokens`) loses them and the parser sees the call
as bare text. As vLLM's parsers do (their `adjust_request`), a chat request whose tools are parsed is decoded with
special tokens kept where the parser's tags are special; the server then takes the other special tokens out of the
text before reasoning and tool calls are read, so the message shows what the default decode would show:

    tokens   <|tool_calls_section_begin|> ... <|tool_calls_section_end|> <|im_end|>(stop: never in the text)
    decoded with special tokens, then `strip` with the texts of `strippable`: every tag kept, nothing else special

`strippable` is None when no tag of the format is special (the request is decoded as it asks).

The reasoning parser's section tags (`ReasoningParser.call_sections`: Kimi's, special in Kimi's tokenizer) are kept
the same way, tools or not: vLLM's kimi_k2 reasoning parser ends the reasoning at the section's token id, which a
text decoded with special tokens skipped no longer shows. Where the tool parser does not read them (no tools parsed,
or another format) they are kept for the reasoning split only and then taken out of the content
(`ChatOutputOptions.split_only_tags`), so the content shows what the default decode shows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from hybridcache.server.reasoning import THINK_END, THINK_START


def special_token_texts(hf_tokenizer: Any) -> frozenset[str]:
    """The texts of the tokens a tokenizer marks special: its named special tokens and every added token with
    `special: true` (what `skip_special_tokens` drops)."""
    texts = set(getattr(hf_tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(hf_tokenizer, "added_tokens_decoder", None) or {}).values():
        if getattr(token, "special", False):
            texts.add(str(token.content))
    return frozenset(text for text in texts if text)


def strippable(specials: frozenset[str], tags: Iterable[str]) -> tuple[str, ...] | None:
    """The special-token texts to take out of a completion decoded with special tokens kept, when a tool-call
    format with these `tags` needs them kept (one of its tags is special): every special text but the tags and the
    think tags, longest first; None when no tag is special."""
    tags = set(tags)
    if not tags & specials:
        return None
    return tuple(sorted(specials - tags - {THINK_START, THINK_END}, key=lambda text: (-len(text), text)))


def stripper(texts: tuple[str, ...]) -> re.Pattern[str] | None:
    """A pattern of `texts` (None for none), for `strip`."""
    return re.compile("|".join(map(re.escape, texts))) if texts else None


def strip(text: str, pattern: re.Pattern[str] | None) -> str:
    """`text` without the special-token texts `pattern` matches (`stripper`)."""
    return text if pattern is None else pattern.sub("", text)
