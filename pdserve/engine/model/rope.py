"""Rotary position embedding: inverse frequencies (with scaling) and a cos/sin table indexed by
position.

The table is computed once per slice (float64, then cast) and indexed by the batch's positions, so a
forward never recomputes trigonometry. Layout is Hugging Face's "rotate half" (not interleaved):
GGUF Q/K weights are un-permuted at load time to match it.
"""

from __future__ import annotations

import math

import torch

from pdserve.engine.model.config import SUPPORTED_ROPE_TYPES


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] (float64),
    as transformers computes them for each rope_type.

    `freq_factors` is llama.cpp's form (a `rope_freqs.weight` tensor in GGUF): each frequency is
    divided by its factor.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv
    assert scaling is not None  # kind came from it: None means "default"
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "freq_factors":
        return inv / torch.tensor(scaling["freq_factors"], dtype=torch.float64)
    if kind == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_ctx = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(
        f"unsupported rope_type {kind!r} (supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
    )


class RopeTable:
    """cos/sin [max_pos, head_dim] (halves duplicated),
    grown on demand when a position exceeds it."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict | None,
        max_pos: int,
        dtype: torch.dtype = torch.float32,
    ):
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling)
        self.dtype = dtype
        self.cos = self.sin = torch.empty(0)
        self._build(max(max_pos, 1))

    def _build(self, n: int) -> None:
        freqs = torch.outer(torch.arange(n, dtype=torch.float64), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos, self.sin = emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def lookup(
        self, positions: torch.Tensor, max_position: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] for `positions` [T]; `max_position` is positions.max()
        (known to the caller)."""
        if max_position >= self.cos.shape[0]:
            self._build(max(2 * self.cos.shape[0], max_position + 1))
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim] -> rotated copy (rotate-half convention)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return torch.addcmul(x * cos, rotated, sin)
