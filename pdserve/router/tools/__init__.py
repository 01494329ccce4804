"""Tool calling: the request models, the guide that forces a call, and the parsers that find
calls in a model's text, whole and streamed."""
