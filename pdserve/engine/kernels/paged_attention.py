"""Attention that reads the paged KV pool in place, on the CPU (C++ kernels built with the other
CPU kernels, engine/kernels/cpu_kernels.py):

* decode: `engine/kernels/csrc/paged_attention.cpp`, fp32 or bf16, any CPU;
* extend (prefill chunks, over a cached prefix or not):
  `engine/kernels/csrc/extend_attention.cpp`, bf16 on a CPU with AVX-512 BF16. SDPA's CPU flash
  kernel, which the gather path calls, reached a fraction of the core's bf16 matmul rate; the
  kernel is several times faster (bench/results/extend_attention_epyc.md).

The gather-then-SDPA path (engine/model/llama.py) copies every decode request's KV pages out of the
pool for every layer; at 32 requests of ~350 tokens that copy moves about as many bytes per step as
the weights. The kernel reads each key and value once, where it lies.

`--no-kernel-paged-attention` turns both off, `--no-kernel-extend-attention` the extend kernel
alone (engine/kernels/switches.py); where the kernels cannot be built or loaded the rank serves
with the gather path and logs why. Other devices keep the gather path (the same torch code runs on
CUDA).
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import cpu_kernels, switches


def load() -> bool:
    """Whether the kernel is on in this process (`why_not()` says why not). Never raises."""
    return switches.current().paged_attention and cpu_kernels.load()


def why_not() -> str:
    return switches.why_off("paged_attention") or cpu_kernels.why_not()


def decode_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
) -> torch.Tensor:
    """q [B, heads, head_dim], heads and head_dim contiguous, any stride between requests (a
    decode batch's rows of the fused QKV output); kv a layer's pool view [pages, 2, page_size,
    kv_heads, head_dim]; page_table int64 [B, max_pages]; seq_lens int64 [B] (keys per request);
    `window` > 0: each request attends to its last `window` keys only (a sliding-window layer),
    and its pages before them are not read. Returns a contiguous [B, heads, head_dim] in q's
    dtype. Call `load()` first."""
    return torch.ops.pdserve.paged_decode_attention(q, kv, page_table, seq_lens, scale, window)


def extend_why_not(group: int, head_dim: int, page_size: int) -> str:
    """Why the extend kernel is off for these shapes here, or "" where it serves them."""
    off = switches.why_off("extend_attention") or why_not()
    if off or not load():
        return off or "the CPU kernels did not load"
    if not torch.ops.pdserve.extend_attention_supports(group, head_dim, page_size):
        return (
            f"no kernel for {group} query heads per KV head of {head_dim} dims and pages of "
            f"{page_size} tokens on this CPU (it needs AVX-512 BF16)"
        )
    if head_dim == 256 and "amx_bf16" in cpu_kernels.cpu_flags().split():
        # measured: 1.12x SDPA's time at 300 prompt tokens, 1.42x at 1500, where SDPA's bf16
        # runs on the tile units; 0.83x and 0.46x on an AVX-512 BF16 EPYC
        # (bench/results/gemma3_decode.md)
        return "head size 256 on an AMX CPU: gathering pages for SDPA is faster there"
    return ""


def extend_attention_(
    out: torch.Tensor,
    q: torch.Tensor,
    kv: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_new: torch.Tensor,
    first_rows: torch.Tensor,
    scale: float,
    window: int = 0,
) -> None:
    """Causal attention of B extend items over their cached and new keys, bf16: item b's num_new[b]
    tokens are rows first_rows[b].. of q [T, heads, head_dim] (heads and head_dim contiguous, any
    row stride) and of out (contiguous, q's shape), which receives them; its seq_lens[b] keys
    (start + num_new) lie in the pool pages page_table[b] ([B, max_pages] int64). Other rows of
    out are left as they are. `window` > 0: a token attends to its last `window` positions only
    (a sliding-window layer). Check `extend_why_not()` first."""
    torch.ops.pdserve.paged_extend_attention_(
        out, q, kv, page_table, seq_lens, num_new, first_rows, scale, window
    )
