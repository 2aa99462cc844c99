"""A chat request's tools and tool_choice -> ToolPlan: how its output becomes tool calls, and the
JSON Schema that constrains decoding when calls are forced (vLLM's rules):

  none      the template sees the tools; the model answers in text
  auto      (the default with tools) free text; calls parsed by the worker's --tool-call-parser
  required  the output is a JSON list of {"name", "parameters"}, one anyOf branch per function
            (minItems 1; maxItems 1 when parallel_tool_calls is false)
  named     the output is the named function's arguments object

Forced calls are grammar-constrained, so their arguments always parse and match the function's
parameter schema (up to max_tokens)."""
from __future__ import annotations

import json
from dataclasses import dataclass

from tessera.config import StructuredOutput
from tessera.openai_api.errors import APIError
from tessera.openai_api.protocol import ChatCompletionRequest, Tool
from tessera.openai_api.tool_parsers import PARSERS

_ANY_OBJECT = {"type": "object"}
_DEFS = ("$defs", "definitions")


@dataclass(frozen=True)
class ToolPlan:
    mode: str                   # "none", "auto", "required" or "named"
    parser: str = ""            # auto: the worker's --tool-call-parser
    name: str = ""              # named: the function
    parallel: bool = True       # parallel_tool_calls
    names: tuple[str, ...] = ()  # auto: the functions a parsed call may name (else it is text)


def tool_plan(req: ChatCompletionRequest, parser: str) -> ToolPlan | None:
    """None without tools; APIError (400 naming the field) for a choice that cannot be served."""
    if not req.tools:
        if req.tool_choice not in (None, "none"):
            raise APIError(400, "tool_choice is only allowed when tools are given", "tool_choice")
        return None
    parallel = req.parallel_tool_calls is not False
    choice = req.tool_choice or "auto"
    if not isinstance(choice, str):
        return ToolPlan("named", name=_named(req), parallel=parallel)
    if choice == "auto" and not parser:      # the field at fault: tools alone mean "auto"
        raise APIError(400, "tool_choice \"auto\" (the default with tools) needs the server started with "
                       "--tool-call-parser (hermes, llama3_json or mistral; vLLM's --enable-auto-tool-choice is "
                       "accepted beside it); \"none\", \"required\" and a named function work without it",
                       "tool_choice" if req.tool_choice else "tools")
    if choice == "auto" and parser not in PARSERS:     # a worker newer than this gateway
        raise APIError(500, f"the worker's tool-call parser {parser[:40]!r} is unknown to this gateway", "tool_choice")
    return ToolPlan(choice, parser if choice == "auto" else "", parallel=parallel,
                    names=tuple(t.function.name for t in req.tools))


def _named(req: ChatCompletionRequest) -> str:
    name = req.tool_choice.function.get("name")
    if not isinstance(name, str):
        raise APIError(400, "tool_choice.function.name must be a string", "tool_choice")
    if name not in {t.function.name for t in req.tools}:
        raise APIError(400, f"tool_choice names the function {name[:64]!r}, which is not among the tools",
                       "tool_choice")
    return name


def constraint(req: ChatCompletionRequest, plan: ToolPlan | None) -> StructuredOutput | None:
    """The schema forced calls are decoded under, in place of any response_format (which
    shapes text, and a forced turn writes none: OpenAI accepts both, as agent SDKs send them);
    None when the output is free."""
    if plan is None or plan.mode not in ("required", "named"):
        return None
    if plan.mode == "named":
        tool = next(t for t in req.tools if t.function.name == plan.name)
        schema = tool.function.parameters or _ANY_OBJECT
    else:
        schema = required_schema(req.tools, plan.parallel)
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except RecursionError:
        raise APIError(400, "a function's parameters schema is nested too deeply", "tools") from None
    return StructuredOutput("json", text, param="tools")


def required_schema(tools: list[Tool], parallel: bool) -> dict:
    """A list of calls, each {"name": one function, "parameters": its arguments}. Each function's
    $defs move to the root, where its "#/$defs/..." references point once it is nested here."""
    defs: dict = {}
    branches = []
    for t in tools:
        # the top level only: $defs are moved, nothing nested changes (a deep schema stays a
        # grammar error, a 400, not a RecursionError here)
        params = dict(t.function.parameters) if t.function.parameters else dict(_ANY_OBJECT)
        for key in (k for k in _DEFS if isinstance(params.get(k), dict)):   # others: the grammar's 400
            for name, value in params.pop(key).items():
                if defs.setdefault(key, {}).setdefault(name, value) != value:
                    raise APIError(400, f"two tools define {key}/{name} differently; rename one", "tools")
        branches.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t.function.name]},
                                                          "parameters": params},
                         "required": ["name", "parameters"], "additionalProperties": False})
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": branches}, **defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema
