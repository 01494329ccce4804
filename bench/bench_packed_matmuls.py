"""All the layer matmuls of SmolLM2-135M-Instruct at decode-sized batches: packed block codes
(engine/kernels/packed_linear.py) against oneDNN-reordered fp32 weights (engine/model/linear.py),
one thread.

Each weight is streamed from memory as in a decode step (the 30 layers' 120 matrices do not fit
in the caches). Per batch size M: three repetitions, alternating, best of each; PACKED_MAX in
engine/model/linear.py is set from this table.

  .venv/bin/python bench/bench_packed_matmuls.py [--rows 1 4 8 16 24 32 48 64]
      [--out bench/results/packed_matmuls.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.kernels.packed_linear import PackedWeight  # noqa: E402
from pdserve.engine.model import linear as lin  # noqa: E402
from pdserve.engine.model.loader import load_slice  # noqa: E402

NAMES = ("qkv", "o", "gate_up", "down")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 24, 32, 48, 64])
    ap.add_argument("--out", default=str(ROOT / "bench/results/packed_matmuls.md"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_slice(None, 0, 30)
    model.add_small_batch_weights()
    weights = []
    for layer in model.layers:
        for n in NAMES:
            w = getattr(layer, f"{n}_weight")
            small = layer.small[n]
            assert isinstance(small.packed, PackedWeight), "the kernels did not load"
            weights.append((w.shape[1], {"packed": small.packed, "reordered": small.reordered}))
    rows = []
    for m in args.rows:
        xs = {k: torch.randn(m, k) for k, _ in weights}
        best = {"reordered": float("inf"), "packed": float("inf")}
        for _ in range(3):
            for kind in best:
                t = time.perf_counter()
                op = lin._packed_linear if kind == "packed" else lin._onednn_linear
                for k, small in weights:
                    op(xs[k], small[kind], None)
                best[kind] = min(best[kind], time.perf_counter() - t)
        rows.append((m, best["reordered"] * 1e3, best["packed"] * 1e3))
        print(f"M={m}: reordered {rows[-1][1]:.1f} ms, packed {rows[-1][2]:.1f} ms", flush=True)
    lines = [
        "# SmolLM2's layer matmuls: packed block codes vs oneDNN-reordered fp32",
        "",
        f"`bench/bench_packed_matmuls.py`, {platform.processor() or platform.machine()}, "
        f"one thread, torch {torch.__version__}: the 120 layer matrices once each, best of 3 "
        "alternating.",
        "",
        "| rows | reordered, ms | packed, ms | packed / reordered |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {m} | {r:.1f} | {p:.1f} | {p / r:.2f}x |" for m, r, p in rows]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
