"""MkDocs hook: docs/reference/openapi.md and docs/reference/openapi.json, written at build time
from the gateway's own FastAPI app (tessera.openai_api.openapi_export builds it without an
engine). The page lists every path and method with its summary, parameters, request body and
responses, then each request schema's fields; openapi.json is the raw schema."""
from __future__ import annotations

import json
import pathlib
import re
import sys

PAGE, RAW = "reference/openapi.md", "reference/openapi.json"
ROOT = pathlib.Path(__file__).resolve().parents[2]
CONSTRAINTS = {"minimum": "≥ {}", "ge": "≥ {}", "exclusiveMinimum": "> {}", "gt": "> {}", "maximum": "≤ {}",
               "le": "≤ {}", "exclusiveMaximum": "< {}", "lt": "< {}", "minLength": "length ≥ {}",
               "maxLength": "length ≤ {}", "minItems": "items ≥ {}", "maxItems": "items ≤ {}",
               "pattern": "matches `{}`"}


def openapi_schema() -> dict:
    """The schema, from the installed package (the venv's editable install), else from this
    checkout's services/ and kernels/ (a mkdocs outside the venv)."""
    try:
        from tessera.openai_api import openapi_export
    except ImportError:
        sys.path[:0] = [str(ROOT / "services"), str(ROOT / "kernels")]
        from tessera.openai_api import openapi_export
    return openapi_export.openapi_schema()


def _cell(text) -> str:
    """Text for a table cell on one line; pipes escaped outside `code spans`, where a table
    would split the cell."""
    parts = re.split(r"(`[^`]*`)", " ".join(str(text).split()))
    return "".join(p if p.startswith("`") else p.replace("|", r"\|") for p in parts)


def _code(value) -> str:
    return f"`{value}`"


def _number(value):
    return int(value) if isinstance(value, float) and value.is_integer() else value


def schema_anchor(name: str) -> str:
    return "schema-" + name.lower()


def operation_anchor(method: str, path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", f"{method} {path}".lower()).strip("-")


def type_of(s: dict) -> str:
    """A JSON schema as a short type: `string or null`, `array of ChatMessage`, ..."""
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{schema_anchor(name)})"
    if "anyOf" in s:
        kinds = list(dict.fromkeys(type_of(x) for x in s["anyOf"]))
        if "number" in kinds and "integer" in kinds:     # pydantic's float: number or integer
            kinds.remove("integer")
        return " or ".join(kinds)
    if "enum" in s:
        return "one of " + ", ".join(_code(json.dumps(v)) for v in s["enum"])
    if "const" in s:
        return _code(json.dumps(s["const"]))
    kind = s.get("type", "any")
    if kind == "array" and "items" in s:
        return f"array of {type_of(s['items'])}"
    if kind == "object" and isinstance(s.get("additionalProperties"), dict):
        return f"object of {type_of(s['additionalProperties'])}"
    return " or ".join(kind) if isinstance(kind, list) else kind


def constraints(s: dict) -> str:
    found = []
    for part in [s, *s.get("anyOf", ())]:
        found += [fmt.format(_number(part[key])) for key, fmt in CONSTRAINTS.items() if key in part]
        if part.get("type") == "array" and isinstance(part.get("items"), dict):
            found += [f"each {c}" for c in [constraints(part["items"])] if c]
    return ", ".join(dict.fromkeys(found))


def _default(s: dict) -> str:
    return _code(json.dumps(s["default"])) if "default" in s else ""


def _fields(schema: dict) -> list[str]:
    required = set(schema.get("required", ()))
    rows = ["| Field | Type | Required | Default | Constraints |", "|---|---|---|---|---|"]
    for name, s in schema.get("properties", {}).items():
        rows.append(f"| `{name}` | {_cell(type_of(s))} | {'yes' if name in required else ''} | "
                    f"{_default(s)} | {_cell(constraints(s))} |")
    return rows


def _operation(method: str, path: str, op: dict) -> list[str]:
    out = [f"### {method.upper()} {path} {{#{operation_anchor(method, path)}}}", "", op.get("summary", ""), ""]
    if op.get("description"):
        out += [_cell(op["description"]), ""]
    params = op.get("parameters", [])
    if params:
        out += ["Parameters:", "", "| Name | In | Type | Required | Default | Constraints |",
                "|---|---|---|---|---|---|"]
        out += [f"| `{p['name']}` | {p['in']} | {_cell(type_of(p.get('schema', {})))} | "
                f"{'yes' if p.get('required') else ''} | {_default(p.get('schema', {}))} | "
                f"{_cell(constraints(p.get('schema', {})))} |" for p in params]
        out.append("")
    body = op.get("requestBody")
    if body:
        kinds = ", ".join(f"`{media}`: {type_of(c.get('schema', {}))}" for media, c in body.get("content", {}).items())
        out += [f"Request body ({'required' if body.get('required') else 'optional'}): {kinds}", ""]
    out += ["| Response | Description | Body |", "|---|---|---|"]
    for status, r in op.get("responses", {}).items():
        kinds = ", ".join(f"`{media}`" + (f": {type_of(c['schema'])}" if c.get("schema") else "")
                          for media, c in r.get("content", {}).items())
        out.append(f"| {status} | {_cell(r.get('description', ''))} | {_cell(kinds)} |")
    return out + [""]


def render(schema: dict) -> str:
    """The page for `schema` (an OpenAPI 3 document)."""
    info = schema.get("info", {})
    out = ["# OpenAPI schema", "",
           f"The HTTP interface of the gateway ({info.get('title', '')} {info.get('version', '')}), generated at "
           "build time from the gateway's FastAPI app by `python -m tessera.openai_api.openapi_export`. "
           "The raw schema: [openapi.json](openapi.json); a running gateway serves the same document at "
           "`GET /openapi.json`. [OpenAI API](../api.md) explains the fields' meaning, the errors and "
           "where behaviour differs from OpenAI's.", "",
           "!!! note \"Errors\"",
           "    FastAPI lists `422 Validation Error` for routes with a body or parameters, but the gateway "
           "answers a request that fails validation with `400` and OpenAI's error envelope "
           "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`, like every other error it returns. "
           "`POST /v1/files` reads its multipart form itself, so its body is not in the schema "
           "(fields `file` and `purpose`, as OpenAI's; see [Offline jobs](../batch.md)).", "",
           "## Endpoints", "", "| Method | Path | Summary |", "|---|---|---|"]
    operations = [(m, p, op) for p, methods in schema.get("paths", {}).items() for m, op in methods.items()]
    out += [f"| {m.upper()} | [`{p}`](#{operation_anchor(m, p)}) | {_cell(op.get('summary', ''))} |"
            for m, p, op in operations]
    out.append("")
    for m, p, op in operations:
        out += _operation(m, p, op)
    out += ["## Schemas", ""]
    for name, s in schema.get("components", {}).get("schemas", {}).items():
        out += [f"### {name} {{#{schema_anchor(name)}}}", ""]
        if s.get("description"):
            out += [_cell(s["description"]), ""]
        out += [*_fields(s), ""]
    return "\n".join(out)


def on_files(files, config):
    from mkdocs.structure.files import File
    schema = openapi_schema()
    for uri, content in ((PAGE, render(schema)), (RAW, json.dumps(schema, indent=2, sort_keys=True) + "\n")):
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, uri, content=content))
    return files
