"""RMSNorm, SiLU(gate) * up, and rotary embedding with the store of the new keys and values into
the KV pool, in one call each on the CPU: the C++ kernels in `engine/kernels/csrc/layer_ops.cpp`
(built with the other CPU kernels, engine/kernels/cpu_kernels.py).

Through torch each is several dispatched ops, and at decode sizes the dispatches cost more than
the arithmetic (about a tenth of a small decode step on one core). Other devices, other dtypes and
layouts the kernels do not take run the torch ops, as does a process where the kernels are off:
`--no-kernel-layer-ops` (engine/kernels/switches.py), or a library that could not be built
(engine/kernels/cpu_kernels.py says why).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pdserve.engine.kernels import cpu_kernels, switches

_DTYPES = (torch.float32, torch.bfloat16)
MAX_HEAD_DIM = 512  # the rotary kernel's bound (layer_ops.cpp)
_on: bool | None = None  # decided at the first op, again after the switches change


def load() -> bool:
    """Whether the kernels are on in this process (once per set of switches; never raises)."""
    global _on
    if _on is None:
        _on = switches.current().layer_ops and cpu_kernels.load()
    return _on


def why_not() -> str:
    """Why the kernels are off in this process, or "" where they are on."""
    if load():
        return ""
    return switches.why_off("layer_ops") or cpu_kernels.why_not()


@switches.on_change
def _forget() -> None:
    global _on
    _on = None


def _takes(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dim() == 2 and x.stride(1) == 1 and x.dtype in _DTYPES


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x / sqrt(mean(x^2, -1) + eps) * w over the last dim of x. With x in the dtype it is kept in
    and the normalised x rounded to that dtype before the product (Llama's norm in transformers);
    with an fp32 `w` and a narrower x, all in fp32 and one rounding at the end (Gemma's)."""
    if w.dtype == torch.float32 and x.dtype != torch.float32:
        xf = x.float()  # transformers' Gemma3RMSNorm, op for op
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)
    if _takes(x) and w.dtype == x.dtype and w.dim() == 1 and w.is_contiguous() and load():
        return torch.ops.pdserve.rms_norm(x, w, eps)
    return F.rms_norm(x, (x.shape[-1],), w, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] along the last dim."""
    if _takes(gate_up) and load():
        return torch.ops.pdserve.silu_mul(gate_up)
    inter = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :inter]).mul_(gate_up[..., inter:])


def rope_store_kv_(
    qkv: torch.Tensor,
    rope: tuple[torch.Tensor, torch.Tensor],
    kv: torch.Tensor,
    pages: torch.Tensor,
    offs: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
) -> bool:
    """Rotates the query and key heads of `qkv` [T, (heads + 2 kv_heads) * head_dim] in place with
    `rope` (cos, sin [T, 1, head_dim]) and copies each token's keys and values into `kv` (a layer's
    pool view [pages, 2, page_size, kv_heads, head_dim]) at (pages[t], offs[t]). Returns False,
    having done nothing, where the kernel does not take these tensors (the caller runs torch)."""
    cos, sin = rope
    ok = (
        _takes(qkv)
        and kv.device.type == "cpu"
        and qkv.dtype == kv.dtype == cos.dtype == sin.dtype
        and kv.shape[-1] <= MAX_HEAD_DIM
        and kv.shape[-1] % 2 == 0
        and all(i.dtype == torch.long and i.is_contiguous() for i in (pages, offs))
        and load()
    )
    if ok:
        torch.ops.pdserve.rope_store_kv_(qkv, cos, sin, kv, pages, offs, num_heads, num_kv_heads)
    return ok
