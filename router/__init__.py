"""The OpenAI-compatible PD router (HTTP only; imports no other pdserve package)."""
