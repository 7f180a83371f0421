"""A chat request's messages through the chat template: the prompt text, and the tail where the reply begins.

The tail is the text the template adds after the conversation so far, where the model's reply starts: the
generation prompt (`add_generation_prompt`), or, with `continue_final_message`, the open final message as it
renders. It serves two ends:

- where the reply starts: inside a think block or not (`reasoning.starts_in_reasoning(tail)`). Only the tail is
  looked at, so a `<think>` in a user's text changes nothing.
- where the next turn parts from this prompt: the next request holds this conversation and the reply, which
  templates may render otherwise than the generation prompt (Qwen3 / Qwen3.5 templates open `<think>\\n` there and
  render earlier replies without it). The server asks the engine for a checkpoint where they part
  (`Tokenizer.parting_step`, `LLMEngine.add_request`'s `checkpoints_at`), as `LLM.chat` does, so that turn hits
  all of this conversation in the prefix cache::

      turn 1   <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n | <think>\\n
      turn 2   <|im_start|>user\\nHi<|im_end|>\\n<|im_start|>assistant\\n | Hello<|im_end|>\\n...
                                                                  ^ checkpoint: turn 2 parts from turn 1 here

  None where the next turn extends the whole prompt (its finish checkpoint serves it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from hybridcache.server import reasoning


@dataclass(frozen=True)
class ChatPrompt:
    """`text`: the rendered prompt. `generation_prompt`: the text after the conversation's bare rendering (""
    when there is none or the bare rendering is not a prefix of `text`). `in_reasoning`: the reply starts inside
    a think block."""

    text: str
    generation_prompt: str
    in_reasoning: bool
    messages: list[dict[str, Any]] | None = None  # what was rendered, for `checkpoint_steps`
    tools: list[dict] | None = None
    template_kwargs: dict[str, Any] | None = None


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                continue_final_message: bool, tools: list[dict] | None,
                template_kwargs: dict[str, Any]) -> ChatPrompt:
    """Render `messages` (and `tools`) with the tokenizer's chat template; raises what the template raises."""

    def render(conversation: list[dict[str, Any]], generation_prompt: bool, final_open: bool) -> str:
        return tokenizer.apply_chat_template(conversation, add_generation_prompt=generation_prompt, tools=tools,
                                             continue_final_message=final_open, template_kwargs=template_kwargs)

    text = render(messages, add_generation_prompt, continue_final_message)
    generation_prompt = ""
    if add_generation_prompt and not continue_final_message:
        bare = render(messages, False, False)
        generation_prompt = text[len(bare):] if text.startswith(bare) else ""
        tail = generation_prompt
    else:
        tail = _continued_tail(text, messages, render) if continue_final_message else ""
    in_reasoning = reasoning.starts_in_reasoning(tail) if tail else reasoning.ends_with_start(text)
    return ChatPrompt(text, generation_prompt, in_reasoning, messages, tools, template_kwargs)


def _continued_tail(text: str, messages: list[dict[str, Any]], render: Any) -> str:
    """With `continue_final_message`: the open final message as it renders (the text after the bare rendering of
    the messages before it), or "" when that cannot be told."""
    if len(messages) < 2:
        return ""
    try:
        before = render(messages[:-1], False, False)
    except Exception:  # noqa: BLE001 - some templates refuse a conversation without a user turn
        return ""
    return text[len(before):] if text.startswith(before) else ""


def checkpoint_steps(tokenizer: Any, prompt_ids: list[int], prompt: ChatPrompt) -> tuple[int, ...]:
    """The step of `prompt_ids` (`prompt` tokenized, images expanded, perhaps cut at the front) where the
    conversation's next turn parts from this prompt (`Tokenizer.parting_step`), as `LLMEngine.add_request`'s
    `checkpoints_at`; () without a generation prompt, where the next turn extends the whole prompt, or where no
    step can be told."""
    if not prompt.generation_prompt or prompt.messages is None:
        return ()
    step = tokenizer.parting_step(prompt.messages, prompt.text, prompt_ids, tools=prompt.tools,
                                  template_kwargs=prompt.template_kwargs)
    return (step,) if step else ()
