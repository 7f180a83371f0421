"""Kimi's tool-call section as grammar rules: what a forced call is with `--tool-call-parser kimi_k2`
(`guided.TOOL_FORMATS` "kimi"). One writer for both backends: `guided` writes the rules in xgrammar's EBNF,
`guided_llguidance` in Lark, each with its own way of writing a tag (llguidance names a special token apart from
its text). The calls are written as Kimi's chat template writes them back: no white space anywhere, each call's id
`functions.NAME:IDX` with IDX counting the reply's calls from 0, the arguments as `tojson` writes them::

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
      <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>
    <|tool_calls_section_end|>                                  (on one line: the breaks here are for reading)

The rules, with `parallel` (one call: `section ::= SECTION_BEGIN call_0 SECTION_END`)::

    section   ::= SECTION_BEGIN call_0 after_1
    after_i   ::= SECTION_END | call_i after_(i+1)        for 1 <= i < MAX_CALLS
    after_MAX ::= SECTION_END
    call_i    ::= CALL_BEGIN "functions." ("NAME_0:i" ARGUMENT_BEGIN args_0 | "NAME_1:i" ARGUMENT_BEGIN args_1 | ...)
                  CALL_END

A grammar cannot count without a bound, so a section holds at most `MAX_CALLS` calls. A tool name with a `.` is
refused: the reader (`call_formats.kimi_section`) takes the name after the id's last `.`, so the call would come
back under another name.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGUMENT_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
TAGS = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGUMENT_BEGIN, CALL_END)
MAX_CALLS = 32


def quoted(text: str) -> str:
    """`text` as a string literal of EBNF or Lark (JSON's escapes; characters past ASCII as they are)."""
    return json.dumps(text, ensure_ascii=False)


def section_rules(names: Sequence[str], arguments: Sequence[str], parallel: bool, *, prefix: str, defines: str,
                  tag: Callable[[str], str] = quoted) -> tuple[str, list[str]]:
    """The rules of a section whose calls call one of `names`, the call of `names[k]` with arguments matching the
    rule `arguments[k]`: (the section's rule name, the rule lines). `prefix` starts every rule name written here
    (one no other rule of the grammar starts with), `defines` is the grammar's `::=` (EBNF) or `:` (Lark), `tag`
    writes a tag as a term. A ValueError for a name the reader would not give back (holding a `.`) or no names."""
    if not names or len(names) != len(arguments):
        raise ValueError("Kimi's section needs one arguments rule for each of at least one tool name")
    dotted = next((name for name in names if "." in name), None)
    if dotted is not None:
        raise ValueError(f"the tool name {dotted!r} cannot be forced in Kimi's format: its call id "
                         "functions.NAME:IDX is read back as the name after the last '.'")
    num_calls = MAX_CALLS if parallel else 1
    section, end = f"{prefix}_section", tag(SECTION_END)
    rules = [f"{section} {defines} {tag(SECTION_BEGIN)} {prefix}_call_0 "
             + (f"{prefix}_after_1" if parallel else end)]
    for i in range(1, num_calls):
        rules.append(f"{prefix}_after_{i} {defines} {end} | {prefix}_call_{i} {prefix}_after_{i + 1}")
    if parallel:
        rules.append(f"{prefix}_after_{num_calls} {defines} {end}")
    for i in range(num_calls):
        choices = " | ".join(f"{quoted(f'{name}:{i}')} {tag(ARGUMENT_BEGIN)} {rule}"
                             for name, rule in zip(names, arguments))
        rules.append(f"{prefix}_call_{i} {defines} {tag(CALL_BEGIN)} {quoted('functions.')} ({choices}) "
                     f"{tag(CALL_END)}")
    return section, rules
