"""The model's matmuls, each against its weight's plain [out, in] tensor or against a copy of it
made for the batch sizes where the plain weight is slow (`SmallWeights`: decode batches in fp32,
every batch in bf16):

- **packed block codes** (engine/kernels/packed_linear.py), where the weight is exactly a 4-
  or 8-bit block grid (the default model, a Q4_1 GGUF), for batches of up to PACKED_MAX rows. A
  decode step reads about a fifth of the fp32 weight bytes.
- **a copy that oneDNN reordered into its blocked layout**, for the rows the packed codes do not
  take (`reordered_rows`). In fp32, MKL's sgemm on a plain [out, in] weight is slow at a few rows:
  the reordered copy is faster from 4 to 128 rows, slower below and no faster from 256 rows on
  (prefill chunks), which keep the plain weight (`bench/bench_linear.py`,
  bench/results/linear.md). In bf16 on a core with AMX (torch's plain bf16 matmul reorders the
  weight on every call) the copy is faster at every row count (bench/results/linear_bf16.md), so
  bf16 batches of any size take it. It costs the memory of the weights once more.
- **a bf16 copy blocked for VDPBF16PS** (engine/kernels/bf16_linear.py), on a CPU with AVX-512
  BF16 and no AMX, in place of the reordered copy: its kernel prefetches the next block of the
  weight while it multiplies the current one: faster than oneDNN at decode sizes with the weights
  streamed from memory, and as fast at prefill sizes (bench/results/bf16_linear_epyc.md).

fp32 prefill chunks take the plain weight (MKL), bf16 ones the blocked copy; both split with a
helper thread on a spare core where the rank has one (engine/kernels/spare_core.py; in bf16 only
on the blocked kernel: on oneDNN's reordered copy it cost throughput; bench/results/
spare_core_bf16.md).
`EngineConfig.small_batch_weights` (`--no-small-batch-weights`) turns the copies off. Only on the
CPU: elsewhere there are no copies and every matmul takes the plain path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import bf16_linear, packed_linear, spare_core
from pdserve.engine.kernels.bf16_linear import BlockedWeight
from pdserve.engine.kernels.packed_linear import PackedWeight

SMALL_MIN, SMALL_MAX = 4, 128  # fp32 rows through the reordered copy; bf16: any (module doc)


def reordered_rows(dtype: torch.dtype) -> tuple[int, float]:
    """The row counts (lowest, highest) that multiply through the oneDNN-reordered copy."""
    return (1, float("inf")) if dtype == torch.bfloat16 else (SMALL_MIN, SMALL_MAX)


# fp32: packed codes up to this many rows; past it the kernel's arithmetic, not the bytes it
# reads, sets its pace, and it loses to the reordered copy (bench/results/packed_matmuls.md)
PACKED_MAX = 32
# bf16 (opted into, engine/kernels/packed_linear.py): packed codes up to this many rows, oneDNN
# above: past a few rows the kernel's fp32 FMAs, not the bytes it reads, set its pace, and oneDNN's
# bf16 units are faster (bench/results/packed_bf16_epyc.md)
PACKED_MAX_BF16 = 3


def packed_rows(dtype: torch.dtype) -> int:
    """The most rows that multiply against packed codes in `dtype`."""
    return PACKED_MAX_BF16 if dtype == torch.bfloat16 else PACKED_MAX


@dataclass(frozen=True)
class SmallWeights:
    """A weight's copies for the CPU's matmuls; any may be None."""

    packed: PackedWeight | None = None
    reordered: torch.Tensor | None = None
    blocked: BlockedWeight | None = None  # bf16, every row count (engine/kernels/bf16_linear.py)


def reorder(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of weight `w` [out, in], or None where there is none to make."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    except (AttributeError, RuntimeError):
        return None


def small_batch_weights(
    w: torch.Tensor, source: torch.Tensor | None = None, batch_invariant: bool = False
) -> SmallWeights:
    """The copies of `w` that small batches multiply against: its block codes where it is a grid
    and the kernel loads (a bf16 `w`: found in `source`, the fp32 weight it was rounded from), and
    oneDNN's reordered copy where this torch makes one. `batch_invariant`: the blocked bf16 copy
    alone, for every row count (see `batch_invariant_why_not`)."""
    if batch_invariant:
        return SmallWeights(blocked=bf16_linear.block(w, batch_invariant=True))
    packed = None
    if w.device.type == "cpu" and w.dtype == torch.float32 and packed_linear.available():
        packed = packed_linear.pack(w)
    elif w.device.type == "cpu" and source is not None and packed_linear.bf16_available():
        packed = packed_linear.pack_bf16(w, source)
    blocked = bf16_linear.block(w)
    # the blocked copy serves every row count the reordered one would: one copy, not two
    return SmallWeights(packed, None if blocked is not None else reorder(w), blocked)


def batch_invariant_why_not(dtype: torch.dtype) -> str:
    """Why a slice of `dtype` cannot multiply batch-invariantly here, or "". Batch-invariant: a
    row's product does not depend on the other rows of its batch nor on their number, so a token
    gets the same bits in a prefill chunk as in a decode step of any batch. Only the blocked bf16
    kernel promises that (each output is one fp32 sum in k order, engine/kernels/bf16_linear.py);
    oneDNN and MKL pick their kernels and their sums' order by the number of rows, and the packed
    codes multiply in fp32."""
    if dtype != torch.bfloat16:
        return f"it runs in {str(dtype).removeprefix('torch.')}, and only bf16 has the kernel"
    why = bf16_linear.why_not(batch_invariant=True)
    return f"the blocked bf16 matmul kernel is off: {why}" if why else ""


def _onednn_linear(x, small, bias):
    return torch.ops.mkldnn._linear_pointwise(x, small, bias, "none", [], "")


def _packed_linear(x, small, bias):
    y = packed_linear.packed_linear(x, small)
    return y if bias is None else y.add_(bias)


def _small_linear(x: torch.Tensor, small: SmallWeights | None, bias) -> torch.Tensor | None:
    """x @ w.T (+ bias) through the copy that serves a batch of x's rows, or None (plain)."""
    if small is None:
        return None
    rows = x.shape[0]
    if small.packed is not None and rows <= packed_rows(x.dtype):
        return _packed_linear(x, small.packed, bias)
    if small.blocked is not None and x.dtype == torch.bfloat16:
        if spare_core.takes_blocked(x):
            return spare_core.blocked_linear(x, small.blocked, bias)
        y = bf16_linear.linear(x, small.blocked)
        return y if bias is None else y.add_(bias)
    if small.reordered is not None:
        lo, hi = reordered_rows(small.reordered.dtype)
        if lo <= rows <= hi and x.dtype == small.reordered.dtype:
            return _onednn_linear(x, small.reordered, bias)
    return None


def linear(
    x: torch.Tensor, w: torch.Tensor, small: SmallWeights | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ w.T (+ bias): through a copy in `small` when M is a small batch."""
    y = _small_linear(x, small, bias)
    if y is not None:
        return y
    return spare_core.linear(x, w, bias) if spare_core.takes(x, w) else F.linear(x, w, bias)


def add_linear_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, small: SmallWeights | None):
    """h += x @ w.T, in place. On a small path the product is rounded to h's dtype before the
    add (addmm_ may round once): at most a last-bit difference, which shows in bf16."""
    y = _small_linear(x, small, None)
    if y is not None:
        h.add_(y)
    elif spare_core.takes(x, w) and h.is_contiguous() and h.dtype == x.dtype:
        spare_core.add_linear_(h, x, w)
    else:
        h.addmm_(x, w.t())
