"""The OpenAI-compatible HTTP layer: request schema, error envelope, response formatting."""
