"""bf16 matmuls on a weight blocked for the CPU's bf16 dot products, with the next block of the
weight prefetched while the current one is multiplied (`engine/kernels/csrc/bf16_linear.cpp`).

A decode step streams every weight from memory; oneDNN's bf16 matmul on its reordered copy waits
for each as it arrives. This copy serves every row count of a bf16 slice on a CPU with AVX-512
BF16 and no AMX: faster than oneDNN at decode sizes and as fast at prefill sizes
(`bench/bench_bf16_linear.py`, bench/results/bf16_linear_epyc.md), and one copy costs what the
reordered one did, which it replaces. Outputs differ from oneDNN's in the last bit of a few values
(the order of fp32 sums). Off with `--no-kernel-bf16-linear` (engine/kernels/switches.py); other
CPUs, dtypes and devices keep oneDNN's copy or the plain weight.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.engine.kernels import cpu_kernels, switches


@dataclass(frozen=True)
class BlockedWeight:
    """W [out, in] in blocks of 32 output columns, pairs along `in` (the kernel's layout)."""

    blocks: torch.Tensor  # bf16 [ceil(out / 32), in / 2, 32, 2]
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()


def why_not(batch_invariant: bool = False) -> str:
    """Why bf16 matmuls do not take the blocked kernel here, or "" where they do. Never raises.
    `batch_invariant`: take it on an AMX CPU too, where oneDNN is the faster choice, because its
    rows do not depend on the rows beside them (engine/model/linear.py)."""
    off = switches.why_off("bf16_linear") or cpu_kernels.why_not()
    if off or not cpu_kernels.load():
        return off or "the CPU kernels did not load"
    if not torch.ops.pdserve.bf16_linear_supported():
        return "the kernels were built without AVX-512 BF16"
    if "amx_bf16" in cpu_kernels.cpu_flags().split() and not batch_invariant:
        # oneDNN's bf16 matmuls run on AMX there; this kernel was not measured against them
        return "this CPU has AMX, which oneDNN's bf16 matmuls use"
    return ""


def available(batch_invariant: bool = False) -> bool:
    return not why_not(batch_invariant)


def block(w: torch.Tensor, batch_invariant: bool = False) -> BlockedWeight | None:
    """The blocked copy of bf16 weight `w` [out, in] on the CPU, or None where the kernel cannot
    take it (another dtype or device, an odd `in`, the kernel off or missing)."""
    if w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 or w.shape[1] % 2:
        return None
    if not available(batch_invariant):
        return None
    return BlockedWeight(torch.ops.pdserve.pack_bf16_linear(w.detach()), w.shape[0])


def linear(x: torch.Tensor, bw: BlockedWeight) -> torch.Tensor:
    """x [M, in] bf16 @ W.T -> [M, out] bf16."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return torch.ops.pdserve.bf16_linear(x, bw.blocks, bw.out_features)
