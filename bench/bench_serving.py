"""Serving benchmark, side by side in one run, on the default model (SmolLM2-135M-Instruct, fp32):

  pd         `pdserve up` (router + prefill node PP 2 + decode node PP 2, KV over Mooncake TCP)
  colocated  `pdserve serve --pp 1` (2 torch threads) behind `pdserve router --worker`
  hf         transformers `generate`, one request at a time (no server; concurrency 1 only)

Every server is driven by `pdserve bench` (streaming chat, ignore_eos, greedy) with the same seeded
prompts per level (the level index is the seed, so no level warms the prefix cache for another).
With --aiperf, aiperf (the client behind the vLLM-CPU reference numbers, see README) also measures
the PD cluster with the reference command, request counts as given by --levels.

  .venv/bin/python bench/bench_serving.py [--levels 1:16,8:32,32:64]
      [--systems pd,colocated,hf] [--aiperf]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from cluster import free_port, kill_group, wait_healthy  # noqa: E402

ISL, OSL = "uniform:40,504", 64  # the reference workload: prompts 40-504 tokens, 64 output tokens
AIPERF = ROOT / ".venv/aiperf/bin/aiperf"


def loadavg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def export_tokenizer(dest: Path) -> Path:
    """The default model's tokenizer (from its GGUF) as a Hugging Face folder,
    for `--tokenizer` and aiperf."""
    if (dest / "tokenizer.json").exists():
        return dest
    from transformers import AutoConfig, AutoTokenizer

    from pdserve.engine.model.loader import resolve_model

    gguf = resolve_model(None)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    dest.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(dest))
    cfg.save_pretrained(str(dest))
    return dest


def spawn(cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
    with open(log, "wb") as f:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *cmd],
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ, **(env or {})),
        )


def bench_levels(url: str, levels, tok_dir: Path, out_dir: Path, name: str) -> list[dict]:
    rows = []
    for i, (conc, n) in enumerate(levels):
        out = out_dir / f"{name}_c{conc}.json"
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "bench",
            "--url",
            url,
            "--tokenizer",
            str(tok_dir),
            "--isl",
            ISL,
            "--osl",
            str(OSL),
            "--seed",
            str(i),
            "--concurrency",
            str(conc),
            "--num-requests",
            str(n),
            "--warmup",
            "2",
            "--output",
            str(out),
            "--no-progress",
            "--slo-ttft-ms",
            "2000",
            "--slo-itl-ms",
            "100",
            "--extra-body",
            '{"temperature": 0}',
        ]
        t0 = time.monotonic()
        subprocess.run(cmd, cwd=ROOT, check=True, timeout=3600)
        s = json.loads(out.read_text())["loads"][0]
        s["_wall"], s["_load"] = time.monotonic() - t0, loadavg()
        rows.append(s)
        print(
            f"  {name} c={conc}: {s['output_token_throughput']:.1f} out tok/s, load {s['_load']}",
            flush=True,
        )
    return rows


@contextlib.contextmanager
def pd_cluster(log: Path):
    """`pdserve up` (prefill PP 2 + decode PP 2) on a free port; yields the port, always stopped."""
    port = free_port()
    p = spawn(["up", "--port", str(port), "--prefill-pp", "2", "--decode-pp", "2"], log)
    try:
        t0 = time.monotonic()
        while "[up] ready" not in log.read_text():
            if p.poll() is not None or time.monotonic() - t0 > 900:
                raise RuntimeError("pdserve up did not start:\n" + log.read_text()[-3000:])
            time.sleep(1)
        print(f"  pd: ready in {time.monotonic() - t0:.0f} s", flush=True)
        yield port
    finally:
        kill_group(p, grace=30)


def run_pd(levels, tok_dir, out_dir, logdir) -> list[dict]:
    with pd_cluster(logdir / "pd_up.log") as port:
        return bench_levels(f"http://127.0.0.1:{port}", levels, tok_dir, out_dir, "pd")


def run_colocated(levels, tok_dir, out_dir, logdir) -> list[dict]:
    nport, rport = free_port(), free_port()
    node = spawn(
        ["serve", "--pp", "1", "--threads", "2", "--port", str(nport)], logdir / "colocated.log"
    )
    router = None
    try:
        t0 = time.monotonic()
        wait_healthy(f"http://127.0.0.1:{nport}", node, 900, logdir / "colocated.log")
        router = spawn(
            ["router", "--port", str(rport), "--worker", f"http://127.0.0.1:{nport}"],
            logdir / "colocated_router.log",
        )
        wait_healthy(f"http://127.0.0.1:{rport}", router, 120, logdir / "colocated_router.log")
        print(f"  colocated: ready in {time.monotonic() - t0:.0f} s", flush=True)
        return bench_levels(f"http://127.0.0.1:{rport}", levels, tok_dir, out_dir, "colocated")
    finally:
        if router is not None:
            kill_group(router)
        kill_group(node, grace=30)


def run_hf(n: int, tok_dir: Path) -> dict:
    """transformers generate over the level-0 prompts of the same seed, one request at a time."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pdserve.bench.workload import LengthDist, TokenCounter, Workload
    from pdserve.engine.model.loader import resolve_model

    torch.set_num_threads(2)
    wl = Workload(
        isl=LengthDist.parse("--isl", ISL),
        osl=LengthDist.parse("--osl", str(OSL)),
        seed=0,
        tokenizer=TokenCounter(str(tok_dir)),
    )
    reqs = wl.requests(n, "load0")
    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    gguf = resolve_model(None)
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    ttfts, e2es, out_tokens = [], [], 0
    t_all = time.monotonic()
    for r in reqs:
        ids = tok.apply_chat_template(
            r.chat_messages(), add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        t0 = time.monotonic()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=1, do_sample=False)
            ttfts.append(time.monotonic() - t0)
            t1 = time.monotonic()
            out = model.generate(ids, max_new_tokens=OSL, min_new_tokens=OSL, do_sample=False)
        e2es.append(ttfts[-1] + time.monotonic() - t1)
        out_tokens += out.shape[1] - ids.shape[1]
    wall = sum(e2es)
    return {
        "requests": n,
        "output_tokens": out_tokens,
        "wall_s": wall,
        "output_tokens_per_s": out_tokens / wall,
        "ttft_mean_ms": 1e3 * sum(ttfts) / n,
        "e2e_mean_ms": 1e3 * sum(e2es) / n,
        "total_s": time.monotonic() - t_all,
        "_load": loadavg(),
    }


def run_aiperf(url_port: int, tok_dir: Path, levels, out_dir: Path) -> list[dict]:
    rows = []
    env = {
        k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"
    }  # aiperf refuses local folders with it
    for conc, n in levels:
        art = out_dir / f"aiperf_c{conc}"
        cmd = [
            str(AIPERF),
            "profile",
            "-m",
            str(tok_dir),
            "--url",
            f"http://127.0.0.1:{url_port}",
            "--endpoint-type",
            "chat",
            "--streaming",
            "--tokenizer",
            str(tok_dir),
            "--isl",
            "272",
            "--osl",
            "64",
            "--random-range-ratio",
            '{"input": 0.88236, "output": 0}',
            "--prompt-corpus",
            "sonnet",
            "--random-seed",
            "0",
            "--num-dataset-entries",
            "64",
            "--dataset-sampling-strategy",
            "sequential",
            "--extra-inputs",
            "ignore_eos:true",
            "--extra-inputs",
            "temperature:0",
            "--concurrency",
            str(conc),
            "--request-count",
            str(n),
            "--warmup-request-count",
            "4",
            "--ui",
            "none",
            "--no-gpu-telemetry",
            "--artifact-dir",
            str(art),
        ]
        subprocess.run(
            cmd, cwd=out_dir, env=env, check=True, timeout=3600, stdout=subprocess.DEVNULL
        )
        found = sorted(art.rglob("*aiperf*.json"))
        data = json.loads(found[0].read_text()) if found else {}
        rows.append({"concurrency": conc, "requests": n, "raw": data, "_load": loadavg()})
        otps = (data.get("output_token_throughput") or {}).get("avg")
        print(f"  aiperf c={conc}: {otps} out tok/s, load {loadavg()}", flush=True)
    return rows


def run_pd_aiperf(levels, tok_dir, out_dir, logdir) -> list[dict]:
    with pd_cluster(logdir / "pd_up_aiperf.log") as port:
        return run_aiperf(port, tok_dir, levels, out_dir)


def md_table(results: dict) -> str:
    lines = [
        "| system | concurrency | requests | output tok/s | input tok/s | req/s | goodput req/s "
        "| TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | e2e p50 s | errors "
        "| load (1/5/15) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, rows in results.items():
        if name in ("hf", "aiperf_pd"):
            continue
        for s in rows:
            conc = s["load"].get("concurrency")
            lines.append(
                f"| {name} | {conc} | {s['completed']} | {s['output_token_throughput']:.1f} | "
                f"{s['input_token_throughput']:.1f} | {s['request_throughput']:.3f} | "
                f"{s['goodput']:.3f} | {s['ttft_ms']['p50']:.0f} | {s['ttft_ms']['p99']:.0f} | "
                f"{s['itl_ms']['p50']:.1f} | {s['itl_ms']['p99']:.1f} | "
                f"{s['e2e_ms']['p50'] / 1e3:.1f} | {s['failed']} | {s['_load']} |"
            )
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--levels", default="1:16,8:32,32:64", help="concurrency:requests,...")
    ap.add_argument("--systems", default="pd,colocated,hf")
    ap.add_argument("--hf-requests", type=int, default=4)
    ap.add_argument("--aiperf", action="store_true", help="also measure the PD cluster with aiperf")
    ap.add_argument("--aiperf-levels", default=None, help="default: --levels")
    ap.add_argument("--out", default=str(ROOT / "bench/results/serving.md"))
    args = ap.parse_args()
    levels = [tuple(int(x) for x in lv.split(":")) for lv in args.levels.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    tok_dir = export_tokenizer(Path.home() / ".cache/pdserve/smollm2-135m-instruct-tokenizer")
    print(f"work dir {work}; tokenizer {tok_dir}; load {loadavg()}", flush=True)
    t0 = time.monotonic()
    results: dict[str, list | dict] = {}
    start_load = loadavg()
    for name in args.systems.split(","):
        if name == "pd":
            results["pd"] = run_pd(levels, tok_dir, work, work)
        elif name == "colocated":
            results["colocated"] = run_colocated(levels, tok_dir, work, work)
        elif name == "hf":
            results["hf"] = run_hf(args.hf_requests, tok_dir)
            print(f"  hf: {results['hf']['output_tokens_per_s']:.1f} out tok/s", flush=True)
    if args.aiperf:
        al = [
            tuple(int(x) for x in lv.split(":"))
            for lv in (args.aiperf_levels or args.levels).split(",")
        ]
        results["aiperf_pd"] = run_pd_aiperf(al, tok_dir, work, work)
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))
    text = [
        "# Serving benchmark (SmolLM2-135M-Instruct, fp32)\n",
        f"Machine: {os.cpu_count()} CPUs ({platform.machine()}), "
        f"Python {platform.python_version()}. Load average at start {start_load}, "
        f"at the end {loadavg()}; whole script {time.monotonic() - t0:.0f} s. Raw JSON: "
        f"{work}/results.json.\n",
        "Workload: `pdserve bench`, streaming chat, prompts of seeded synthetic text with exact "
        "token lengths uniform in [40, 504] (SmolLM2 tokenizer, before the chat template), "
        f"{OSL} output tokens (ignore_eos), closed loop at each concurrency, "
        "2 warm-up requests per level; level i uses seed i for every system. Goodput SLO: "
        "TTFT <= 2 s and ITL <= 100 ms.\n",
        "Command: `.venv/bin/python bench/bench_serving.py " + " ".join(sys.argv[1:]) + "`\n",
        md_table(results),
    ]
    if "hf" in results:
        h = results["hf"]
        text.append(
            f"\ntransformers `generate`, fp32, 2 threads, one request at a time over the first "
            f"{h['requests']} level-0 prompts: {h['output_tokens_per_s']:.1f} output tok/s, "
            f"mean TTFT {h['ttft_mean_ms']:.0f} ms, mean e2e {h['e2e_mean_ms'] / 1e3:.1f} s (load "
            f"{h['_load']})."
        )
    if "aiperf_pd" in results:
        text.append(
            "\naiperf 0.13 against the PD cluster (the reference command of README, "
            "request counts as listed):\n\n| concurrency | requests | output tok/s | TTFT p50 ms | "
            "TTFT p99 ms | ITL p50 ms | load |\n|---:|---:|---:|---:|---:|---:|---|"
        )
        for r in results["aiperf_pd"]:
            d = r["raw"]

            def g(key, stat, d=d):
                v = (d.get(key) or {}).get(stat)
                return f"{v:.1f}" if isinstance(v, (int, float)) else "-"

            text.append(
                f"| {r['concurrency']} | {r['requests']} | {g('output_token_throughput', 'avg')} | "
                f"{g('time_to_first_token', 'p50')} | {g('time_to_first_token', 'p99')} | "
                f"{g('inter_token_latency', 'p50')} | {r['_load']} |"
            )
    Path(args.out).write_text("\n".join(text) + "\n")
    print("\n".join(text))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
