"""Weights kept as the block codes they ship in, for decode-sized matmuls on the CPU.

The default model is a quantized GGUF (SmolLM2-135M-Instruct Q4_1: every layer matrix in 4-bit
blocks, the embedding in 8-bit ones). The loader dequantizes it to fp32, and a decode step then
reads 4 bytes per weight from memory, where the file spent about 0.6: at a few rows per matmul that
read, not the arithmetic, is the step's time. This module finds the block codes again in the fp32
weight and keeps them; `engine/kernels/csrc/packed_linear.cpp` multiplies against them, decoding
each column of 16 output rows into a vector register.

Exact, never approximate: a weight is packed only if, for every block of 32 values along a row, an
fp16 scale, an offset and integer codes give back each value bit for bit (code * scale is exact
in fp32, plus the offset rounds once, in the kernel as here). The product
therefore uses the very weights the fp32 matmul uses, and only the order of its fp32 sums differs.
A weight that is not such a grid (fp32 or bf16 checkpoints, the tiny random test models, another
quantization) is left as it is.

Two grids, those of GGML's Q4_1 and Q8_0:
- 4-bit: w = q * d + m, q in [0, 15]; m is the block's minimum, d = (max - m) / 15.
- 8-bit: w = q * d, q in [-127, 127]; d = max |w| / 127.

fp32 weights on the CPU, where the kernels load (engine/kernels/cpu_kernels.py); and, opted into
with `--kernel-packed-bf16`, bf16 weights, packed from the fp32 values they were rounded from
(`pack_bf16`): the kernel rounds each decoded weight to bf16, the very value of the bf16 weight,
before its fp32 FMAs. Off by default: a one-request decode step was faster with it, but the
colocated node served fewer tok/s at concurrency 32 (bench/results/HISTORY.md, "Logits stay in
bf16"), for reasons not found yet. `--no-kernel-packed-weights` turns both off (the switches:
engine/kernels/switches.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kernels import cpu_kernels, switches

BLOCK = 32
PANEL = 16  # output rows whose codes the kernel keeps together, column by column


@dataclass(frozen=True)
class PackedWeight:
    """W [out, in] as block codes, in panels of PANEL output rows stored column by column: uint8
    [out / 16, in / 2, 16] for bits 4 (columns k and k + 1 in a byte's low and high nibble), int8
    [out / 16, in, 16] for bits 8, with fp32 scale and offset [out / 16, in / 32, 16] (offset empty
    for bits 8)."""

    bits: int
    codes: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset))


def available() -> bool:
    """Whether packed matmuls can run in this process. Never raises."""
    return switches.current().packed_weights and cpu_kernels.load()


def bf16_available() -> bool:
    """Whether bf16 batches multiply against packed codes here: opted into and the kernel
    loads. Never raises."""
    return switches.current().packed_bf16 and available()


def why_not() -> str:
    return switches.why_off("packed_weights") or cpu_kernels.why_not()


def _exact(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, v: torch.Tensor) -> bool:
    w = q * d if m is None else q * d + m  # q * d is exact: the sum rounds once, as in the kernel
    return torch.equal(w, v)


def _fp16_exact(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float16).float()


def _panels(t: torch.Tensor) -> torch.Tensor:
    """[out, n] -> [out / PANEL, n, PANEL]: each panel's rows side by side, column by column."""
    return t.reshape(-1, PANEL, t.shape[-1]).transpose(1, 2).contiguous()


def _grid4(v: torch.Tensor) -> PackedWeight | None:
    m = v.amin(-1, keepdim=True)
    d = _fp16_exact((v.amax(-1, keepdim=True) - m) / 15)
    q = torch.where(d > 0, (v - m) / d, 0).round_().clamp_(0, 15)
    if not _exact(q, d, m, v):
        return None
    n = v.shape[0]
    cols = _panels(q.to(torch.uint8).reshape(n, -1))  # [out / 16, in, 16]
    codes = cols[:, 0::2] | (cols[:, 1::2] << 4)  # columns k and k + 1 share a byte
    return PackedWeight(4, codes.contiguous(), _panels(d.reshape(n, -1)), _panels(m.reshape(n, -1)))


def _grid8(v: torch.Tensor) -> PackedWeight | None:
    d = _fp16_exact(v.abs().amax(-1, keepdim=True) / 127)
    q = torch.where(d > 0, v / d, 0).round_().clamp_(-127, 127)
    if not _exact(q, d, None, v):
        return None
    n = v.shape[0]
    codes = _panels(q.to(torch.int8).reshape(n, -1))
    return PackedWeight(8, codes, _panels(d.reshape(n, -1)), torch.empty(0))


def pack(w: torch.Tensor) -> PackedWeight | None:
    """The block codes of fp32 weight `w` [out, in], or None where `w` is not such a grid (or the
    kernel's shapes do not fit it)."""
    if w.device.type != "cpu" or w.dtype != torch.float32 or w.dim() != 2:
        return None
    n, k = w.shape
    if k % BLOCK or n % PANEL or not torch.isfinite(w).all():
        return None
    v = w.detach().reshape(n, k // BLOCK, BLOCK)
    return _grid4(v) or _grid8(v)


def pack_bf16(w: torch.Tensor, source: torch.Tensor) -> PackedWeight | None:
    """The block codes of bf16 weight `w`, found in `source`, the fp32 weight it was rounded from;
    None unless `source` is a grid and rounds to `w` exactly (nearest even, as the kernel rounds
    each decoded weight): the packed product then multiplies by w's own values."""
    if w.dtype != torch.bfloat16 or source.dtype != torch.float32 or w.shape != source.shape:
        return None
    if not torch.equal(source.to(torch.bfloat16), w):
        return None
    return pack(source)


def packed_linear(x: torch.Tensor, pw: PackedWeight) -> torch.Tensor:
    """x [M, in] @ W.T -> [M, out], fp32 or bf16 (`bf16_available()`) in and out. Call
    `available()` first."""
    return torch.ops.pdserve.packed_linear(x.contiguous(), pw.codes, pw.scale, pw.offset, pw.bits)
