"""StructuredOutput -> an llguidance matcher for one tokenizer.

llguidance, not xgrammar (bench/grammar_libraries.py, docs/structured-outputs.md): it compiles a
schema in about a millisecond, refuses a JSON Schema keyword it does not implement with an error
naming it (xgrammar accepted some and ignored them), and needs no other package. Its per-row
mask costs more than xgrammar's; the engine computes every row's mask in one call.

A compiled grammar is a template matcher kept in an LRU cache; each request gets a deep copy
(cheap: the lexer and grammar are shared). JSON is generated compact (no whitespace between
tokens): a small model given free whitespace can spend its whole budget on newlines.
"""
from __future__ import annotations

import collections
import json
import threading
from dataclasses import dataclass

from tessera.config import ConfigError, StructuredOutput


@dataclass(frozen=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024          # the spec's text (a schema, regex or grammar)
    compile_timeout_s: float = 5.0      # the worker answers 400 past it (async_engine.py)
    max_grammar_size: int = 200_000     # llguidance's symbol budget for one grammar
    cache_size: int = 256


class Grammars:
    """Compiles specs for one tokenizer (built on first use: about a second for 50k tokens)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, limits: GrammarLimits = GrammarLimits()) -> None:
        self.tokenizer, self.vocab_size, self.limits = tokenizer, vocab_size, limits
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll_tokenizer = None
        self._cache: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    @property
    def ll_tokenizer(self):
        with self._lock:
            if self._ll_tokenizer is None:
                import llguidance.hf
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None)
            return self._ll_tokenizer

    def matcher(self, spec: StructuredOutput):
        """A fresh matcher at the start of `spec`'s grammar; ConfigError (naming spec.param) if
        it cannot be compiled."""
        return self.compile(spec).deep_copy()

    def compile(self, spec: StructuredOutput):
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        template = self._compile(spec)
        with self._lock:
            self._cache[key] = template
            while len(self._cache) > self.limits.cache_size:
                self._cache.popitem(last=False)
        return template

    def _compile(self, spec: StructuredOutput):
        import llguidance
        if len(spec.value.encode()) > self.limits.max_bytes:
            raise ConfigError(f"the {_what(spec)} is {len(spec.value.encode())} bytes; at most "
                              f"{self.limits.max_bytes} are allowed", spec.param)
        grammar = lark_or_grammar(spec)
        limits = llguidance.LLParserLimits(max_grammar_size=self.limits.max_grammar_size, verbose_errors=False)
        error = llguidance.LLMatcher.validate_grammar(grammar, self.ll_tokenizer, limits=limits)
        if error:
            raise ConfigError(f"the {_what(spec)} cannot be used: {_short(error)}", spec.param)
        matcher = llguidance.LLMatcher(self.ll_tokenizer, grammar, log_level=0, limits=limits)
        if matcher.is_error():
            raise ConfigError(f"the {_what(spec)} cannot be used: {_short(matcher.get_error())}", spec.param)
        return matcher


_JSON_OPTIONS = {"whitespace_flexible": False}


def lark_or_grammar(spec: StructuredOutput) -> str:
    """The llguidance grammar text for a spec (its own JSON or Lark)."""
    from llguidance import LLMatcher
    if spec.kind in ("json", "json_object"):
        if spec.kind == "json_object":
            schema = {"type": "object"}
        else:
            try:
                schema = json.loads(spec.value)
            except json.JSONDecodeError as e:
                raise ConfigError(f"the JSON schema is not valid JSON: {e}", spec.param) from None
            if isinstance(schema, bool):
                schema = {} if schema else {"not": {}}
            if not isinstance(schema, dict):
                raise ConfigError("the JSON schema must be an object", spec.param)
        return LLMatcher.grammar_from_json_schema(schema, overrides=_JSON_OPTIONS)
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError:
            choices = None
        if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
            raise ConfigError("choice must be a non-empty list of strings", spec.param)
        # Lark string literals take JSON's escapes
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    return LLMatcher.grammar_from_lark(spec.value)


def _what(spec: StructuredOutput) -> str:
    return {"json": "JSON schema", "json_object": "JSON object format", "regex": "regex",
            "choice": "choice list", "grammar": "grammar"}[spec.kind]


def _short(error: str) -> str:
    """llguidance's message without its internal context lines."""
    return " ".join(error.strip().splitlines()[:3])[:500]
