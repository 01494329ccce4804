"""The router's OpenAI-compatible surface: request models and parsing, the generation, tokenize
and OpenAPI endpoints, responses and SSE streams, n > 1."""
