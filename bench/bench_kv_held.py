"""KV held per request by Gemma 3 270M, with and without the windowed pool (`--windowed-kv`).

The offline engine (the scheduler and pool a colocated node's ranks run) serves one request per
prompt length, in the served dtype (bf16 where the CPU has bf16 units), prefix cache off. After
every step it reads the pages the request holds, in each pool, and multiplies them by the bytes of
a page there: the most over the request is its KV held. Without the window logic a page holds all
18 layers; with it, the full pool's page holds the 3 full-attention layers and the sliding pool's
the 15 sliding ones, of which a request keeps only what its window still reads. Both engines must
answer with the same tokens: a check that the pool changed no output.

  .venv/bin/python bench/bench_kv_held.py [--lengths 512,2048,4096,8192] [--out FILE.md]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_agreement import CORPUS  # noqa: E402

from pdserve.engine.config import EngineConfig  # noqa: E402
from pdserve.engine.core import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine  # noqa: E402
from pdserve.engine.window_pages import windowed_pool_pages  # noqa: E402

MIB = 1 << 20
OUTPUT = 16


def prompt_of(eng: Engine, n: int) -> list[int]:
    ids: list[int] = []
    text = CORPUS.read_text()  # aiperf's corpus, as the side-by-side prompts
    while len(ids) < n:
        ids += eng.encode(text[len(ids) * 4 :][: 8 * n])
    return ids[:n]


def held(eng: Engine, n: int) -> tuple[int, int, list[int], float]:
    """(most bytes the request held, bytes it held at its last decode step, its tokens, seconds)
    for a prompt of `n` tokens."""
    full_page, sliding_page = eng.runner.pool.held_bytes_per_page
    rid = eng.add_request(prompt_of(eng, n), SamplingParams(max_tokens=OUTPUT, ignore_eos=True))
    req = eng.scheduler.reqs[rid]
    most = last = 0
    t0 = time.perf_counter()
    while eng.scheduler.has_work:
        eng.step()
        if not req.finished:  # (a finished request has given its pages back)
            last = len(req.pages) * full_page + len(req.sliding_pages) * sliding_page
            most = max(most, last)
    return most, last, eng._done.pop(rid).output_ids, time.perf_counter() - t0


def pool_bytes(eng: Engine) -> int:
    pool = eng.runner.pool
    sliding = pool.sliding_kv
    return pool.nbytes + (sliding.numel() * sliding.element_size() if sliding is not None else 0)


def default_pools(mcfg) -> str:
    cfg = EngineConfig(windowed_kv=True, enable_prefix_cache=False)
    full, sliding = windowed_pool_pages(cfg, mcfg, cfg.max_context)
    return f"{full} full pages and {sliding} sliding ones, for {cfg.num_pages} without the window"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="512,2048,4096,8192")
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    most = max(lengths) + OUTPUT
    base = dict(model=args.model, max_context=most, max_total_tokens=2 * most, threads=0)
    base.update(enable_prefix_cache=False, max_running=4)
    rows, dtype = [], ""
    engines = {w: Engine(EngineConfig(**base, windowed_kv=w)) for w in (False, True)}
    for n in lengths:
        got = {w: held(eng, n) for w, eng in engines.items()}
        assert got[False][2] == got[True][2], f"{n} tokens: the windowed pool changed the output"
        rows.append((n, got[False], got[True]))
        print(n, got[False][0] / MIB, got[True][0] / MIB, flush=True)
    eng = engines[True]
    dtype = eng.config.dtype
    mcfg = eng.model_config
    full_page, sliding_page = eng.runner.pool.held_bytes_per_page
    lines = [
        "# KV held per request, Gemma 3 270M, with and without the windowed pool "
        "(bench/bench_kv_held.py, #48)\n",
        f"{time.strftime('%Y-%m-%d %H:%M')}; machine: {platform.machine()}; {dtype}; pages of "
        f"{eng.config.page_size} tokens; {mcfg.num_layers} layers, {len(mcfg.sliding_layers)} "
        f"sliding with a window of {mcfg.sliding_window}; the offline engine (a colocated node's "
        f"scheduler and pool), one request per length, {OUTPUT} output tokens, prefix cache off. "
        f"Held: the bytes of KV the request's pages took, the most at any step (during the "
        f"prompt's last chunk: a sliding layer then holds the window and the chunk of "
        f"{eng.config.chunk_size}) and at its last decode step (a full page "
        f"{full_page / 1024:.0f} KiB, a sliding page {sliding_page / 1024:.0f} KiB; without the "
        f"window logic a page is both, {(full_page + sliding_page) / 1024:.0f} KiB). Both engines "
        f"answered with the same {OUTPUT} tokens at every length.\n",
        "| prompt tokens | most held without window (MiB) | with (MiB) | with / without "
        "| held decoding without (MiB) | with (MiB) | with / without "
        "| request time without / with (s) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    plain = engines[False].runner.pool
    lines.insert(
        2,
        f"The pools (max_total_tokens {base['max_total_tokens']}, max_running "
        f"{base['max_running']}): without the window, {plain.allocator.num_pages} pages of every "
        f"layer, {plain.nbytes / MIB:.0f} MiB; windowed, {eng.runner.pool.allocator.num_pages} "
        f"full pages and {eng.runner.pool.sliding_allocator.num_pages} sliding ones, "
        f"{pool_bytes(eng) / MIB:.0f} MiB: a context of up to "
        f"{eng.runner.pool.allocator.num_pages * eng.config.page_size} tokens in the memory "
        f"of {plain.allocator.num_pages * eng.config.page_size}. At the defaults (32,768 tokens, "
        f"64 running) the sliding pool takes its whole share: {default_pools(mcfg)}.\n",
    )
    for n, (b0, d0, _, t0), (b1, d1, _, t1) in rows:
        lines.append(
            f"| {n} | {b0 / MIB:.2f} | {b1 / MIB:.2f} | {b1 / b0:.2f}x | {d0 / MIB:.2f} "
            f"| {d1 / MIB:.2f} | {d1 / d0:.2f}x | {t0:.1f} / {t1:.1f} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
