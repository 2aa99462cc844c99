"""xgrammar against llguidance, the two grammar libraries made for constrained decoding, on what
structured outputs costs Tessera: JSON Schema compile time, the per-step mask time of a batch of
64 rows, and which JSON Schema keywords each accepts (compiles and enforces), refuses with an
error, or accepts while ignoring. SmolLM2's tokenizer (49,152 tokens), one thread.

    .venv/bin/python bench/grammar_libraries.py [--out bench/results/grammar-KIND-DATE.json]

xgrammar is optional here (its wheel pulls triton and apache-tvm-ffi); install it beside the
venv with `pip install --no-deps --target /tmp/xg xgrammar apache-tvm-ffi` and run with
PYTHONPATH=/tmp/xg.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from result_file import pop_out, save

BATCH = 64

# keyword -> (schema, an instance that satisfies it, an instance that breaks only that keyword)
CASES = {
    "nested objects": ({"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "integer"}}, "required": ["b"]}}, "required": ["a"]}, {"a": {"b": 1}}, {"a": {}}),
    "minItems/maxItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3}, [1, 2], [1]),
    "enum": ({"enum": ["red", "green"]}, "red", "blue"),
    "const": ({"const": 7}, 7, 8),
    "anyOf with null": ({"anyOf": [{"type": "string"}, {"type": "null"}]}, None, 3),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, True, "x"),
    "allOf": ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                         {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
              {"a": 1, "b": 2}, {"a": 1}),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "ABC-12", "abc"),
    "minLength/maxLength": ({"type": "string", "minLength": 2, "maxLength": 4}, "abc", "a"),
    "minimum/maximum": ({"type": "integer", "minimum": 3, "maximum": 9}, 5, 12),
    "exclusiveMinimum": ({"type": "number", "exclusiveMinimum": 0}, 0.5, 0),
    "multipleOf": ({"type": "integer", "multipleOf": 5}, 10, 7),
    "format date-time": ({"type": "string", "format": "date-time"}, "2026-12-06T10:00:00Z", "yesterday"),
    "format email": ({"type": "string", "format": "email"}, "a@b.co", "nobody"),
    "format uuid": ({"type": "string", "format": "uuid"}, "123e4567-e89b-12d3-a456-426614174000", "x"),
    "$ref/$defs": ({"$defs": {"p": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}},
                    "type": "array", "items": {"$ref": "#/$defs/p"}}, [{"x": 1}], [{"y": 1}]),
    "recursive $ref": ({"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {
        "$ref": "#/$defs/n"}}}, "required": ["kids"]}}, "$ref": "#/$defs/n"}, {"kids": [{"kids": []}]}, {"kids": [{}]}),
    "additionalProperties false": ({"type": "object", "properties": {"a": {"type": "integer"}},
                                    "additionalProperties": False}, {"a": 1}, {"a": 1, "b": 2}),
    "additionalProperties schema": ({"type": "object", "additionalProperties": {"type": "integer"}},
                                    {"k": 1}, {"k": "v"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^x_": {"type": "integer"}},
                           "additionalProperties": False}, {"x_a": 1}, {"y": 1}),
    "propertyNames": ({"type": "object", "propertyNames": {"pattern": "^[a-z]+$"}}, {"ab": 1}, {"A1": 1}),
    "prefixItems": ({"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}],
                     "items": False}, [1, "a"], ["a", 1]),
    "uniqueItems": ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 2], [1, 1]),
    "contains": ({"type": "array", "contains": {"const": 3}}, [1, 3], [1, 2]),
    "minProperties": ({"type": "object", "minProperties": 1}, {"a": 1}, {}),
    "dependentRequired": ({"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
                          {"a": 1, "b": 2}, {"a": 1}),
    "if/then/else": ({"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}},
                     {"a": 1, "b": 1}, {"a": 1}),
    "not": ({"not": {"type": "string"}}, 1, "s"),
}

# the schema the mask timing walks: a typical "extract these fields" response
STEP_SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "format": "email"},
    "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 4},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
STEP_INSTANCE = {"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["a", "c"],
                 "address": {"city": "London", "zip": "01234"}}


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.ll, self.llt = llguidance, llguidance.torch
        self.tok = llguidance.hf.from_tokenizer(tokenizer)
        self.executor = llguidance.LLExecutor(num_threads=1)

    def compile(self, schema: dict):
        grammar = self.ll.LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides={"whitespace_flexible": False})
        error = self.ll.LLMatcher.validate_grammar(grammar, self.tok)
        if error:
            raise ValueError(error)
        return grammar

    def matcher(self, compiled):
        return self.ll.LLMatcher(self.tok, compiled, log_level=0)

    def accepts(self, m, ids: list[int]) -> bool:
        return m.consume_tokens(ids) and m.is_accepting()

    def fill(self, matchers, mask: torch.Tensor) -> None:
        self.llt.fill_next_token_bitmask_par(self.executor, [(m, i) for i, m in enumerate(matchers)], mask)

    def advance(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.consume_token(token), m.get_error()


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer) -> None:
        import xgrammar
        self.xg = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"),
                                                  strict_mode=True)

    def matcher(self, compiled):
        return self.xg.GrammarMatcher(compiled)

    def accepts(self, m, ids: list[int]) -> bool:
        return all(m.accept_token(t) for t in ids) and m.accept_token(m.stop_token_ids[0])

    def fill(self, matchers, mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)

    def advance(self, matchers, token: int) -> None:
        for m in matchers:
            assert m.accept_token(token)


def coverage(lib, tokenizer) -> list[dict]:
    rows = []
    for keyword, (schema, good, bad) in CASES.items():
        try:
            compiled = lib.compile(schema)
        except Exception as e:    # noqa: BLE001 - every library error is a verdict here
            rows.append({"library": lib.name, "keyword": keyword, "verdict": "refused",
                         "detail": str(e).splitlines()[0][:120]})
            continue
        text = lambda v: json.dumps(v, separators=(",", ":"))  # noqa: E731
        ok = lib.accepts(lib.matcher(compiled), tokenizer.encode(text(good), add_special_tokens=False))
        broken = lib.accepts(lib.matcher(compiled), tokenizer.encode(text(bad), add_special_tokens=False))
        verdict = "enforced" if ok and not broken else "ignored" if ok else "rejects valid"
        rows.append({"library": lib.name, "keyword": keyword, "verdict": verdict, "detail": ""})
    return rows


def timings(lib, tokenizer, vocab: int) -> dict:
    compile_ms = []
    for i in range(5):     # a fresh schema each time: a changed description defeats any cache
        schema = dict(STEP_SCHEMA, description=f"run {i}")
        t0 = time.perf_counter()
        compiled = lib.compile(schema)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    ids = tokenizer.encode(json.dumps(STEP_INSTANCE, separators=(",", ":")), add_special_tokens=False)
    matchers = [lib.matcher(compiled) for _ in range(BATCH)]
    mask = torch.full((BATCH, (vocab + 31) // 32), -1, dtype=torch.int32)
    step_ms = []
    for token in ids:
        t0 = time.perf_counter()
        lib.fill(matchers, mask)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        lib.advance(matchers, token)
    from importlib.metadata import version
    return {"library": lib.name, "version": version(lib.name), "compile_ms_median": round(statistics.median(compile_ms), 2),
            "compile_ms_max": round(max(compile_ms), 2), "batch": BATCH, "steps": len(ids),
            "mask_ms_per_step_median": round(statistics.median(step_ms), 3),
            "mask_ms_per_step_p99": round(sorted(step_ms)[int(0.99 * (len(step_ms) - 1))], 3)}


def main() -> int:
    out = pop_out()
    torch.set_num_threads(1)
    from tessera.models.default_model import default_tokenizer
    tokenizer = default_tokenizer()
    libs = [LLGuidance(tokenizer)]
    try:
        libs.append(XGrammar(tokenizer))
    except ImportError:
        print("xgrammar is not installed: only llguidance measured", file=sys.stderr)
    timing_rows, coverage_rows = [], []
    for lib in libs:
        timing_rows.append(timings(lib, tokenizer, len(tokenizer)))
        print(json.dumps(timing_rows[-1]))
        coverage_rows += coverage(lib, tokenizer)
    summary = {lib.name: {v: sum(r["verdict"] == v for r in coverage_rows if r["library"] == lib.name)
                          for v in ("enforced", "ignored", "refused", "rejects valid")} for lib in libs}
    print(json.dumps(summary))
    for r in coverage_rows:
        print(f"{r['library']:11} {r['keyword']:28} {r['verdict']:13} {r['detail']}")
    for row in timing_rows:
        row.update({f"keywords_{k.replace(' ', '_')}": n for k, n in summary[row["library"]].items()})
    save(out, "grammar", f"Grammar libraries: JSON Schema compile time, mask time at batch {BATCH}, keyword coverage",
         timing_rows, details={"coverage": coverage_rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
