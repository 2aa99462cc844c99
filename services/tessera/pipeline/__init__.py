"""LLM-PQ: phase-aware pipeline partition and per-layer quantization planning (papers.md §4)."""
