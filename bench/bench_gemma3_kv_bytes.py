"""KV bytes per request of Gemma 3 270M through PD, moved and held, with and without the window.

Starts `pdserve up --model gemma3-270m` (fp32, prefill and decode PP 1, every prompt prefilled on
the prefill node and its KV moved, prefix caches off) three times, one after the other in one
run: from `--baseline-tree` (a checkout from before the window logic: `git clone -q .
/tmp/pdserve-base && git -C /tmp/pdserve-base checkout e138efb`), from `--tree` (default: this
one), and from `--tree` with `--decode-args --windowed-kv` (the decode node's windowed pool). For
each prompt length (512, 2048 and 8192 tokens of aiperf's corpus text, one request each, 64
output tokens) it reads:

  moved    the prefill node's pdserve_kv_transfer_bytes_total over the request: what its transfer
           engine wrote (whole pages)
  spared   its pdserve_kv_transfer_window_skipped_bytes_total: sliding layers' KV before the window
  held     the decode node's KV while the request decodes, the most of its gauges sampled every
           0.1 s: pdserve_kv_pool_used_tokens (in whole pages) over every layer, or with the
           windowed pool over the full-attention layers, plus pdserve_kv_sliding_pool_used_tokens
           over the sliding ones

  .venv/bin/python bench/bench_gemma3_kv_bytes.py --baseline-tree /tmp/pdserve-base \\
      [--lengths 512,2048,8192] [--out bench/results/gemma3_kv_bytes.md]
"""

from __future__ import annotations

import argparse
import os
import platform
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_agreement import CORPUS  # noqa: E402
from soak import stop_cluster, wait_ready  # noqa: E402

from pdserve.engine.model.loader import load_model_config, resolve_model  # noqa: E402
from pdserve.engine.model.tokenizer import load_tokenizer  # noqa: E402
from pdserve.infra.procs import free_port  # noqa: E402
from pdserve.infra.request_signing import SignedAuth  # noqa: E402

MOVED = "pdserve_kv_transfer_bytes_total"
SPARED = "pdserve_kv_transfer_window_skipped_bytes_total"
TOKENS = "pdserve_kv_transfer_tokens_total"  # grows at a room's success, with SPARED
USED = "pdserve_kv_pool_used_tokens"
SLIDING_USED = "pdserve_kv_sliding_pool_used_tokens"
OUTPUT_TOKENS = 64
PAGE = 16  # the nodes' default page size
FP32 = 4


def start(
    tree: Path, port: int, secret: str, max_context: int, log: Path, windowed: bool
) -> subprocess.Popen:
    node = f"--dtype float32 --max-context {max_context} --no-prefix-cache"
    router = "--disagg-local-prefill-cost 0 --disagg-min-prompt-tokens 1"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", "gemma3-270m"]
    cmd += ["--port", str(port), "--node-args", node, "--router-args", router]
    if windowed:
        cmd += ["--decode-args", "--windowed-kv"]
    with open(log, "wb") as f:
        return subprocess.Popen(
            cmd,
            cwd=tree,  # `python -m` imports pdserve from the tree it runs in
            env={**os.environ, "PDSERVE_INTERNAL_TOKEN": secret},
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )


def counter(url: str, name: str) -> float:
    """A counter summed over its samples at url/metrics (0 where it does not exist)."""
    total = 0.0
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


class HeldSampler:
    """The most KV tokens the decode node's gauges show while a request runs (a thread)."""

    def __init__(self, url: str):
        self.url, self.most = url, (0.0, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            full, sliding = counter(self.url, USED), counter(self.url, SLIDING_USED)
            if full + sliding > sum(self.most):
                self.most = (full, sliding)

    def stop(self) -> tuple[float, float]:
        self._stop.set()
        self._thread.join(timeout=30)
        return self.most


def measure(
    tree: Path, prompts: dict[int, list[int]], args, log: Path, windowed: bool = False
) -> dict[int, dict]:
    port, secret = free_port(), secrets.token_hex(16)
    proc = start(tree, port, secret, max(prompts) + OUTPUT_TOKENS + 64, log, windowed)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, log, args.startup_timeout)
        workers = httpx.get(f"{url}/workers", auth=SignedAuth(secret), timeout=30).json()
        (prefill,) = [w["url"] for w in workers["workers"] if w["role"] == "prefill"]
        (decode,) = [w["url"] for w in workers["workers"] if w["role"] == "decode"]
        out = {}
        for n, ids in prompts.items():
            before = {k: counter(prefill, k) for k in (MOVED, SPARED, TOKENS)}
            t0 = time.monotonic()
            params = {"max_tokens": OUTPUT_TOKENS, "ignore_eos": True}
            sampler = HeldSampler(decode)
            try:
                body = {"input_ids": ids, "sampling_params": params}
                r = httpx.post(f"{url}/generate", json=body, timeout=args.request_timeout)
                r.raise_for_status()
            finally:
                held = sampler.stop()
            seconds = time.monotonic() - t0
            # the ranks push their counters to the front every so often: wait for this room's
            deadline = time.monotonic() + 60
            while counter(prefill, TOKENS) - before[TOKENS] < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the room of {n} tokens never counted as moved")
                time.sleep(0.25)
            out[n] = {k: counter(prefill, k) - before[k] for k in (MOVED, SPARED)}
            out[n].update(seconds=seconds, held=held, tokens=r.json()["token_ids"])
            print(f"{tree.name} (windowed {windowed}): {n} tokens: {out[n]}", flush=True)
        return out
    finally:
        stop_cluster(proc)


def prompts_of(lengths: list[int]) -> dict[int, list[int]]:
    tok = load_tokenizer(resolve_model("gemma3-270m"))
    words = tok.encode(CORPUS.read_text(), add_special_tokens=False)
    out, at = {}, 0
    for n in lengths:  # disjoint spans: no prompt shares a prefix with another
        out[n] = words[at : at + n]
        at += n
    return out


def mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def report(lengths, new, base, pool, args) -> str:
    cfg = load_model_config(resolve_model("gemma3-270m"))
    layers = cfg.num_layers
    sliding = sum(cfg.is_sliding(i) for i in range(layers))
    per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * FP32  # K and V of one token, one layer

    def held(run: dict, windowed: bool) -> float:
        full, slid = run["held"]
        full = -(-full // PAGE) * PAGE  # the pool holds whole pages
        return (full * (layers - sliding if windowed else layers) + slid * sliding) * (
            per_token_layer
        )

    lines = [
        "# KV bytes per request, Gemma 3 270M through PD (bench/bench_gemma3_kv_bytes.py, #48)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; machine: {platform.machine()} ({os.cpu_count()} "
        f"cores); fp32 (bf16 halves every figure); pages of {PAGE} tokens; {layers} layers, "
        f"{sliding} sliding with a window of {cfg.sliding_window}; one request per length, "
        f"{OUTPUT_TOKENS} output tokens, every prompt disaggregated, prefix caches off. Moved: the "
        f"prefill node's `{MOVED}` over the request (whole pages). Held: the most the decode "
        f"node's `{USED}` (in whole pages, over the layers of its pool) and `{SLIDING_USED}` "
        f"showed while the request ran, sampled every 0.1 s. Trees: `{args.tree}` (window logic) "
        f"and `{args.baseline_tree}` (before it), and `{args.tree}` with `--decode-args "
        "--windowed-kv`, one cluster each, in one run.",
        "",
        "| prompt tokens | moved without window (MiB) | moved with window (MiB) | with / without "
        "| counted as spared (MiB) | held on decode (MiB) | held with `--windowed-kv` (MiB) "
        "| with / without |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        with_w, without = new[n][MOVED], base[n][MOVED]
        whole, windowed = held(new[n], False), held(pool[n], True)
        lines.append(
            f"| {n} | {mib(without)} | {mib(with_w)} | {with_w / without:.2f}x "
            f"| {mib(new[n][SPARED])} | {mib(whole)} | {mib(windowed)} | {windowed / whole:.2f}x |"
        )
    same = all(new[n]["tokens"] == pool[n]["tokens"] == base[n]["tokens"] for n in lengths)
    lines += [
        "",
        "Request time (s, prefill of the prompt and the output, as a check that the trees did the "
        "same work): "
        + ", ".join(
            f"{n}: {base[n]['seconds']:.1f} / {new[n]['seconds']:.1f} / {pool[n]['seconds']:.1f}"
            for n in lengths
        )
        + " (before the window / window logic / with `--windowed-kv`). The three clusters "
        + ("answered every prompt with the same tokens." if same else "answered differently."),
        "",
    ]
    return "\n".join(lines)


def interrupt(_signum, _frame) -> None:
    """SIGTERM ends the run as Ctrl-C does: the `finally` stops the cluster."""
    raise KeyboardInterrupt


def main() -> int:
    signal.signal(signal.SIGTERM, interrupt)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT)
    ap.add_argument("--baseline-tree", type=Path, required=True)
    ap.add_argument("--lengths", default="512,2048,8192")
    ap.add_argument("--startup-timeout", type=float, default=900.0)
    ap.add_argument("--request-timeout", type=float, default=900.0)
    ap.add_argument("--out", type=Path, default=ROOT / "bench/results/gemma3_kv_bytes.md")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = prompts_of(lengths)
    logs = Path(tempfile.mkdtemp(prefix="gemma3-kv-bytes-"))  # the clusters' output
    print(f"cluster logs in {logs}", flush=True)
    base = measure(args.baseline_tree, prompts, args, logs / "baseline.log")
    new = measure(args.tree, prompts, args, logs / "window.log")
    pool = measure(args.tree, prompts, args, logs / "windowed-kv.log", windowed=True)
    text = report(lengths, new, base, pool, args)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
