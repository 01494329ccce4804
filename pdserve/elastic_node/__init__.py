"""An elastic PD node: prefill or decode, changing role at runtime (docs/ARCHITECTURE.md
section 14)."""
