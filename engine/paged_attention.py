"""Decode attention that reads the paged KV pool in place, on the CPU: the C++ kernel in
`engine/csrc/paged_attention.cpp` (built with the other CPU kernels, engine/cpu_kernels.py).

The gather-then-SDPA path (engine/model.py) copies every decode request's KV pages out of the pool
for every layer; at 32 requests of ~350 tokens that copy moves about as many bytes per step as the
weights. The kernel reads each key and value once, where it lies.

`PDSERVE_PAGED_ATTENTION=0` turns the kernel off; where the kernels cannot be built or loaded the
rank serves with the gather path and logs why. Other devices keep the gather path (the same torch
code runs on CUDA).
"""

from __future__ import annotations

import torch

from engine import cpu_kernels

ENV_SWITCH = "PDSERVE_PAGED_ATTENTION"


def load() -> bool:
    """Whether the kernel is on in this process (`why_not()` says why not). Never raises."""
    return not cpu_kernels.switched_off(ENV_SWITCH) and cpu_kernels.load()


def why_not() -> str:
    return cpu_kernels.switched_off(ENV_SWITCH) or cpu_kernels.why_not()


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, heads, head_dim], heads and head_dim contiguous, any stride between requests (a
    decode batch's rows of the fused QKV output); kv a layer's pool view [pages, 2, page_size,
    kv_heads, head_dim]; page_table int64 [B, max_pages]; seq_lens int64 [B] (keys per request).
    Returns a contiguous [B, heads, head_dim] in q's dtype. Call `load()` first."""
    return torch.ops.pdserve.paged_decode_attention(q, kv, page_table, seq_lens, scale)
