"""KV bytes per request of Gemma 3 270M through PD, with and without the sliding-window transfer.

Starts `pdserve up --model gemma3-270m` (fp32, prefill and decode PP 1, every prompt prefilled on
the prefill node and its KV moved, prefix caches off) from two source trees, one after the other
in one run: `--tree` (default: this one) and `--baseline-tree` (a checkout from before the window
logic: `git clone -q . /tmp/pdserve-base && git -C /tmp/pdserve-base checkout e138efb`). For each
prompt length (512, 2048 and 8192 tokens of aiperf's corpus text, one request each, 2 output
tokens) it reads how much the prefill node's counters grew over the request:

  moved    pdserve_kv_transfer_bytes_total: what its transfer engine wrote (whole pages)
  spared   pdserve_kv_transfer_window_skipped_bytes_total: sliding layers' KV before the window

Held: the KV a request holds on the decode node once its prompt is in: every layer's pages (the
pool does not free pages behind the window yet), from the pool's geometry; next to it what a pool
that freed them would hold (full layers whole, sliding layers the window and a page), computed
from the same geometry: that part is not built.

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
PAGE = 16  # the nodes' default page size
FP32 = 4


def start(tree: Path, port: int, secret: str, max_context: int, log: Path) -> subprocess.Popen:
    node = f"--dtype float32 --max-context {max_context} --no-prefix-cache"
    router = "--disagg-local-prefill-cost 0 --disagg-min-prompt-tokens 1"
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", "gemma3-270m"]
    cmd += ["--port", str(port), "--node-args", node, "--router-args", router]
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


def measure(tree: Path, prompts: dict[int, list[int]], args, log: Path) -> dict[int, dict]:
    port, secret = free_port(), secrets.token_hex(16)
    proc = start(tree, port, secret, max(prompts) + 64, log)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, log, args.startup_timeout)
        workers = httpx.get(f"{url}/workers", auth=SignedAuth(secret), timeout=30).json()
        (prefill,) = [w["url"] for w in workers["workers"] if w["role"] == "prefill"]
        out = {}
        for n, ids in prompts.items():
            before = {k: counter(prefill, k) for k in (MOVED, SPARED, TOKENS)}
            t0 = time.monotonic()
            body = {"input_ids": ids, "sampling_params": {"max_tokens": 2, "ignore_eos": True}}
            r = httpx.post(f"{url}/generate", json=body, timeout=args.request_timeout)
            r.raise_for_status()
            seconds = time.monotonic() - t0
            # the ranks push their counters to the front every so often: wait for this room's
            deadline = time.monotonic() + 60
            while counter(prefill, TOKENS) - before[TOKENS] < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the room of {n} tokens never counted as moved")
                time.sleep(0.25)
            out[n] = {k: counter(prefill, k) - before[k] for k in (MOVED, SPARED)}
            out[n]["seconds"] = seconds
            print(f"{tree.name}: {n} tokens: {out[n]}", flush=True)
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


def report(lengths, new, base, args) -> str:
    cfg = load_model_config(resolve_model("gemma3-270m"))
    layers = cfg.num_layers
    sliding = sum(cfg.is_sliding(i) for i in range(layers))
    per_token_layer = 2 * cfg.num_kv_heads * cfg.head_dim * FP32  # K and V of one token, one layer
    lines = [
        "# KV bytes per request, Gemma 3 270M through PD (bench/bench_gemma3_kv_bytes.py, #48)",
        "",
        f"{time.strftime('%Y-%m-%d %H:%M')}; machine: {platform.machine()} ({os.cpu_count()} "
        f"cores); fp32 (bf16 halves every figure); pages of {PAGE} tokens; {layers} layers, "
        f"{sliding} sliding with a window of {cfg.sliding_window}; one request per length, 2 "
        "output tokens, every prompt disaggregated, prefix caches off. Moved: the prefill node's "
        f"`{MOVED}` over the request (whole pages). Trees: `{args.tree}` (window logic) and "
        f"`{args.baseline_tree}` (before it), one cluster each, in one run.",
        "",
        "| prompt tokens | moved without window (MiB) | moved with window (MiB) | with / without "
        "| counted as spared (MiB) | held on decode (MiB) | held if pages behind the window were "
        "freed (MiB, not built) |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for n in lengths:
        pages = -(-n // PAGE)
        held = pages * PAGE * layers * per_token_layer
        window_pages = min(pages, -(-cfg.sliding_window // PAGE) + 1)
        freed = (pages * (layers - sliding) + window_pages * sliding) * PAGE * per_token_layer
        with_w, without = new[n][MOVED], base[n][MOVED]
        lines.append(
            f"| {n} | {mib(without)} | {mib(with_w)} | {with_w / without:.2f}x "
            f"| {mib(new[n][SPARED])} | {mib(held)} | {mib(freed)} |"
        )
    lines += [
        "",
        "Request time (s, prefill of the prompt and 2 tokens, as a check that both trees did the "
        "same work): "
        + ", ".join(f"{n}: {base[n]['seconds']:.1f} / {new[n]['seconds']:.1f}" for n in lengths)
        + " (without / with).",
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
    text = report(lengths, new, base, args)
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
