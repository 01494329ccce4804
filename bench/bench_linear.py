"""The model's matmuls at each batch size, plain weights against the small-batch copy
(engine/model/linear.py), on one core: what `reordered_rows` rests on.

The four layer matmuls of SmolLM2-135M (QKV, O, gate/up, down; shapes from the default model's
config) for every layer, so the weights come from memory as in a forward, not from cache.

  .venv/bin/python bench/bench_linear.py [--threads 1] [--dtype float32]
      [--out bench/results/linear.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.model import linear as lin  # noqa: E402
from pdserve.engine.model.loader import load_model_config, resolve_model  # noqa: E402

ROWS = (1, 2, 3, 4, 6, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048)


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def best_of(f, reps: int = 5) -> float:
    f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--out", default=str(ROOT / "bench/results/linear.md"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    cfg = load_model_config(resolve_model(None))
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes = [(cfg.q_size + 2 * cfg.kv_size, h), (h, cfg.q_size), (2 * i, h), (h, i)]
    layers = [[torch.randn(n, k, dtype=dtype) for n, k in shapes] for _ in range(cfg.num_layers)]
    small = [[lin.reorder(w) for w in ws] for ws in layers]
    rows = []
    for m in ROWS:
        xs = {k: torch.randn(m, k, dtype=dtype) for _, k in shapes}
        plain = best_of(lambda xs=xs: [F.linear(xs[w.shape[1]], w) for ws in layers for w in ws])
        onednn = best_of(
            lambda xs=xs: [
                lin._onednn_linear(xs[w.shape[1]], s, None)
                for ws, ss in zip(layers, small, strict=True)
                for w, s in zip(ws, ss, strict=True)
            ]
        )
        # the default model's weights pack (engine/kernels/packed_linear.py):
        # bench_packed_matmuls.py
        lo, hi = lin.reordered_rows(dtype)
        used = "reordered" if lo <= m <= hi else "plain"
        used = "packed" if m <= lin.PACKED_MAX and dtype == torch.float32 else used
        rows.append((m, plain, onednn, used))
        print(
            f"rows {m:4d}: plain {plain * 1e3:7.1f} ms  reordered {onednn * 1e3:7.1f} ms  "
            f"ratio {onednn / plain:.2f}  ({used})",
            flush=True,
        )
    nbytes = sum(w.numel() * w.element_size() for ws in layers for w in ws)
    lines = [
        "# Layer matmuls: plain weights vs the small-batch copy (engine/model/linear.py)",
        "",
        f"Machine: {cpu_name()}, torch {torch.__version__}, "
        f"{args.threads} thread(s), {args.dtype}. All {cfg.num_layers} layers' QKV, O, gate/up "
        f"and down matmuls of the default model ({nbytes / 1e6:.0f} MB of weights), best of 5.",
        "",
        "| rows | plain ms | reordered ms | reordered / plain | the model uses |",
        "|---:|---:|---:|---:|---|",
        *(f"| {m} | {p * 1e3:.1f} | {o * 1e3:.1f} | {o / p:.2f} | {u} |" for m, p, o, u in rows),
        "",
        "Command: `.venv/bin/python bench/bench_linear.py "
        f"--threads {args.threads} --dtype {args.dtype}`",
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
