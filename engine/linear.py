"""The model's matmuls against a weight in two layouts: the plain [out, in] tensor, and a copy that
oneDNN reordered into its blocked layout, used for batches of SMALL_MIN..SMALL_MAX rows.

Decode batches are small (one row per running request), and there MKL's sgemm on a plain [out, in]
weight is slow: on one Ice Lake core, SmolLM2's four layer matmuls through oneDNN on a reordered
copy took 0.45–0.96x the time of the plain ones at 4 to 128 rows, over two runs
(`bench/bench_linear.py`, bench/results/linear.md). At 1 to 3 rows the copy is slower (1.09–1.22x),
and from 256 rows on (prefill chunks) it gains nothing (0.97–1.18x), so those keep the plain
weight. The copy costs the memory of the weights once more; `EngineConfig.small_batch_weights`
(`--no-small-batch-weights`) turns it off.

Only on the CPU, and only where this torch has oneDNN's linear ops: elsewhere `reorder` returns
None and every matmul takes the plain path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

SMALL_MIN, SMALL_MAX = 4, 128


def reorder(w: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of weight `w` [out, in], or None where there is none to make."""
    if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(w.detach())
    except (AttributeError, RuntimeError):
        return None


def _small(x: torch.Tensor, small: torch.Tensor | None) -> bool:
    return small is not None and SMALL_MIN <= x.shape[0] <= SMALL_MAX


def _onednn_linear(x, small, bias):
    return torch.ops.mkldnn._linear_pointwise(x, small, bias, "none", [], "")


def linear(
    x: torch.Tensor, w: torch.Tensor, small: torch.Tensor | None, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ w.T (+ bias): through `small` (w reordered) when M is a small batch."""
    if _small(x, small):
        return _onednn_linear(x, small, bias)
    return F.linear(x, w, bias)


def add_linear_(h: torch.Tensor, x: torch.Tensor, w: torch.Tensor, small: torch.Tensor | None):
    """h += x @ w.T, in place. On the small path the product is rounded to h's dtype before the
    add (addmm_ may round once): at most a last-bit difference, which shows in bf16."""
    if _small(x, small):
        h.add_(_onednn_linear(x, small, None))
    else:
        h.addmm_(x, w.t())
