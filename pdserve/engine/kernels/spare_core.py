"""Prefill matmuls shared with a helper thread on a spare core (the C++ op in
`engine/kernels/csrc/spare_core.cpp`, built with the other CPU kernels).

A rank computes on one core of its own. The plan's I/O core (the colocated node's second core on
a 2-core host: fronts, router, client) is idle part of the time: all of it between requests at
concurrency 1, less under load. OpenMP threads there fall off a cliff when that core is busy
(runtime/placement.py). Instead, a prefill-sized product is split into blocks of rows; the rank's
thread takes blocks from the front, a helper thread pinned to the spare cores at nice 19 (the I/O
processes keep their core) from the back, and the rank never waits for a block the helper cannot
finish in about the time the rank would take: it computes that block itself.

Both threads compute a block with the same call, so the product does not depend on who computed
which block. It does differ in the last bits from one unsplit matmul (MKL's sums over other
blocks), and the split of M rows is fixed by M alone.

In bf16 the blocks go through the blocked VDPBF16PS kernel (engine/kernels/bf16_linear.py), whose
output rows do not depend on the rows beside them: there the split product has the bits of the
unsplit one, so the grid is finer (blocks of 64 rows, the rank's thread taking runs of up to 4 in
one call): a helper that gets only part of the I/O core then loses at most a small block when the
rank takes its block back.

On for ranks with one compute thread on the CPU, in fp32, and in bf16 where the blocked kernel
serves, where the launcher names spare cores (`EngineConfig.spare_cores`; the nodes name the core
plan's I/O cores, runtime/serve.py); `--no-kernel-spare-core` turns it off
(engine/kernels/switches.py), and a process whose switches turn it off after it started offers it
no more products.
"""

from __future__ import annotations

import torch

from pdserve.engine.kernels import bf16_linear, cpu_kernels, switches

MIN_ROWS = 512  # smaller products: one MKL call (a split below 2 x 256 rows costs; spare_core.md)
BLOCK_ROWS = 256  # MKL loses next to nothing to a split into blocks of this many rows
MAX_BLOCKS = 16
BF16_BLOCK_ROWS = 64  # the blocked kernel at 64 rows: near its rate at 2048 (bench/results/)
BF16_MAX_BLOCKS = 256
NICE = 19

_cores: tuple[int, ...] = ()


def start(cores, threads: int, dtype: torch.dtype, *, blocked: int) -> str:
    """Starts the helper on `cores` (once per process) where it applies; returns what it did, for
    the rank's ready line, or "" where there is nothing to say (no spare core). `blocked`: how many
    of the rank's matmuls have a blocked bf16 copy (a bf16 product shares only on those)."""
    global _cores
    cores = tuple(sorted(cores))
    if not cores:
        return ""
    why = switches.why_off("spare_core")
    if not why and threads != 1:
        why = f"{threads} compute threads"
    if not why and dtype not in (torch.float32, torch.bfloat16):
        why = f"dtype {dtype}"
    if not why and dtype == torch.bfloat16 and not bf16_linear.available():
        why = f"bf16 without the blocked kernel: {bf16_linear.why_not()}"
    if not why and dtype == torch.bfloat16 and not blocked:
        why = "bf16 without blocked weights"
    if not why and not cpu_kernels.load():
        why = cpu_kernels.why_not()
    if why:
        return f"no prefill helper ({why})"
    if not torch.ops.pdserve.spare_core_start(list(cores), NICE):
        return f"no prefill helper (its thread could not be pinned to {cores} at nice {NICE})"
    _cores = cores
    word = "core" if len(cores) == 1 else "cores"
    return f"prefill matmuls shared with a helper on spare {word} {','.join(map(str, cores))}"


@switches.on_change
def _forget() -> None:
    """Switched off after it started: the helper thread stays (it cannot be stopped) but idles."""
    global _cores
    if not switches.current().spare_core:
        _cores = ()


def active() -> bool:
    return bool(_cores)


def blocks(rows: int) -> int:
    return max(2, min(MAX_BLOCKS, rows // BLOCK_ROWS))


def bf16_blocks(rows: int) -> int:
    return max(2, min(BF16_MAX_BLOCKS, rows // BF16_BLOCK_ROWS))


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the product x @ w.T goes through the helper."""
    return (
        bool(_cores)
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype == w.dtype == torch.float32
        and x.device.type == w.device.type == "cpu"
        and x.is_contiguous()
    )


def takes_blocked(x: torch.Tensor) -> bool:
    """Whether the product of bf16 rows `x` with a blocked weight goes through the helper."""
    return (
        bool(_cores)
        and x.dim() == 2
        and x.shape[0] >= MIN_ROWS
        and x.dtype == torch.bfloat16
        and x.device.type == "cpu"
        and x.is_contiguous()
    )


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.pdserve.spare_core_linear(x, w, bias, blocks(x.shape[0]))


def blocked_linear(x: torch.Tensor, bw, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ w.T (+ bias) for `bw`, w's engine.bf16_linear.BlockedWeight."""
    return torch.ops.pdserve.spare_core_bf16_linear(
        x, bw.blocks, bw.out_features, bias, bf16_blocks(x.shape[0])
    )


def add_linear_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    torch.ops.pdserve.spare_core_add_linear_(h, x, w, blocks(x.shape[0]))


def counts() -> dict[str, int]:
    """Blocks computed so far: by the rank's thread, by the helper, and taken back from it."""
    rank, helper, taken_back = torch.ops.pdserve.spare_core_counts()
    return {"rank": rank, "helper": helper, "taken_back": taken_back}
