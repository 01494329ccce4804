"""The OpenAI-compatible PD router (HTTP only; of pdserve it imports only pdserve.infra)."""
