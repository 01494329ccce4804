"""The decode-attention kernel (engine/kernels/csrc/paged_attention.cpp) of two revisions, side by
side in one process, alternating, on one core: a change to the kernel is timed against the code
before it.

Each revision's source (`git show REV:...`, or the working tree for `.`) is compiled on its own
with the build's flags (engine/kernels/cpu_kernels.py) under an op namespace of its own, so both
load beside each other; their outputs must agree to the last bit before anything is timed (the
benchmark is for changes that keep the arithmetic), or with `--rounding` to within one bf16 rounding
of each other (a change that sums in another order), and the table says how many differ.

The case is SmolLM2's decode step at `--requests` (32) requests of `--lens LO HI` tokens: 30
layers, 9 query heads on 3 KV heads of 64, pages of 16 tokens scattered over a page-major pool, as
the ranks hold it (bench_decode_attention.py); bf16 by default.

  .venv/bin/python bench/bench_attention_revisions.py [--base HEAD] [--new .] [--lens 300 400]
      [--requests 32] [--reps 11] [--dtype bfloat16] [--rounding] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.bench_decode_attention import HEADS, KV_HEADS, LAYERS, D  # noqa: E402
from bench.bench_decode_attention import case as decode_attention_case  # noqa: E402
from pdserve.engine.kernels import cpu_kernels  # noqa: E402

KERNEL = "pdserve/engine/kernels/csrc/paged_attention.cpp"
HEADERS = (
    "pdserve/engine/kernels/csrc/vec_math.h",
    "pdserve/engine/kernels/csrc/ops.h",
)  # ops.h: revisions since it exists


def source(rev: str, path: str) -> str | None:
    """`path` at `rev`, or None where the revision has no such file."""
    if rev == ".":
        return (ROOT / path).read_text() if (ROOT / path).exists() else None
    out = subprocess.run(["git", "show", f"{rev}:{path}"], cwd=ROOT, capture_output=True, text=True)
    return out.stdout if out.returncode == 0 else None


def build(rev: str, tag: str, workdir: Path):
    """Compiles `rev`'s kernel as op namespace `pdserve_<tag>` and returns its op."""
    ns = f"pdserve_{tag}"
    text = source(rev, KERNEL)
    text = re.sub(r"TORCH_LIBRARY(_IMPL)?\(pdserve,", rf"TORCH_LIBRARY\1({ns},", text)
    d = workdir / tag
    d.mkdir()
    for header in HEADERS:
        if (h := source(rev, header)) is not None:
            (d / Path(header).name).write_text(h.replace("pdserve_ops", f"pdserve_ops_{tag}"))
    (d / "paged_attention.cpp").write_text(text.replace("pdserve_ops", f"pdserve_ops_{tag}"))
    cpp_extension.load(
        name=ns,
        sources=[str(d / "paged_attention.cpp")],
        extra_cflags=cpu_kernels.CFLAGS,
        extra_ldflags=cpu_kernels.LDFLAGS,
        build_directory=str(d),
        is_python_module=False,
    )
    return getattr(torch.ops, ns).paged_decode_attention


def case(lo: int, hi: int, dtype: torch.dtype, requests: int):
    pool, table, lens = decode_attention_case(0, lo, hi, dtype, requests)
    return torch.randn(requests, HEADS, D).to(dtype), pool, table, lens


def step_ms(op, q, pool, table, lens) -> float:
    t0 = time.perf_counter()
    for layer in range(LAYERS):
        op(q, pool[:, layer], table, lens, D**-0.5)
    return (time.perf_counter() - t0) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="HEAD", help="git revision, or . for the working tree")
    ap.add_argument("--new", default=".", help="git revision, or . for the working tree")
    ap.add_argument("--lens", type=int, nargs=2, action="append", metavar=("LO", "HI"))
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--reps", type=int, default=11)
    ap.add_argument(
        "--rounding", action="store_true", help="outputs may differ by one bf16 rounding"
    )
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        ops = {tag: build(getattr(args, tag), tag, Path(tmp)) for tag in ("base", "new")}
        rows, differ = [], []
        for lo, hi in args.lens or [[300, 400], [800, 900]]:
            q, pool, table, lens = case(lo, hi, dtype, args.requests)
            a, b = (ops[k](q, pool[:, 0], table, lens, D**-0.5) for k in ("base", "new"))
            a, b = a.float(), b.float()
            # one bf16 rounding: at most 2^-7 of the value (an ulp is 2^-8 to 2^-7 of it)
            far = (a - b).abs() > 2**-7 * a.abs()
            if (not args.rounding and not torch.equal(a, b)) or bool(far.any()):
                print(f"the revisions' outputs differ at {lo}-{hi} tokens: not a timing question")
                return 1
            differ.append(f"{int((a != b).sum())} of {a.numel()}")
            times = {k: [] for k in ops}
            for _ in range(args.reps):  # alternating, so a machine that slows slows both
                for k, op in ops.items():
                    times[k].append(step_ms(op, q, pool, table, lens))
            base, new = (statistics.median(times[k]) for k in ("base", "new"))
            mb = int(lens.sum()) * LAYERS * KV_HEADS * D * 2 * pool.element_size() / 1e6
            rows.append(
                f"| {lo}-{hi} | {mb:.0f} | {base:.1f} | {new:.1f} | {new / base:.2f}x | "
                f"{mb / new:.1f} |"
            )
    text = "\n".join(
        [
            f"# Decode attention: {args.new} against {args.base}",
            "",
            f"Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}, "
            f"1 thread, {args.dtype}. {args.requests} requests, {LAYERS} layers, 9 query heads on "
            f"3 KV heads of 64, pages of 16 scattered over the pool; median ms per decode step's "
            f"attention (all layers) of {args.reps}, alternating. Outputs that differ (by one "
            f"bf16 rounding at most): {', '.join(differ)}.",
            "",
            f"| tokens per request | MB of KV per step | {args.base} ms | {args.new} ms | "
            "new / base | new's GB/s |",
            "|---|---:|---:|---:|---:|---:|",
            *rows,
            "",
            f"Command: `.venv/bin/python bench/bench_attention_revisions.py --base {args.base} "
            f"--new {args.new} --requests {args.requests}{' --rounding' * args.rounding}`",
            "",
        ]
    )
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
