"""Text -> token ids for the chat workloads: a model folder's tokenizer and chat template, without torch.

`ChatEncoder.session(...)` turns a list of chat messages into a token-level `ChatSession` (see base.py):
the template is rendered with each reply replaced by a marker, and the text after the marker (end of the
assistant message, the next messages, the next generation prompt) becomes the turn's `after_ids`::

    render(history + [assistant: MARKER] + next messages, add_generation_prompt=True)
        = prompt_k text | MARKER | after_k text

An assistant message with `tool_calls` is rendered twice, with the marker and no calls (prompt_k and after_k
text) and as it is: the reply is what the second rendering holds between those two (its content and calls)::

    render(history + [assistant: content + tool_calls] + next messages, ...)
        = prompt_k text | content, tool call blocks | after_k text
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hybridcache.bench.workloads.base import ChatSession, ChatTurn

_MARKER = "\u2063HYBRIDCACHE-REPLY\u2063"


class ChatEncoder:
    """Encodes text and renders chat messages: `model_dir=None` is the built-in model (byte-level tokens,
    ChatML), built without writing the model folder; otherwise the folder's tokenizer.json and template."""

    def __init__(self, model_dir: str | Path | None = None) -> None:
        if model_dir is None:
            import jinja2

            from hybridcache.models.builtin import CHAT_TEMPLATE, build_byte_tokenizer

            tokenizer = build_byte_tokenizer()
            template = jinja2.Template(CHAT_TEMPLATE)
            self._encode = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
            self._render = lambda messages, gen: template.render(messages=messages, add_generation_prompt=gen)
        else:
            from hybridcache.tokenizer import Tokenizer

            tok = Tokenizer(model_dir)
            self._encode = tok.encode
            self._render = lambda messages, gen: tok.apply_chat_template(messages, add_generation_prompt=gen)

    def encode(self, text: str) -> tuple[int, ...]:
        return tuple(self._encode(text))

    def render(self, messages: Sequence[dict], add_generation_prompt: bool = True) -> str:
        return self._render(list(messages), add_generation_prompt)

    def session(
        self,
        session_id: str,
        messages: Sequence[dict],
        arrivals_s: Sequence[float] | None = None,
        max_prompt_len: int | None = None,
    ) -> ChatSession | None:
        """A session with one model call per assistant message that has a message before it.

        `arrivals_s[k]` is the arrival of call k (default: all at 0). Calls whose prompt plus reply would
        exceed `max_prompt_len` tokens end the session there. None when no call is left.
        """
        calls = [j for j, m in enumerate(messages) if m["role"] == "assistant" and j > 0]
        if not calls:
            return None
        first = self.encode(self.render(messages[: calls[0]]))
        prompt_len = len(first)
        turns: list[ChatTurn] = []
        for k, j in enumerate(calls):
            nxt = calls[k + 1] if k + 1 < len(calls) else None
            reply_message = {key: value for key, value in messages[j].items() if key != "tool_calls"}
            masked = [*messages[:j], {**reply_message, "content": _MARKER}, *messages[j + 1 : nxt]]
            text = self.render(masked, add_generation_prompt=nxt is not None)
            before, sep, after = text.partition(_MARKER)
            if not sep or not after:
                raise ValueError(f"the chat template does not render assistant content verbatim ({session_id})")
            reply_text = messages[j]["content"]
            if messages[j].get("tool_calls"):
                full = self.render(messages[: nxt], add_generation_prompt=nxt is not None)
                if not (full.startswith(before) and full.endswith(after)) or len(full) < len(before) + len(after):
                    raise ValueError(f"the chat template renders an assistant message's tool calls elsewhere than "
                                     f"after its content ({session_id})")
                reply_text = full[len(before): len(full) - len(after)]
            reply = self.encode(reply_text)
            after_ids = self.encode(after)
            if max_prompt_len is not None and prompt_len + len(reply) + 1 > max_prompt_len:
                break
            turns.append(ChatTurn(reply, after_ids))
            prompt_len += len(reply) + len(after_ids)
        if not turns:
            return None
        arrivals = tuple(arrivals_s[: len(turns)]) if arrivals_s is not None else (0.0,) * len(turns)
        return ChatSession(session_id, first, tuple(turns), arrivals)
