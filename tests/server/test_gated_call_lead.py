"""A forced call behind the reasoning gate may follow a short blank run after `</think>` (`guided.LEAD_SPACE`: the
blank line chat templates and trained models write there). What the grammar takes, each `--tool-call-parser` reads
back: the calls, content "" (a forced call's), the same whole and streamed, and finish_reason "tool_calls"."""

from __future__ import annotations

import json
import random

import pytest

from hybridcache.guided import LEAD_SPACE
from hybridcache.guided_python import PYTHON_FORMATS
from hybridcache.server.chat_output import ChatOutputOptions, ChoiceStream, final_message, finish_reason

TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
ARGUMENTS = {"zone": "utc"}
JSON_CALL = json.dumps({"name": "get_time", "arguments": ARGUMENTS})


def _python(tool_format: str) -> str:
    opening, _, closing = PYTHON_FORMATS[tool_format]
    return f"{opening}get_time(zone='utc'){closing}"


# each parser's forced format (`tool_formats.tool_format(parser).forced`), one call as its grammar writes it
FORCED = {
    "hermes": f"<tool_call>\n{JSON_CALL}\n</tool_call>",
    "granite4": f"<tool_call>\n{JSON_CALL}\n</tool_call>",
    "nemotron_json": f"<TOOLCALL>[{JSON_CALL}]</TOOLCALL>",
    "jamba": f"<tool_calls>[{JSON_CALL}]</tool_calls>",
    "kimi_k2": ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0<|tool_call_argument_begin|>"
                f"{json.dumps(ARGUMENTS)}<|tool_call_end|><|tool_calls_section_end|>"),
    **{parser: _python(parser) for parser in PYTHON_FORMATS},
}
LEADS = ["", "\n", "\n\n", " \n", " " * LEAD_SPACE]


def _options(parser: str) -> ChatOutputOptions:
    return ChatOutputOptions(split_reasoning=True, in_reasoning=True, parse_tools=True, tools=[TIME],
                             tool_call_parser=parser, tool_choice="required")


@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("parser", list(FORCED))
def test_a_call_after_a_blank_run_reads_as_the_call_whole_and_streamed(parser, lead):
    options = _options(parser)
    text = "plan\n</think>" + lead + FORCED[parser]
    message = final_message(text, options)
    assert message["content"] == "" and message["reasoning_content"] == "plan", message
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == \
        [("get_time", ARGUMENTS)]
    rng = random.Random(0)
    for _ in range(5):
        stream, content, calls, cut = ChoiceStream(options), "", [], 0
        while cut < len(text):
            cut = min(len(text), cut + rng.randint(1, 5))
            delta = stream.update(text[:cut], finished=cut == len(text))
            content += delta.content
            calls += delta.tool_calls
        assert content == "", repr(content)  # (no whitespace delta before the call either)
        assert [(c.name, json.loads(c.arguments)) for _, c in calls] == [("get_time", ARGUMENTS)]
        assert finish_reason("stop", stream.has_tool_calls, options) == "tool_calls"
