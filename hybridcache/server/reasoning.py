"""Reasoning split: a completion's `<think>...</think>` part becomes `reasoning_content`, the rest `content`.

Where the completion starts depends on the prompt: Qwen3 models open `<think>` themselves; Qwen3.5-style
templates end the generation prompt with an open `<think>` (the completion starts inside the reasoning); with
`enable_thinking: false` the prompt already holds an empty, closed think block (the completion is all content).
`starts_in_reasoning(tail)` tells which, from the prompt's tail where the reply begins (the generation prompt,
`chat_prompt.py`): never from the whole prompt, where a user's text may hold a `<think>` of its own. A model that
repeats the opening tag in a block the prompt opened has it dropped from the reasoning, as vLLM's qwen3 parser does.

`split` is a pure function of the text so far and is monotonic: as the text grows, the reasoning and the
content it returns only grow at their ends, so streaming sends each new suffix as a delta. To keep that true it
holds back, while the text is unfinished, a partial tag at the end and newlines that may turn out to be the
ones around a tag. Worked example (completion starts outside reasoning)::

    text so far                         reasoning       content
    "<thi"                              None            ""          (maybe a tag: held back)
    "<think>\\nplan"                     "plan"          ""
    "<think>\\nplan\\n</thi"              "plan"          ""          (newline + partial tag held)
    "<think>\\nplan\\n</think>\\n\\nHi"     "plan"          "Hi"
    "Hello"                             None            "Hello"     (no think block at all)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(enum.Enum):
    """`--reasoning-parser`: how reasoning is marked. Both Qwen3 and Qwen3.5 use <think>...</think>."""

    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"


def starts_in_reasoning(tail: str) -> bool:
    """True when `tail`, the text where the reply begins (a generation prompt), leaves a think block open."""
    return tail.rfind(THINK_START) > tail.rfind(THINK_END)


def ends_with_start(prompt_text: str) -> bool:
    """True when the prompt ends with an opening tag (and white space): what is left to go on when the tail
    where the reply begins is unknown."""
    return prompt_text.rstrip().endswith(THINK_START)


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the completion has no reasoning part (yet)
    content: str


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest proper prefix of `tag` that `text` ends with."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def split(text: str, *, in_reasoning: bool, finished: bool) -> ReasoningSplit:
    """Split a completion's text (see the module docstring). `in_reasoning`: the prompt left a think block
    open. `finished`: the text is final (nothing is held back)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):  # the model opened the block, or repeated the prompt's opening tag
        text = stripped[len(THINK_START):]
    elif not finished and THINK_START.startswith(stripped):  # maybe a tag: held back
        return ReasoningSplit("" if in_reasoning else None, "")
    elif not in_reasoning:
        return ReasoningSplit(None, text)
    end = text.find(THINK_END)
    if end < 0:
        reasoning = text.lstrip("\n")
        if not finished:
            reasoning = reasoning[: len(reasoning) - _partial_suffix(reasoning, THINK_END)].rstrip("\n")
        return ReasoningSplit(reasoning, "")
    content = text[end + len(THINK_END):].lstrip("\n")
    return ReasoningSplit(text[:end].strip("\n"), content)
