"""The structured-output fields of a request (`response_format`, vLLM's `guided_*` and `structured_outputs`,
and `tool_choice` "required" or a named function) as one `GuidedSpec`, or a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

from hybridcache.guided import GuidedKind, GuidedSpec
from hybridcache.server.body_checks import check_nested_value
from hybridcache.server.errors import APIError

# The keys of vLLM's `structured_outputs` this server implements; another key is refused unless it is null or false.
STRUCTURED_OUTPUT_KEYS = ("json", "regex", "choice", "grammar", "json_object")
# vLLM's options of how a constraint is enforced that hold here as they are, with the values that do: JSON grammars
# never allow free whitespace (they write JSON as `tojson` does, whatever `disable_any_whitespace` says: valid
# JSON either way), and the backend is always vLLM's `auto`: xgrammar, or llguidance for a JSON schema xgrammar would
# not enforce (hybridcache.guided; "xgrammar" named here is taken as `auto` too, where vLLM would refuse such a
# schema).
STRUCTURED_OUTPUT_OPTIONS = {"disable_any_whitespace": (True, False), "disable_fallback": (True, False),
                             "backend": ("auto", "xgrammar")}


def response_format_spec(response_format: dict[str, Any] | None) -> GuidedSpec | None:
    """OpenAI's `response_format`: text (no constraint), json_object, or json_schema."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GuidedSpec(GuidedKind.JSON_OBJECT)
    if kind == "json_schema":
        holder = response_format.get("json_schema")
        schema = holder.get("schema", holder.get("json_schema")) if isinstance(holder, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format.json_schema.schema must be a JSON schema object",
                           param="response_format.json_schema.schema")
        return GuidedSpec.json_schema(schema)
    raise APIError(400, f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                   param="response_format.type")


def guided_spec(fields: dict[str, Any]) -> GuidedSpec | None:
    """vLLM's constraint fields: `guided_json` (a schema, object or text), `guided_regex`, `guided_choice` (a
    list of strings), `guided_grammar` (EBNF, or Lark when it has no `::=` rule), or the same as
    `structured_outputs.{json,regex,choice,grammar,json_object}` (its options `STRUCTURED_OUTPUT_OPTIONS` are taken
    with the values that hold here; any other key that is set is refused). At most one may be set."""
    found: list[tuple[str, GuidedSpec]] = []
    nested = fields.get("structured_outputs") or {}
    if not isinstance(nested, dict):
        raise APIError(400, "structured_outputs must be an object", param="structured_outputs")
    for key, value in nested.items():
        if key in STRUCTURED_OUTPUT_OPTIONS:
            if value is not None and value not in STRUCTURED_OUTPUT_OPTIONS[key]:
                raise APIError(400, f"structured_outputs.{key} must be one of "
                               f"{', '.join(map(json.dumps, STRUCTURED_OUTPUT_OPTIONS[key]))}, got {json.dumps(value)}",
                               param=f"structured_outputs.{key}")
        elif key not in STRUCTURED_OUTPUT_KEYS and value not in (None, False):
            raise APIError(400, f"structured_outputs.{key} is not supported by this server (it understands "
                           f"{', '.join(STRUCTURED_OUTPUT_KEYS)})", param=f"structured_outputs.{key}",
                           code="unsupported_parameter")
    sources = [(f"guided_{k}", fields.get(f"guided_{k}")) for k in ("json", "regex", "choice", "grammar")]
    sources += [(f"structured_outputs.{k}", nested.get(k)) for k in ("json", "regex", "choice", "grammar")]
    if nested.get("json_object"):
        found.append(("structured_outputs.json_object", GuidedSpec(GuidedKind.JSON_OBJECT)))
    for name, value in sources:
        if value is None:
            continue
        kind = name.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
        found.append((name, _one(name, kind, value)))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise APIError(400, f"send at most one structured-output constraint, got {names}", param=found[1][0])
    return found[0][1] if found else None


def _one(name: str, kind: str, value: Any) -> GuidedSpec:
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise APIError(400, f"{name} is not valid JSON: {error}", param=name) from None
            except RecursionError:
                raise APIError(400, f"{name} is not valid JSON: it is nested too deeply", param=name) from None
            check_nested_value(name, value)  # (as the schema would have been checked, sent as an object)
        if not isinstance(value, dict):
            raise APIError(400, f"{name} must be a JSON schema object", param=name)
        return GuidedSpec.json_schema(value)
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{name} must be a non-empty list of non-empty strings", param=name)
        return GuidedSpec(GuidedKind.CHOICE, json.dumps(value))
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{name} must be a non-empty string", param=name)
    return GuidedSpec(GuidedKind.REGEX if kind == "regex" else GuidedKind.GRAMMAR, value)


def tool_choice_spec(tools: list[dict] | None, tool_choice: Any,
                     parallel_tool_calls: bool = False) -> GuidedSpec | None:
    """`tool_choice` "required" (some tool: one or more calls when the request's `parallel_tool_calls` is true, as
    OpenAI and vLLM have it, else exactly one) or `{"type": "function", "function": {"name": N}}` (one call of tool
    N) forces tool calls, in Qwen3's `<tool_call>` JSON format here (the server then sets the served parser's own
    format: `tool_formats`); "auto" and "none" constrain nothing."""
    if tool_choice in (None, "auto", "none"):
        return None
    if not tools:
        raise APIError(400, f"tool_choice {json.dumps(tool_choice)} needs tools", param="tool_choice")
    if tool_choice == "required":
        return GuidedSpec.tool_calls(tools, parallel=parallel_tool_calls)
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise APIError(400, "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                       "\"function\": {\"name\": ...}}", param="tool_choice")
    chosen = [tool for tool in tools if tool.get("function", {}).get("name") == name]
    if not chosen:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice")
    return GuidedSpec.tool_calls(chosen)
