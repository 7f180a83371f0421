"""Forced tool calls whose parameters use `$defs` / `$ref`: the schemas pydantic writes for nested models,
`Optional` fields, enums, lists of models and recursive models, in the shapes instructor (`Mode.TOOLS`), pydantic-ai
(`output_type`) and openai-agents (a tool taking a model argument, its strict schema) send them (instructor's and
pydantic-ai's recorded from those libraries in framework_tool_schemas.json, openai-agents' made by it), through the
`openai` client with `tool_choice` "required" and a named tool. The definitions are hoisted to the root of the
call's grammar (`hybridcache.guided.tool_call_schema`), so each call's arguments validate against the schema and
parse back into the model."""

from __future__ import annotations

import concurrent.futures
import enum
import json
from pathlib import Path
from typing import Optional

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from hybridcache.guided import tool_call_schema
from hybridcache.models.builtin import BUILTIN_NAME

from .inprocess_server import serving

MODEL = BUILTIN_NAME
RECORDED = Path(__file__).parent / "framework_tool_schemas.json"
USER = [{"role": "user", "content": "Save Ann, who lives in Paris."}]


class Color(str, enum.Enum):
    red = "red"
    blue = "blue"


class Address(BaseModel):
    city: str = Field(max_length=8)
    zip: Optional[str] = Field(default=None, max_length=5)  # noqa: UP045 - the Optional spelling users write


class Node(BaseModel):
    value: int = Field(ge=0, le=9)
    children: list[Node] = Field(default_factory=list, max_length=2)


class Person(BaseModel):
    """A person to save."""

    name: str = Field(max_length=8)
    color: Color
    home: Address
    others: list[Address] = Field(max_length=2)
    tree: Node


def recorded_tool(framework: str) -> dict:
    """The tool definition `framework` sent for `Person`, recorded from the real library (version and call in
    framework_tool_schemas.json)."""
    return json.loads(RECORDED.read_text())[framework]["tool"]


def instructor_tool() -> dict:
    """instructor's `Mode.TOOLS`: `openai_schema(Person)`, the model's schema (less title and description,
    `required` sorted) as the parameters."""
    return recorded_tool("instructor")


def pydantic_ai_tool() -> dict:
    """pydantic-ai's `output_type=Person`: a `final_result` output tool whose parameters are the model's schema
    without titles."""
    return recorded_tool("pydantic-ai")


def openai_agents_tool() -> dict:
    """openai-agents' `@function_tool` taking a `Person`: the strict schema (every field required, no extra
    properties) with the model under `$defs`."""
    agents = pytest.importorskip("agents")

    @agents.function_tool
    def save_person(person: Person) -> str:
        """Save a person."""
        return "saved"

    return {"type": "function", "function": {"name": save_person.name, "description": save_person.description,
                                             "parameters": save_person.params_json_schema}}


SHAPES = {"instructor": instructor_tool, "pydantic-ai": pydantic_ai_tool, "openai-agents": openai_agents_tool}


@pytest.fixture(scope="module")
def client():
    with serving() as base_url:
        yield OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def check_arguments(call, tool):
    parameters = tool["function"]["parameters"]
    assert "$defs" in json.dumps(parameters)
    assert call.function.name == tool["function"]["name"]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, parameters)
    person = arguments.get("person", arguments)  # openai-agents wraps the model in its argument's name
    assert isinstance(Person.model_validate(person), Person)


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_forced_call_with_defs_returns_valid_arguments(client, shape):
    """`required` and the tool by name, the two requests at once (the engine batches them)."""
    tool = SHAPES[shape]()
    choices = ["required", {"type": "function", "function": {"name": tool["function"]["name"]}}]

    def ask(seed: int):
        return client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], tool_choice=choices[seed],
                                              parallel_tool_calls=False, max_tokens=600, temperature=0.7, seed=seed)

    with concurrent.futures.ThreadPoolExecutor(len(choices)) as pool:
        responses = list(pool.map(ask, range(len(choices))))
    for response, choice in zip(responses, choices):
        message = response.choices[0].message
        # a named call finishes with "stop", as OpenAI and vLLM ("tool_calls" is for "auto" and "required")
        assert response.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop"), message
        assert len(message.tool_calls) == 1
        check_arguments(message.tool_calls[0], tool)


def test_required_over_several_tools_with_defs(client):
    tools = [instructor_tool(), pydantic_ai_tool()]
    response = client.chat.completions.create(model=MODEL, messages=USER, tools=tools, tool_choice="required",
                                              max_tokens=600, temperature=0.7, seed=5)
    call = response.choices[0].message.tool_calls[0]
    check_arguments(call, next(t for t in tools if t["function"]["name"] == call.function.name))


def test_definitions_are_hoisted_and_other_local_refs_rebased():
    parameters = {"type": "object", "$defs": {"A": {"type": "integer"}},
                  "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"$ref": "#/properties/a"},
                                 "self": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}}}
    schema = tool_call_schema("f", parameters)
    assert schema["$defs"] == {"A": {"type": "integer"}}
    arguments = schema["properties"]["arguments"]
    assert "$defs" not in arguments
    assert arguments["properties"]["a"] == {"$ref": "#/$defs/A"}
    assert arguments["properties"]["b"] == {"$ref": "#/properties/arguments/properties/a"}
    assert arguments["properties"]["self"]["anyOf"][0] == {"$ref": "#/properties/arguments"}
    assert parameters["$defs"] == {"A": {"type": "integer"}}  # the request's own schema is left as it was


def test_a_bad_reference_is_a_400_without_source_paths(client):
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/Missing"}}, "required": ["a"]}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[tool], tool_choice="required",
                                       max_tokens=20)
    message = error.value.body["message"]
    assert "Missing" in message
    assert ".cc:" not in message and "/project/" not in message
