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

Qwen3.5 may write a tool call inside its think block without closing it first: a `<tool_call>` followed (past
white space) by `<function=` or `<function ` ends the reasoning there too, and the content (which the tool parser
reads) starts at the `<tool_call>`, as vLLM's qwen3 parser has it. Any other `<tool_call>` (one the reasoning
mentions) stays reasoning; while what follows one could still become `<function`, it is held back::

    "plan\n<tool_call>\n<func"           "plan"          ""          (maybe a call: held back)
    "plan\n<tool_call>\n<function=f>"    "plan"          "<tool_call>\n<function=f>"
    "a <tool_call> b"                    "a <tool_call> b" ""       (a mention: no function follows)

With `--reasoning-parser kimi_k2` (`ReasoningParser.call_sections`, passed to `split` as `sections`) Kimi's
`<|tool_calls_section_begin|>` (or the singular `<|tool_call_section_begin|>`, which Kimi's tool parser reads too)
ends the reasoning wherever it stands in the think block, and the content (which the tool parser reads) starts at
it, as vLLM's kimi_k2 reasoning parser has it: Kimi's section is never mentioned in text. The tags are special
tokens of Kimi's tokenizer, so a request without tools still keeps them for this split (`special_tokens.py`): vLLM
ends the reasoning at the section's token id whatever the text shows. A partial tag at the end of unfinished text is
held back::

    "plan\n<|tool_calls_sec"             "plan"          ""          (maybe the tag: held back)
    "plan\n<|tool_calls_section_begin|>" "plan"          "<|tool_calls_section_begin|>"
    "plan <tool_call> b\n<|tool_calls_section_begin|><|tool_call_begin|>..."
                                        "plan <tool_call> b"         "<|tool_calls_section_begin|><|tool_call_..."
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass

from hybridcache.server.tool_formats import KIMI_BLOCK, KIMI_SINGULAR_BLOCK

THINK_START = "<think>"
THINK_END = "</think>"
TOOL_CALL = "<tool_call>"
_GENUINE_CALL = re.compile(r"<tool_call>\s*<function[\s=]")
# what may still follow the last `<tool_call>` of unfinished text and become a genuine call
_MAYBE_CALL = re.compile(r"\s*(?:<(?:f(?:u(?:n(?:c(?:t(?:i(?:o(?:n)?)?)?)?)?)?)?)?)?\Z")


class ReasoningParser(enum.Enum):
    """`--reasoning-parser`: how reasoning is marked, by vLLM's names. Every one is <think>...</think> with the rules
    of this module: Qwen3 and Qwen3.5, DeepSeek-R1 (AI21's Jamba Reasoning models use it too), NVIDIA Nemotron 3
    (`nemotron_v3`, vLLM's; `nano_v3`, the name NVIDIA's recipes give their plugin), whose format is Qwen3's, Moonshot's
    Kimi (`kimi_k2`) and AllenAI's OLMo 3 Think (`olmo3`). vLLM's kimi_k2 parser also ends the reasoning at a
    `<|tool_calls_section_begin|>` written inside an unclosed think block, and so does `kimi_k2` here
    (`call_sections`); Qwen's genuine `<tool_call>` ends it with every parser. NVIDIA's `<TOOLCALL>` ends it with
    none: vLLM's nemotron_v3 and deepseek_r1 parsers end the reasoning only at `</think>`."""

    QWEN3 = "qwen3"
    DEEPSEEK_R1 = "deepseek_r1"
    NEMOTRON_V3 = "nemotron_v3"
    NANO_V3 = "nano_v3"
    KIMI_K2 = "kimi_k2"
    OLMO3 = "olmo3"

    @property
    def call_sections(self) -> tuple[str, ...]:
        """The opening tags of tool-call sections that end an unclosed think block (`split`'s `sections`)."""
        return (KIMI_BLOCK[0], KIMI_SINGULAR_BLOCK[0]) if self is ReasoningParser.KIMI_K2 else ()


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


def _call_inside(reasoning: str, finished: bool) -> tuple[int, bool]:
    """Where a tool call written inside the think block starts (module docstring): (its `<tool_call>`'s index,
    True) for the first genuine one; (index, False) for one that is not decided yet (unfinished text whose
    continuation may still be `<function`); (-1, False) for none."""
    genuine = _GENUINE_CALL.search(reasoning)
    if genuine is not None:
        return genuine.start(), True
    last = reasoning.rfind(TOOL_CALL)  # (only the last mention can still be undecided)
    if not finished and last >= 0 and _MAYBE_CALL.match(reasoning, last + len(TOOL_CALL)):
        return last, False
    return -1, False


def _section_inside(reasoning: str, sections: tuple[str, ...]) -> int:
    """Where the first of the `sections` tags in the think block's text starts (module docstring), or -1."""
    found = [at for tag in sections if (at := reasoning.find(tag)) >= 0]
    return min(found, default=-1)


def split(text: str, *, in_reasoning: bool, finished: bool, sections: tuple[str, ...] = ()) -> ReasoningSplit:
    """Split a completion's text (see the module docstring). `in_reasoning`: the prompt left a think block
    open. `finished`: the text is final (nothing is held back). `sections`: the tags of tool-call sections that
    end the think block (`ReasoningParser.call_sections`)."""
    stripped = text.lstrip()
    if stripped.startswith(THINK_START):  # the model opened the block, or repeated the prompt's opening tag
        text = stripped[len(THINK_START):]
    elif not finished and THINK_START.startswith(stripped):  # maybe a tag: held back
        return ReasoningSplit("" if in_reasoning else None, "")
    elif not in_reasoning:
        return ReasoningSplit(None, text)
    end = text.find(THINK_END)
    block = text if end < 0 else text[:end]
    call, genuine = _call_inside(block, finished or end >= 0)  # closed: decided
    section = _section_inside(block, sections)
    if section >= 0 and (section < call or not genuine):  # (an undecided <tool_call> is never before it)
        return ReasoningSplit(text[:section].strip("\n"), text[section:])
    if genuine:
        return ReasoningSplit(text[:call].strip("\n"), text[call:])
    if call >= 0:
        return ReasoningSplit(text[:call].strip("\n"), "")
    if end < 0:
        reasoning = text.lstrip("\n")
        if not finished:
            held = max(_partial_suffix(reasoning, tag) for tag in (THINK_END, TOOL_CALL, *sections))
            reasoning = reasoning[: len(reasoning) - held].rstrip("\n")
        return ReasoningSplit(reasoning, "")
    content = text[end + len(THINK_END):].lstrip("\n")
    return ReasoningSplit(text[:end].strip("\n"), content)
