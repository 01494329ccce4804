"""Per-rank KV page movement between prefill and decode ranks over the Mooncake transfer engine."""
