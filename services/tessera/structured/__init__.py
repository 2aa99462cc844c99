"""Structured outputs: decoding constrained by a grammar (JSON Schema, regex, choice, Lark),
compiled by llguidance into a per-request matcher whose token mask the sampler applies."""
