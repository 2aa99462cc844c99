"""LLM-PQ: phase-aware pipeline partition and per-layer quantization planning
(docs/design/pipeline.md)."""
