"""A bf16 layer slice's decode forward in one C++ call (`engine/kernels/csrc/decode_stack.cpp`).

In a decode step of a few rows, the Python layer loop (engine/model/llama.py) costs: ten dispatched
calls per layer through their Python wrappers, and the weight stream stalls between them; one call
saves most at the fewest requests (bench/bench_decode_stack.py, bench/results/decode_stack_epyc.md).
The call runs the same kernels in the same order from C++,
so its results are bit for bit the loop's.

It serves all-decode batches (one query row per request, the in-place decode kernel) of a bf16
slice whose every matmul has a blocked weight (engine/kernels/bf16_linear.py) and none packed block
codes (the opt-in `--kernel-packed-bf16`, which small batches would take in the loop), and whose
layers have no q/k norms; other batches, dtypes, devices and models take the loop. Off with
`--no-kernel-decode-stack` (engine/kernels/switches.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kernels import bf16_linear, layer_ops, paged_attention, switches

_MATMULS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class StackWeights:
    """A slice's weights in the order the kernel takes them: per layer the input norm, the blocked
    qkv and o weights, the post-attention norm, the blocked gate_up and down weights."""

    weights: list[torch.Tensor]
    qkv_bias: list[torch.Tensor]  # empty, or one per layer


def why_not(slice_) -> str:
    """Why `slice_` (an engine.model.ModelSlice with its small-batch weights made) does not run
    its decode steps as one call, or "". Never raises."""
    off = switches.why_off("decode_stack")
    if off:
        return off
    if slice_.dtype != torch.bfloat16:
        return "not a bf16 slice"
    if slice_.shard.size > 1:
        return "a TP rank sums its layers' outputs over its group"
    if slice_.cfg.qk_norm:
        return "the layers have q/k norms"
    if slice_.cfg.sandwich_norms or slice_.cfg.mlp_act != "silu" or slice_.window:
        return "the layers are not Llama's (Gemma 3)"
    for name, ok in (
        ("matmul kernel", bf16_linear.available(slice_.batch_invariant)),
        ("layer ops", layer_ops.load()),
        ("decode attention", paged_attention.load()),
    ):
        if not ok:
            return f"the {name} is off"
    if slice_.cfg.head_dim > layer_ops.MAX_HEAD_DIM or slice_.cfg.head_dim % 2:
        return f"head_dim {slice_.cfg.head_dim} (the rotary kernel takes even sizes up to 512)"
    for layer in slice_.layers:
        if any(layer.small.get(m) is None or layer.small[m].blocked is None for m in _MATMULS):
            return "a matmul has no blocked weight"
        if any(layer.small[m].packed is not None for m in _MATMULS):
            return "small batches take packed block codes (--kernel-packed-bf16)"
        if layer.input_norm_weight.device.type != "cpu":
            return "not on the CPU"
    return ""


def stack_weights(slice_) -> StackWeights:
    """The kernel's weight list for `slice_`, for which `why_not(slice_)` is ""."""
    weights = []
    for layer in slice_.layers:
        s = layer.small
        weights += [
            layer.input_norm_weight.detach(),
            s["qkv"].blocked.blocks,
            s["o"].blocked.blocks,
            layer.post_norm_weight.detach(),
            s["gate_up"].blocked.blocks,
            s["down"].blocked.blocks,
        ]
    bias = [layer.qkv_bias.detach() for layer in slice_.layers if layer.qkv_bias is not None]
    return StackWeights(weights, bias)


def run_(
    h: torch.Tensor,
    sw: StackWeights,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    out_pages: torch.Tensor,
    out_offs: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
) -> None:
    """Every layer of the slice over `h` [T, hidden] (updated in place), one decode row per
    request: writes each row's keys and values into `kv` (the slice's pool [pages, layers, 2,
    page_size, kv_heads, head_dim]) at (out_pages, out_offs) and attends over the request's pages
    (`page_table` [T, max_pages], `seq_lens` [T])."""
    cos, sin = rope
    torch.ops.pdserve.decode_stack_(
        h,
        sw.weights,
        sw.qkv_bias,
        cos,
        sin,
        kv,
        out_pages,
        out_offs,
        page_table,
        seq_lens,
        num_heads,
        num_kv_heads,
        eps,
        kv.shape[-1] ** -0.5,
    )
