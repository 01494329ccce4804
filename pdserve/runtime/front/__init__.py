"""A node's front process: HTTP, request checks, tokenization, answers, metrics and traces."""
