"""The `--tool-call-parser` names this server knows (vLLM's names), and for each the tool-call format it reads and
how a forced call (`tool_choice` "required" or named) is written in it. Data only: `tool_parsers` reads the blocks,
`call_formats` their bodies. docs/server.md has the table of families, formats and sources.

    parser                                   reads                                              forced call
    (none), hermes, qwen25, qwen3_coder,     <tool_call>{JSON call or list}</tool_call>,        Qwen3's block
      qwen3_xml, granite4                    <tool_call><function=...>...</function></tool_call>
    nemotron_json                            the Qwen blocks, <TOOLCALL>[JSON calls]</TOOLCALL>  <TOOLCALL>[...]
    jamba                                    <tool_calls>[JSON calls]</tool_calls>              <tool_calls>[...]
    kimi_k2                                  <|tool_calls_section_begin|> <|tool_call_begin|>   Kimi's section
                                             functions.NAME:0 <|tool_call_argument_begin|>      (`guided_kimi`,
                                             {JSON} <|tool_call_end|> ... <|tool_calls_section_end|>  at most 32)
    lfm2                                     <|tool_call_start|>[f(a=1), g()]<|tool_call_end|>   the same,
    olmo3                                    <function_calls>f(a=1)\\ng()</function_calls>         in Python calls
    pythonic                                 the whole reply one Python list: [f(a=1), g()]     (`guided_python`)

A forced call in a Python-call format has its arguments as keywords, values as Python literals (`guided_python`
says which schemas it can carry: a tool or argument name must be a Python identifier, for one).
"""

from __future__ import annotations

from dataclasses import dataclass

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
FUNCTION_START, FUNCTION_END = "<function=", "</function>"
QWEN_BLOCKS = ((CALL_START, CALL_END), (FUNCTION_START, FUNCTION_END))  # a block's opening and closing tags
NEMOTRON_BLOCK = ("<TOOLCALL>", "</TOOLCALL>")
JAMBA_BLOCK = ("<tool_calls>", "</tool_calls>")
LFM2_BLOCK = ("<|tool_call_start|>", "<|tool_call_end|>")
OLMO3_BLOCK = ("<function_calls>", "</function_calls>")
KIMI_BLOCK = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
KIMI_SINGULAR_BLOCK = ("<|tool_call_section_begin|>", "<|tool_call_section_end|>")  # (vLLM's kimi_k2 reads both)
KIMI_CALL_BEGIN, KIMI_ARGUMENTS_BEGIN, KIMI_CALL_END = (
    "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")


@dataclass(frozen=True)
class ToolFormat:
    """What one `--tool-call-parser` reads: `blocks`, the (opening, closing) tags of its blocks; `bare_list`: the
    whole reply is one Python list of calls, no tags (vLLM's `pythonic`); `forced`: the `guided.TOOL_FORMATS` entry a
    forced call is written in; `inner_tags`: tags inside a block (Kimi's per call)."""

    blocks: tuple[tuple[str, str], ...]
    forced: str
    bare_list: bool = False
    inner_tags: tuple[str, ...] = ()

    @property
    def tags(self) -> tuple[str, ...]:
        """Every tag text of the format: the ones a special-token decode must keep (`special_tokens`)."""
        return (*(tag for block in self.blocks for tag in block), *self.inner_tags)


_QWEN = ToolFormat(QWEN_BLOCKS, "qwen")
_FORMATS = {
    "hermes": _QWEN, "qwen25": _QWEN, "qwen3_coder": _QWEN, "qwen3_xml": _QWEN, "granite4": _QWEN,
    "nemotron_json": ToolFormat((*QWEN_BLOCKS, NEMOTRON_BLOCK), "nemotron"),
    "jamba": ToolFormat((JAMBA_BLOCK,), "jamba"),
    "kimi_k2": ToolFormat((KIMI_BLOCK, KIMI_SINGULAR_BLOCK), "kimi",
                          inner_tags=(KIMI_CALL_BEGIN, KIMI_ARGUMENTS_BEGIN, KIMI_CALL_END)),
    "lfm2": ToolFormat((LFM2_BLOCK,), "lfm2"),
    "olmo3": ToolFormat((OLMO3_BLOCK,), "olmo3"),
    "pythonic": ToolFormat((), "pythonic", bare_list=True),
}
TOOL_CALL_PARSERS = tuple(sorted(_FORMATS))


def tool_format(parser: str | None) -> ToolFormat:
    """The format `--tool-call-parser parser` reads (None: the Qwen blocks, what the server reads without the
    flag); a ValueError naming the known parsers for any other name."""
    if parser is None:
        return _QWEN
    found = _FORMATS.get(parser)
    if found is None:
        raise ValueError(f"unknown tool-call parser {parser!r}; known: {', '.join(TOOL_CALL_PARSERS)}")
    return found
