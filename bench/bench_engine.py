"""Offline engine throughput on SmolLM2-135M-Instruct vs transformers,
and our fraction of the roofline.

Workload: `--requests` seeded prompts of random token ids (lengths uniform in [32, 256]),
`--max-tokens` output tokens each, greedy, ignore_eos.
  ours:          Engine.generate on all requests as one continuous batch, `--threads` torch threads,
                 `--dtype`;
  transformers:  AutoModelForCausalLM (dequantized from the same GGUF, cast to `--dtype`)
                 `generate` one request at a time on a seeded subset of `--hf-requests` of the
                 same requests (the full set would take ~10 minutes); rates, not totals, are
                 compared;
  roofline:      (prompt + output tokens) x 2 x (parameters touched per token) / s, over the FLOP/s
                 of a 2048x2048 @ 2048x2048 matmul in the same dtype, with the same threads
                 (best of several).
Parameters touched per token: every decoder-layer weight for every token, plus the tied lm_head for
each sampled token (prefill computes logits only at the last prompt position). Attention score FLOPs
are not counted (they would only raise our number).

  .venv/bin/python bench/bench_engine.py [--requests 64] [--max-tokens 128] [--hf-requests 8]
      [--dtype float32|bfloat16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("TQDM_DISABLE", "1")
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.model.loader import resolve_model  # noqa: E402

THREADS = 2
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16"}


def make_prompts(n: int, seed: int = 0, lo: int = 32, hi: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 49000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def matmul_flops(dtype: torch.dtype, n: int = 2048, reps: int = 6) -> float:
    a, b = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def param_counts(eng: Engine) -> tuple[int, int]:
    """(parameters of the decoder layers + final norm, parameters of the (tied) embedding /
    lm_head)."""
    model = eng.runner.model
    seen, total, embed = set(), 0, 0
    for name, p in model.named_parameters():
        if p.data_ptr() in seen:
            continue
        seen.add(p.data_ptr())
        if "embed" in name or "lm_head" in name:
            embed += p.numel()
        else:
            total += p.numel()
    if embed == 0:  # a model that keeps the embedding outside named_parameters
        mc = eng.model_config
        embed = mc.vocab_size * mc.hidden_size
    return total, embed


def hf_run(
    path: Path, prompts: list[list[int]], max_new: int, dtype: torch.dtype
) -> tuple[float, list[list[int]], float]:
    from transformers import AutoModelForCausalLM

    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    model = model.to(dtype)  # dequantized in fp32, then cast as the engine's loader casts
    load_s = time.perf_counter() - t
    outs = []
    with torch.inference_mode():
        x = torch.tensor([prompts[0][:16]])
        model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=4,
            min_new_tokens=4,
            do_sample=False,
        )
        t = time.perf_counter()
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                do_sample=False,
                pad_token_id=0,
            )
            outs.append(y[0, len(ids) :].tolist())
        dt = time.perf_counter() - t
    del model
    return dt, outs, load_s


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument(
        "--hf-requests", type=int, default=8, help="seeded subset run through transformers"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--out", default=str(ROOT / "bench/results/engine.md"))
    args = ap.parse_args()
    threads, dt, dname = args.threads, getattr(torch, args.dtype), DTYPE_NAMES[args.dtype]
    torch.set_num_threads(threads)
    load0 = os.getloadavg()

    prompts = make_prompts(args.requests, args.seed)
    n_prompt = sum(map(len, prompts))
    print(
        f"{args.requests} requests, {n_prompt} prompt tokens, {args.max_tokens} output tokens each",
        flush=True,
    )

    flops = max(matmul_flops(dt) for _ in range(2))
    print(f"{dname} matmul 2048^3, {threads} threads: {flops / 1e9:.1f} GFLOP/s", flush=True)

    eng = Engine(EngineConfig(model=None, threads=threads, dtype=args.dtype))
    torch.set_num_threads(threads)
    layer_p, embed_p = param_counts(eng)
    sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
    eng.generate([prompts[0][:16]], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t = time.perf_counter()
    outs = eng.generate(prompts, sp)
    ours_s = time.perf_counter() - t
    n_out = sum(len(o.token_ids) for o in outs)
    ours_rate = n_out / ours_s
    flop = 2 * (layer_p * (n_prompt + n_out) + embed_p * n_out)
    roof = flop / ours_s / flops
    print(
        f"ours: {n_out} tokens in {ours_s:.1f} s = {ours_rate:.1f} tok/s, roofline {roof:.1%}",
        flush=True,
    )
    load_mid = os.getloadavg()
    if args.hf_requests <= 0:  # the engine's line only: no transformers run, no table
        return 0

    path = resolve_model(None)
    rng = random.Random(args.seed + 1)
    idx = sorted(rng.sample(range(args.requests), min(args.hf_requests, args.requests)))
    sub = [prompts[i] for i in idx]
    del eng
    hf_s, hf_outs, hf_load = hf_run(path, sub, args.max_tokens, dt)
    hf_out = sum(map(len, hf_outs))
    hf_rate = hf_out / hf_s
    same = sum(a == outs[i].token_ids for a, i in zip(hf_outs, idx, strict=True))
    first_diff = []
    for a, i in zip(hf_outs, idx, strict=True):
        b = outs[i].token_ids
        if a != b:
            first_diff.append(
                next(
                    (k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                    min(len(a), len(b)),
                )
            )
    print(
        f"transformers: {hf_out} tokens ({len(sub)} requests) in {hf_s:.1f} s = {hf_rate:.1f} "
        f"tok/s; token-identical {same}/{len(sub)}",
        flush=True,
    )
    load1 = os.getloadavg()

    speedup = ours_rate / hf_rate
    hf_roof = 2 * (layer_p * (sum(map(len, sub)) + hf_out) + embed_p * hf_out) / hf_s / flops
    rows = [
        (
            f"ours: Engine.generate, 1 continuous batch, {dname}, {threads} threads",
            args.requests,
            n_out,
            f"{ours_s:.1f}",
            f"{ours_rate:.1f}",
            f"{roof:.1%}",
        ),
        (
            f"transformers generate, 1 request at a time, {dname}, {threads} threads",
            len(sub),
            hf_out,
            f"{hf_s:.1f}",
            f"{hf_rate:.1f}",
            f"{hf_roof:.1%}",
        ),
    ]
    table = [
        "| run | requests | output tokens | seconds | output tok/s | roofline fraction |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    table += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    ok_speed, ok_roof = speedup >= 2.5, roof >= 0.5
    text = "\n".join(
        [
            "# Offline engine throughput (SmolLM2-135M-Instruct)",
            "",
            f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), "
            f"Python {platform.python_version()}, torch {torch.__version__}; "
            "shared with other jobs. Load average (1/5/15 min) at start "
            f"{load0[0]:.2f}/{load0[1]:.2f}/{load0[2]:.2f}, after our run "
            f"{load_mid[0]:.2f}/{load_mid[1]:.2f}/{load_mid[2]:.2f}, "
            f"at the end {load1[0]:.2f}/{load1[1]:.2f}/{load1[2]:.2f}.",
            "",
            f"Workload: {args.requests} requests, prompts of seeded random token ids, "
            f"lengths uniform in [32, 256] ({n_prompt} prompt tokens, "
            f"mean {n_prompt / args.requests:.0f}), {args.max_tokens} output tokens each, greedy, "
            f"ignore_eos. Served dtype: **{dname}**. torch threads = {threads} for both.",
            "",
            f"transformers ran a seeded subset of {len(sub)} of the {args.requests} requests "
            f"(indices {idx}), one at a time, because the full set would take "
            f"~{args.requests * args.max_tokens / hf_rate / 60:.0f} min at its rate; "
            f"its rate is extrapolated to the full set. Model load: {hf_load:.0f} s (not timed). "
            f"Its outputs vs ours on those requests: token-identical {same}/{len(sub)}"
            + (f" (first differing positions {first_diff})" if first_diff else "")
            + ".",
            "",
            *table,
            "",
            f"Roofline: FLOPs = 2 x ({layer_p / 1e6:.1f}M decoder-layer parameters x (prompt + "
            f"output tokens) + {embed_p / 1e6:.1f}M lm_head parameters x output tokens) = "
            f"{flop / 1e12:.2f} TFLOP, over the measured {dname} matmul peak {flops / 1e9:.1f} "
            f"GFLOP/s (2048x2048 @ 2048x2048, {threads} threads, best of 6). "
            "Attention score FLOPs are not counted.",
            "",
            f"- speed-up over transformers: **{speedup:.2f}x** (target >= 2.5x: "
            f"{'met' if ok_speed else 'NOT met'})",
            f"- fraction of roofline: **{roof:.1%}** (target >= 50%: "
            f"{'met' if ok_roof else 'NOT met'})",
            "",
            f"Command: `.venv/bin/python bench/bench_engine.py --requests {args.requests} "
            f"--max-tokens {args.max_tokens} --hf-requests {args.hf_requests} "
            f"--dtype {args.dtype} --threads {threads}`",
            "",
        ]
    )
    print("\n".join(table))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
