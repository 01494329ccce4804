"""All the matmuls of one SmolLM2-135M forward in bf16 (30 layers x QKV, O, gate/up, down, and the
LM head) at a given number of rows: the blocked kernel (engine/kernels/bf16_linear.py) against
oneDNN's reordered copy (engine/model/linear.py), in one process, alternating.

Each of the 121 weights is a tensor of its own, 269 MB in all, so every call streams its weight
from memory as a decode step does (the last-level cache holds 32 MB on the EPYC this was written
on). Weights are random: the kernels' time does not depend on the values. Per row count, `--reps`
alternating repetitions, best of each.

  .venv/bin/python bench/bench_bf16_linear.py [--rows 1 8 32 64 128 512 2048] [--threads 1]
      [--reps 4] [--out bench/results/bf16_linear.md]
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

from pdserve.engine.kernels import bf16_linear  # noqa: E402
from pdserve.engine.model.linear import reorder  # noqa: E402

LAYERS = 30
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in): QKV, O, gate/up, down
HEAD = (49152, 576)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32, 64, 128, 512, 2048])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "bench/results/bf16_linear.md"))
    args = ap.parse_args()
    why = bf16_linear.why_not()
    if why:
        sys.exit(f"the blocked kernel is off here: {why}")
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS + [HEAD]
    weights = [(torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16) for n, k in shapes]
    kinds = {
        "oneDNN": [(reorder(w), w.shape[1]) for w in weights],
        "blocked": [(bf16_linear.block(w), w.shape[1]) for w in weights],
    }

    def run(kind: str, xs: dict[int, torch.Tensor]) -> float:
        t = time.perf_counter()
        for copy, k in kinds[kind]:
            if kind == "blocked":
                bf16_linear.linear(xs[k], copy)
            else:
                torch.ops.mkldnn._linear_pointwise(xs[k], copy, None, "none", [], "")
        return time.perf_counter() - t

    rows = []
    flop_per_row = 2 * sum(n * k for n, k in shapes)
    for m in args.rows:
        xs = {k: torch.randn(m, k, generator=g).to(torch.bfloat16) for k in (576, 1536)}
        best = dict.fromkeys(kinds, float("inf"))
        for _ in range(args.reps):
            for kind in kinds:
                best[kind] = min(best[kind], run(kind, xs))
        rows.append((m, best["oneDNN"], best["blocked"]))
        a, b = best["oneDNN"], best["blocked"]
        print(
            f"rows {m}: oneDNN {a * 1e3:.1f} ms, blocked {b * 1e3:.1f} ms ({b / a:.2f}x)",
            flush=True,
        )
    lines = [
        "# One forward's bf16 matmuls: the blocked kernel against oneDNN's reordered copy",
        "",
        f"`bench/bench_bf16_linear.py`, {platform.processor() or platform.machine()}, "
        f"{args.threads} thread(s), torch {torch.__version__}: SmolLM2-135M's 121 weights (269 MB, "
        f"streamed from memory), best of {args.reps} alternating repetitions.",
        "",
        "| rows | oneDNN, ms | GFLOP/s | blocked, ms | GFLOP/s | blocked / oneDNN |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for m, a, b in rows:
        f = flop_per_row * m / 1e9
        lines.append(
            f"| {m} | {a * 1e3:.1f} | {f / a:.0f} | {b * 1e3:.1f} | {f / b:.0f} | {b / a:.2f}x |"
        )
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
