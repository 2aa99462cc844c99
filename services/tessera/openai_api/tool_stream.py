"""One choice's output text -> OpenAI chat deltas with tool calls (the first delta of a call
carries index, id, type and name; argument fragments follow). The non-streamed message is these
same deltas put together (`message`), so a streamed call reassembles to the non-streamed one.

  named     every output character is an argument fragment of the one call
  required  the output list is read as it arrives (_ListScanner): each item's name opens a call,
            the characters of its "parameters" value are its argument fragments
  auto      text is content until the parser's start of a call; only a tail that could still
            become one is held back. From the start on, the output is held to its end and parsed
            whole (tool_parsers.py): each call is one delta with all its arguments, or, if the
            calls do not parse, the held text goes out as content.

finish_reason: "tool_calls" when required or auto produced calls and the model stopped by
itself; a named choice keeps "stop" (vLLM's answer; OpenAI's too)."""
from __future__ import annotations

import json

from tessera.openai_api.tool_parsers import PARSERS, new_call_id
from tessera.openai_api.tools import ToolPlan


class ToolStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.parser = PARSERS.get(plan.parser)
        self.text, self.sent, self.in_calls = "", 0, False
        self.calls = 0                       # calls opened so far
        self.scanner = _ListScanner() if plan.mode == "required" else None

    def feed(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The delta for this piece of output (possibly empty) and the finish reason to report."""
        self.text += text
        if self.plan.mode == "named":
            delta = self._named(text, finish_reason is not None)
        elif self.scanner is not None:
            delta = self._tool_calls(self.scanner.feed(text))
        else:
            delta = self._auto(finish_reason is not None)
        if finish_reason == "stop" and self.calls and self.plan.mode != "named":
            finish_reason = "tool_calls"
        return delta, finish_reason

    def _named(self, text: str, last: bool) -> dict:
        if not text and not (last and not self.calls):
            return {}
        return self._tool_calls([(0, self.plan.name if not self.calls else None, text)])

    def _tool_calls(self, events: list[tuple[int, str | None, str]]) -> dict:
        entries: list[dict] = []
        for i, name, fragment in events:
            if name is not None:
                self.calls += 1
                entries.append({"index": i, "id": new_call_id(), "type": "function",
                                "function": {"name": name, "arguments": fragment}})
            elif entries and entries[-1]["index"] == i:
                entries[-1]["function"]["arguments"] += fragment
            elif fragment:
                entries.append({"index": i, "function": {"arguments": fragment}})
        return {"tool_calls": entries} if entries else {}

    def _auto(self, last: bool) -> dict:
        if not self.in_calls:
            start = self.parser.start(self.text)
            if start is None:
                end = len(self.text) if last else len(self.text) - self.parser.undecided(self.text)
                return self._content(end)
            self.in_calls = True
            if not last:
                return self._content(len(self.text[:start].rstrip()))
        if not last:
            return {}
        parsed = self.parser.parse(self.text)
        # a JSON answer naming no offered function is text (a parser reads any {"name": ...})
        if not parsed.calls or (self.plan.names and any(c.name not in self.plan.names for c in parsed.calls)):
            return self._content(len(self.text))
        delta = self._content(len(parsed.content or ""))
        calls = parsed.calls if self.plan.parallel else parsed.calls[:1]
        self.calls = len(calls)
        delta["tool_calls"] = [{"index": i, "id": self.parser.call_id(), "type": "function",
                                "function": {"name": c.name, "arguments": c.arguments}} for i, c in enumerate(calls)]
        return delta

    def _content(self, end: int) -> dict:
        piece, self.sent = self.text[self.sent:max(end, self.sent)], max(end, self.sent)
        return {"content": piece} if piece else {}


def message(plan: ToolPlan, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
    """The non-streamed message: the whole output fed as one piece, its deltas put together."""
    delta, finish = ToolStream(plan).feed(text, finish_reason or "stop")
    calls: list[dict] = []
    for entry in delta.get("tool_calls", ()):
        if "id" in entry:
            calls.append({"id": entry["id"], "type": "function", "function": dict(entry["function"])})
        else:
            calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
    body = {"role": "assistant", "content": delta.get("content") or (None if calls else "")}
    if calls:
        body["tool_calls"] = calls
    return body, finish if finish_reason else finish_reason


class _ListScanner:
    """A JSON list of {"name": ..., "parameters": ...} objects read character by character (the
    grammar guarantees the shape, not the key order): yields (call index, its name the moment it
    is known, else None, argument characters). Arguments before the name wait for it."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped = 0, False, False
        self.index, self.key, self.expect_key, self.capturing = -1, "", False, False
        self.string: str | None = None      # a key or value string of an item, as written
        self.name: str | None = None
        self.waiting = ""                    # argument characters that came before the name

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        events: list[tuple[int, str | None, str]] = []
        for ch in text:
            had_name = self.name is not None
            kept = self._char(ch)
            if self.name is not None and not had_name:      # the name just ended: open the call
                events.append((self.index, self.name, self.waiting))
                self.waiting = ""
            if not kept:
                continue
            if self.name is None:
                self.waiting += kept
            elif events and events[-1][0] == self.index:
                i, name, fragment = events[-1]
                events[-1] = (i, name, fragment + kept)
            else:
                events.append((self.index, None, kept))
        return events

    def _char(self, ch: str) -> str:
        """Advance by one character; returns it when it belongs to the arguments."""
        if self.in_string:
            self._string_char(ch)
            return ch if self.capturing else ""
        if self.capturing and self.depth == 2 and ch in ",}":     # the parameters value ended
            self.capturing = False
        kept = ch if self.capturing else ""
        if ch == '"':
            self.in_string = True
            self.string = "" if self.depth == 2 and not self.capturing else None
        elif ch in "{[":
            self.depth += 1
            if self.depth == 2:
                self.index, self.name, self.key, self.expect_key = self.index + 1, None, "", True
        elif ch in "}]":
            self.depth -= 1
        elif self.depth == 2 and ch == ":":
            self.expect_key, self.capturing = False, self.key == "parameters"
        elif self.depth == 2 and ch == ",":
            self.expect_key = True
        return kept

    def _string_char(self, ch: str) -> None:
        if self.escaped:
            self.escaped = False
        elif ch == "\\":
            self.escaped = True
        elif ch == '"':
            self.in_string = False
            if self.string is not None:
                value = json.loads(f'"{self.string}"')
                if self.expect_key:
                    self.key = value
                elif self.key == "name":
                    self.name = value
            return
        if self.string is not None:
            self.string += ch
