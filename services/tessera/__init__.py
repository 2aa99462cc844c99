"""Tessera: an LLM serving platform (engine, gRPC workers, OpenAI-compatible gateway)."""

__version__ = "0.1.0"
