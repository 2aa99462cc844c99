"""Benchmarks that print numbers: engine throughput and an OpenAI-API load generator."""
