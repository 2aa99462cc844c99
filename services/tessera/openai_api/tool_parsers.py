"""tool_choice "auto": tool calls read from a model's free text, in the format --tool-call-parser
names (vLLM's parsers of the same names read the same formats):

  hermes       text <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Qwen 2.5/3, Hermes, the
               chatml_tools template), one block per call
  llama3_json  text <|python_tag|>{"name": ..., "parameters": {...}}; ... or the output beginning with
               that JSON (Llama 3.1-3.3), calls separated by ";"
  mistral      text [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or the output beginning with
               that list (Mistral v3 tokenizers)

Text before the first call is the message content. An output whose calls do not all parse is
left whole as content with no calls, as vLLM leaves it: a truncated or malformed call is never
half-reported. `start` finds where the calls begin; the streamed path (tool_stream.py) sends
text before that as content and holds back only what could still become the start."""
from __future__ import annotations

import json
import re
import secrets
import string
from dataclasses import dataclass
from typing import Callable, NamedTuple


class ParsedCall(NamedTuple):
    name: str
    arguments: str      # JSON text


class Parsed(NamedTuple):
    content: str | None
    calls: tuple[ParsedCall, ...]


@dataclass(frozen=True)
class ToolParser:
    markers: tuple[str, ...]              # any of these starts the calls
    read: Callable[[str], list | None]    # the text from the marker on -> call dicts, None if malformed
    # an output beginning (after blanks) with this is calls too: the worker's detokenizer drops
    # special tokens, which <|python_tag|> and Mistral's [TOOL_CALLS] are
    leading: str = ""
    id_kind: str = "openai"               # "mistral": 9 letters and digits, which its template requires

    def start(self, text: str) -> int | None:
        """Where the calls begin, or None."""
        found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
        if self.leading and text.lstrip().startswith(self.leading):
            found.append(len(text) - len(text.lstrip()))
        return min(found) if found else None

    def undecided(self, text: str) -> int:
        """How many characters at the end of `text` (which holds no start yet) may still become
        part of one: blanks (dropped before a call) and a proper prefix of a marker."""
        if self.leading and not text.strip():
            return len(text)
        stripped = text.rstrip()
        keep = max((k for m in self.markers for k in range(1, len(m)) if stripped.endswith(m[:k])), default=0)
        return len(text) - len(stripped[:len(stripped) - keep].rstrip())

    def parse(self, text: str) -> Parsed:
        i = self.start(text)
        calls = _calls(self.read(text[i:])) if i is not None else None
        if not calls:
            return Parsed(text, ())
        return Parsed(text[:i].rstrip() or None, calls)

    def call_id(self) -> str:
        if self.id_kind == "mistral":
            return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))
        return new_call_id()


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def _calls(items: list | None) -> tuple[ParsedCall, ...] | None:
    """Each item must be {"name": str, "arguments" (or Llama's "parameters"): an object}."""
    if not items:
        return None
    out = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        key = next((k for k in ("arguments", "parameters") if k in item), None)
        if key is None:           # {"name": "Paris", "population": ...} is an answer, not a call
            return None
        args = item[key]
        if isinstance(args, str):      # some models write the arguments as JSON text
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(args, dict):
            return None
        out.append(ParsedCall(item["name"], json.dumps(args, ensure_ascii=False)))
    return tuple(out)


_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)


def _hermes(text: str) -> list | None:
    """Every <tool_call> block (the last may lack its closing tag: the output ended there)."""
    try:
        return [json.loads(body) for body in _HERMES.findall(text)]
    except (ValueError, RecursionError):
        return None


def _json_sequence(text: str, separators: str) -> list | None:
    """JSON values one after another, separated by blanks or `separators`; None if anything else."""
    decoder, items, i = json.JSONDecoder(), [], 0
    try:
        while True:
            while i < len(text) and (text[i].isspace() or text[i] in separators):
                i += 1
            if i == len(text):
                return items
            value, i = decoder.raw_decode(text, i)
            items.append(value)
    except (ValueError, RecursionError):
        return None


def _llama3(text: str) -> list | None:
    return _json_sequence(text.removeprefix("<|python_tag|>"), ";")


def _mistral(text: str) -> list | None:
    values = _json_sequence(text.removeprefix("[TOOL_CALLS]"), "")
    if not values:
        return None
    return [call for v in values for call in (v if isinstance(v, list) else [v])]


PARSERS = {
    "hermes": ToolParser(("<tool_call>",), _hermes),
    "llama3_json": ToolParser(("<|python_tag|>",), _llama3, leading="{"),
    "mistral": ToolParser(("[TOOL_CALLS]",), _mistral, leading="[", id_kind="mistral"),
}
