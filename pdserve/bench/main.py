"""`pdserve bench`: flags, the sweep over loads, the JSON file and the plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import httpx

from pdserve.bench.client import Target
from pdserve.bench.report import Slo, format_summary, records, summarize
from pdserve.bench.runner import Load, run_load
from pdserve.bench.workload import BenchError, LengthDist, TokenCounter, Workload, load_jsonl

DEFAULT_REQUESTS = 64
# Prompts are built before a load starts (building them during it would steal the client's time
# from timing the streams): --num-requests of them, or this many, cycled, for a run bounded only by
# --duration.
POOL_FOR_DURATION = 1000


def add_bench_args(ap: argparse.ArgumentParser) -> None:
    _add_server_args(ap)
    _add_workload_args(ap.add_argument_group("workload"))
    _add_load_args(ap.add_argument_group("load"))
    _add_slo_args(
        ap.add_argument_group("SLO (goodput counts requests that meet every bound given)")
    )
    _add_output_args(ap.add_argument_group("output"))


def _add_server_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--url", default="http://127.0.0.1:8000", help="server base URL (with or without /v1)"
    )
    ap.add_argument("--endpoint", choices=("chat", "completions"), default="chat")
    ap.add_argument("--model", default=None, help="default: the first id of GET /v1/models")
    ap.add_argument(
        "--api-key", default=os.environ.get("PDSERVE_API_KEY"), help="sent as a Bearer token"
    )


def _add_workload_args(w: argparse._ArgumentGroup) -> None:
    w.add_argument(
        "--isl",
        default="128",
        help="prompt length: N, uniform:LOW,HIGH or normal:MEAN,STD[,MIN,MAX]",
    )
    w.add_argument("--osl", default="64", help="output length (max_tokens), same forms as --isl")
    w.add_argument(
        "--tokenizer",
        default=None,
        help="a Hugging Face tokenizer folder: prompts of exact "
        "token lengths (else --isl counts words)",
    )
    w.add_argument(
        "--dataset",
        default=None,
        help='a JSONL file of {"prompt": ...} or {"messages": [...]} '
        "lines, optional max_tokens (else --osl)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="do not send ignore_eos: true (answers may then stop before max_tokens)",
    )
    w.add_argument(
        "--extra-body", default=None, help="a JSON object merged into every request body"
    )


def _add_load_args(ld: argparse._ArgumentGroup) -> None:
    ld.add_argument(
        "--concurrency", default=None, help="requests in flight; a list (1,8,32) is a sweep"
    )
    ld.add_argument(
        "--request-rate", default=None, help="Poisson arrivals per second; a list is a sweep"
    )
    ld.add_argument(
        "--max-concurrency", type=int, default=None, help="with --request-rate: a cap in flight"
    )
    ld.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help=f"measured requests per load (default {DEFAULT_REQUESTS} unless --duration)",
    )
    ld.add_argument("--duration", type=float, default=None, help="seconds per load to keep sending")
    ld.add_argument(
        "--warmup", type=int, default=2, help="requests per load sent first and not measured"
    )
    ld.add_argument("--request-timeout", type=float, default=600.0)


def _add_slo_args(s: argparse._ArgumentGroup) -> None:
    s.add_argument("--slo-ttft-ms", type=float, default=None)
    s.add_argument("--slo-itl-ms", type=float, default=None)
    s.add_argument("--slo-e2e-ms", type=float, default=None)


def _add_output_args(o: argparse._ArgumentGroup) -> None:
    o.add_argument("--output", default=None, help="write the results as JSON to this file")
    o.add_argument(
        "--save-records", action="store_true", help="include every request's record in --output"
    )
    o.add_argument(
        "--plot", default=None, help="write a PNG of latency and throughput against the load"
    )
    o.add_argument("--no-progress", dest="progress", action="store_false")


def _list(flag: str, text: str, kind: type) -> list:
    try:
        vals = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(v <= 0 for v in vals):
        raise BenchError(f"{flag}: expected a comma-separated list of numbers > 0, got {text!r}")
    return vals


def _loads(args) -> list[Load]:
    if args.concurrency and args.request_rate:
        raise BenchError("give --concurrency or --request-rate, not both")
    if args.max_concurrency is not None and (args.max_concurrency < 1 or not args.request_rate):
        raise BenchError("--max-concurrency needs --request-rate and a value >= 1")
    if args.request_rate:
        return [
            Load(request_rate=r, max_concurrency=args.max_concurrency)
            for r in _list("--request-rate", args.request_rate, float)
        ]
    return [Load(concurrency=c) for c in _list("--concurrency", args.concurrency or "1", int)]


def _check(args) -> None:
    for flag, v, low in (("--num-requests", args.num_requests, 1), ("--warmup", args.warmup, 0)):
        if v is not None and v < low:
            raise BenchError(f"{flag}: must be >= {low}, got {v}")
    for flag, v in (
        ("--duration", args.duration),
        ("--request-timeout", args.request_timeout),
        ("--slo-ttft-ms", args.slo_ttft_ms),
        ("--slo-itl-ms", args.slo_itl_ms),
        ("--slo-e2e-ms", args.slo_e2e_ms),
    ):
        if v is not None and not v > 0:
            raise BenchError(f"{flag}: must be > 0, got {v}")
    if args.save_records and not args.output:
        raise BenchError("--save-records needs --output FILE")


def _extra_body(text: str | None) -> dict:
    if not text:
        return {}
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BenchError(f"--extra-body: not JSON ({e})") from None
    if not isinstance(body, dict):
        raise BenchError("--extra-body: must be a JSON object")
    return body


def resolve_model(base: str, model: str | None, headers: dict) -> str:
    """Checks that the server answers; returns --model or the first id of GET /v1/models."""
    try:
        r = httpx.get(f"{base}/v1/models", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach the server at {base}: {type(e).__name__}: {e}") from None
    if r.status_code == 401:
        raise BenchError(f"{base}/v1/models answered 401: give the server's key with --api-key")
    if model:
        return model
    try:
        return r.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise BenchError(
            f"{base}/v1/models answered {r.status_code} without a model id; give one with --model"
        ) from None


def _config(
    args, target: Target, loads: list[Load], isl: LengthDist, osl: LengthDist, slo: Slo
) -> dict:
    return {
        "url": target.base_url,
        "endpoint": target.endpoint,
        "model": target.model,
        "api_key_sent": bool(target.api_key),
        "isl": isl.describe(),
        "osl": osl.describe(),
        "tokenizer": args.tokenizer,
        "dataset": args.dataset,
        "seed": args.seed,
        "ignore_eos": args.ignore_eos,
        "extra_body": target.extra_body,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "warmup": args.warmup,
        "request_timeout_s": args.request_timeout,
        "slo": {k: v for k, v in vars(slo).items() if v is not None},
        "loads": [ld.as_dict() for ld in loads],
    }


async def _sweep(
    args, target: Target, workload: Workload, loads: list[Load], slo: Slo
) -> tuple[list[dict], bool]:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    summaries, interrupted = [], False
    pool = args.num_requests or POOL_FOR_DURATION
    for i, load in enumerate(loads):
        # Each load gets its own prompts so a prefix cache warmed by one load does not flatter the
        # next.
        if workload.tokenizer is not None and pool > 200:
            print(
                f"[bench] building {pool} prompts with the tokenizer", file=sys.stderr, flush=True
            )
        reqs = workload.requests(pool, f"load{i}")
        warm = workload.requests(args.warmup, f"warmup{i}")
        result = await run_load(
            target,
            load,
            reqs,
            warm,
            num_requests=args.num_requests,
            duration=args.duration,
            arrival_seed=f"arrivals/{args.seed}/{i}",
            stop=stop,
            request_timeout=args.request_timeout,
            progress=args.progress,
        )
        summary = summarize(result, slo)
        print(format_summary(summary), flush=True)
        if args.save_records:
            summary["records"] = records(result)
        summaries.append(summary)
        if result.interrupted or stop.is_set():
            interrupted = True
            break
    return summaries, interrupted


def bench_main(args) -> int:
    try:
        return _bench(args)
    except BenchError as e:
        print(f"pdserve bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the first request: nothing measured to write
        print("pdserve bench: interrupted", file=sys.stderr)
        return 130


def _bench(args) -> int:
    _check(args)
    loads = _loads(args)
    isl, osl = LengthDist.parse("--isl", args.isl), LengthDist.parse("--osl", args.osl)
    slo = Slo(args.slo_ttft_ms, args.slo_itl_ms, args.slo_e2e_ms)
    extra = _extra_body(args.extra_body)
    if args.plot:
        from pdserve.bench.plot import require_matplotlib

        require_matplotlib()
    dataset = load_jsonl(args.dataset) if args.dataset else None
    if dataset and args.endpoint == "completions" and any("messages" in e for e in dataset):
        raise BenchError("--dataset has 'messages' entries, which need --endpoint chat")
    if args.num_requests is None and args.duration is None:
        args.num_requests = DEFAULT_REQUESTS
    tokenizer = TokenCounter(args.tokenizer) if args.tokenizer else None
    base = args.url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    model = resolve_model(base, args.model, headers)
    target = Target(base, args.endpoint, model, args.api_key, args.ignore_eos, extra)
    workload = Workload(isl=isl, osl=osl, seed=args.seed, tokenizer=tokenizer, dataset=dataset)
    started = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    prompts = f"dataset {args.dataset}" if dataset else f"isl {isl.describe()} osl {osl.describe()}"
    print(
        f"[bench] {base} model {model!r}, {args.endpoint} endpoint, {prompts}, "
        f"{len(loads)} load(s)",
        file=sys.stderr,
        flush=True,
    )
    summaries, interrupted = asyncio.run(_sweep(args, target, workload, loads, slo))
    if args.output:
        out = {
            "tool": "pdserve bench",
            "started_at": started,
            "interrupted": interrupted,
            "config": _config(args, target, loads, isl, osl, slo),
            "loads": summaries,
        }
        Path(args.output).write_text(json.dumps(out, indent=1))
        print(f"[bench] wrote {args.output}", file=sys.stderr)
    if args.plot and summaries:
        from pdserve.bench.plot import write_plot

        write_plot(
            args.plot,
            summaries,
            f"{model} via {args.endpoint}, isl {isl.describe()} osl {osl.describe()}",
        )
        print(f"[bench] wrote {args.plot}", file=sys.stderr)
    if interrupted:
        return 130
    return 1 if any(s["completed"] == 0 for s in summaries) else 0
