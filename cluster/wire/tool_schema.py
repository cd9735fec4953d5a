"""How a self-hosted engine serves a request's ``tools``: what the chat template renders, which
parser reads the answer (:mod:`cluster.wire.tool_parser`) and, when a call is forced, the JSON schema
vLLM's structured decoding holds the engine to. Pure.

* ``tool_choice: none``: the tools are not rendered and nothing is parsed. Nothing on the engine
  path could keep a model that sees the tools from writing a call in the template's format, and a
  call we did not parse would reach the client as markup in the content; the history's calls and
  ``role: tool`` results are still rendered.
* ``auto`` (or absent): the tools are rendered, the Hermes parser reads calls out of free text;
  with ``parallel_tool_calls: false`` at most one call (the engine stops at the first
  ``</tool_call>``, and a later block would stay content).
* ``required``: the engine writes a JSON list of ``{"name", "arguments"}`` objects, each held to
  one function's parameters schema (``anyOf``), at least one, at most one unless parallel calls
  are allowed.
* a named function: the engine writes that function's arguments, held to its parameters schema.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.json_types import JSONObject
from cluster.wire.errors import InvalidRequest
from cluster.wire.protocol import ChatCompletionRequest, NamedToolChoice, Tool
from cluster.wire.tool_parser import CLOSE

ANY_OBJECT: JSONObject = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    render_tools: bool  # the chat template shows the tool definitions
    # GenerateRequest.tool_parse: mode, name, max_calls, and stop (strings only the engine adds,
    # not the client's: a provider serving the same request never sees them)
    parse: JSONObject | None = None
    structured: JSONObject | None = None  # Sampling.structured: {"json": schema}


def parameters(tool: Tool) -> JSONObject:
    return tool.function.parameters or ANY_OBJECT


def call_schema(tool: Tool) -> JSONObject:
    """One call of ``tool`` as the engine writes it under ``tool_choice: required``."""
    return {
        "type": "object",
        "properties": {
            "name": {"type": "string", "const": tool.function.name},
            "arguments": parameters(tool),
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_list_schema(tools: list[Tool], parallel: bool) -> JSONObject:
    """At least one call, each of one of ``tools``; at most one unless ``parallel``."""
    items = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    schema: JSONObject = {"type": "array", "items": items, "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def plan(req: ChatCompletionRequest) -> ToolPlan | None:
    """The engine's way to serve ``req``'s tools (None: the request has none to offer)."""
    tools, choice = req.tools or [], req.tool_choice
    if not tools:
        return None
    parallel = req.parallel_tool_calls is not False
    if choice == "none":
        return ToolPlan(render_tools=False)
    forced = choice == "required" or isinstance(choice, NamedToolChoice)
    if forced and req.response_format is not None and req.response_format.type != "text":
        raise InvalidRequest(
            "'response_format' and a forced 'tool_choice' cannot both hold a self-hosted engine's "
            "structured decoding; use one of them",
            param="response_format",
            code="unsupported_parameter",
        )
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in tools if t.function.name == choice.function.name)
        return ToolPlan(True, {"mode": "named", "name": tool.function.name}, {"json": parameters(tool)})
    if choice == "required":
        return ToolPlan(True, {"mode": "list"}, {"json": call_list_schema(tools, parallel)})
    if parallel:
        return ToolPlan(True, {"mode": "hermes"})
    return ToolPlan(True, {"mode": "hermes", "max_calls": 1, "stop": [CLOSE]})
