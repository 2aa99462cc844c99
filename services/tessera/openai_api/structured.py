"""The request fields that constrain the output -> StructuredOutput: OpenAI's response_format
(json_object, json_schema) and vLLM's structured_outputs extension (json, regex, choice,
grammar, json_object). Whether the grammar compiles is the worker's check (structured/grammars.py)."""
from __future__ import annotations

import json

from tessera.config import StructuredOutput
from tessera.openai_api.errors import APIError

# vLLM's structured_outputs keys -> our kinds
_EXTENSION = {"json": "json", "regex": "regex", "choice": "choice", "grammar": "grammar", "json_object": "json_object"}


def structured_output(req) -> StructuredOutput | None:
    rf = getattr(req, "response_format", None)
    so = req.structured_outputs
    fmt = _response_format(rf) if rf else None
    ext = _extension(so) if so else None
    if fmt and ext:
        raise APIError(400, "give either response_format or structured_outputs, not both", "structured_outputs")
    return fmt or ext


def _response_format(rf: dict) -> StructuredOutput | None:
    kind = rf.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind != "json_schema":
        raise APIError(400, f"response_format type {str(kind)[:40]!r} is not one of text, json_object, json_schema",
                       "response_format")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
        raise APIError(400, "response_format.json_schema must be an object with a \"schema\" object",
                       "response_format")
    # OpenAI requires a name; the schema may be left out (any JSON)
    return StructuredOutput("json", json.dumps(spec.get("schema", {})))


def _extension(so: dict) -> StructuredOutput:
    given = [k for k in _EXTENSION if so.get(k) not in (None, False)]
    unknown = sorted(set(so) - set(_EXTENSION) - {"disable_any_whitespace", "whitespace_pattern"})
    if unknown:
        raise APIError(400, f"structured_outputs: unsupported keys {unknown[:5]}", "structured_outputs")
    if len(given) != 1:
        raise APIError(400, "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                       "structured_outputs")
    key, value = given[0], so[given[0]]
    if key == "json":
        value = value if isinstance(value, str) else json.dumps(value)
    elif key == "choice":
        value = json.dumps(value)
    elif key == "json_object":
        value = ""
    elif not isinstance(value, str):
        raise APIError(400, f"structured_outputs.{key} must be a string", "structured_outputs")
    return StructuredOutput(_EXTENSION[key], value, param="structured_outputs")
