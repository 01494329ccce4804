"""Stats of one load: throughput, latency percentiles, errors by kind, and goodput under an SLO.

Latencies per successful request: TTFT (send to first content), ITL ((e2e - TTFT) / (output
tokens - 1), the mean gap between tokens after the first) and e2e (send to the end of the stream).
Throughputs divide by the measured phase's duration: first send to last answer.

Goodput is the rate of requests that succeeded AND met every bound given (`--slo-ttft-ms`,
`--slo-itl-ms`, `--slo-e2e-ms`); a one-token answer has no ITL and meets an ITL bound. With no
bound given every successful request counts, so goodput equals the request throughput.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass

from pdserve.bench.client import RequestRecord
from pdserve.bench.runner import LoadResult

_MS = 1000.0


@dataclass(frozen=True)
class Slo:
    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def meets(self, r: RequestRecord) -> bool:
        if not r.ok:
            return False
        if self.ttft_ms is not None and (r.ttft is None or r.ttft * _MS > self.ttft_ms):
            return False
        if self.itl_ms is not None and r.itl is not None and r.itl * _MS > self.itl_ms:
            return False
        return self.e2e_ms is None or r.e2e * _MS <= self.e2e_ms


def percentile(sorted_vals: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_vals) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_vals[lo] + (sorted_vals[hi] - sorted_vals[lo]) * (pos - lo)


def distribution(values: list[float], scale: float = 1.0) -> dict:
    vals = sorted(v * scale for v in values)
    if not vals:
        return {
            "count": 0,
            "mean": None,
            "min": None,
            "p50": None,
            "p90": None,
            "p99": None,
            "max": None,
        }
    return {
        "count": len(vals),
        "mean": round(sum(vals) / len(vals), 3),
        "min": round(vals[0], 3),
        "p50": round(percentile(vals, 50), 3),
        "p90": round(percentile(vals, 90), 3),
        "p99": round(percentile(vals, 99), 3),
        "max": round(vals[-1], 3),
    }


def input_tokens(r: RequestRecord) -> tuple[int, str]:
    """The prompt length and where it came from: the server's usage, our tokenizer, or words."""
    if r.prompt_tokens is not None:
        return r.prompt_tokens, "server"
    if r.request.prompt_tokens is not None:
        return r.request.prompt_tokens, "tokenizer"
    return r.request.prompt_words, "words"


def summarize(result: LoadResult, slo: Slo) -> dict:
    recs = result.records
    ok = [r for r in recs if r.ok]
    failed = [r for r in recs if not r.ok and r.error != "cancelled"]
    dur = result.duration_s

    def rate(n: int) -> float:
        return round(n / dur, 4) if dur > 0 else 0.0

    ins = [input_tokens(r) for r in ok]
    out_total = sum(r.output_tokens for r in ok)
    in_total = sum(n for n, _ in ins)
    good = sum(slo.meets(r) for r in ok)
    examples: dict[str, str] = {}
    for r in failed:
        examples.setdefault(
            r.error, f"status {r.status}: {r.error_body}" if r.status else str(r.error_body)
        )
    return {
        "label": result.load.label(),
        "load": result.load.as_dict(),
        "interrupted": result.interrupted,
        "started_unix": round(result.t0_unix, 3),
        "duration_s": round(dur, 4),
        "completed": len(ok),
        "failed": len(failed),
        "cancelled": sum(r.error == "cancelled" for r in recs),
        "warmup_requests": len(result.warmup),
        "request_throughput": rate(len(ok)),
        "output_token_throughput": rate(out_total),
        "input_token_throughput": rate(in_total),
        "total_output_tokens": out_total,
        "total_input_tokens": in_total,
        "input_tokens_source": dict(Counter(src for _, src in ins)),
        "output_tokens_source": dict(
            Counter("usage" if r.usage_completion_tokens is not None else "chunks" for r in ok)
        ),
        "output_tokens_as_requested": sum(r.output_tokens == r.max_tokens for r in ok),
        "output_tokens_per_request": distribution([r.output_tokens for r in ok]),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], _MS),
        "itl_ms": distribution([r.itl for r in ok if r.itl is not None], _MS),
        "e2e_ms": distribution([r.e2e for r in ok], _MS),
        "errors": dict(Counter(r.error for r in failed)),
        "error_examples": examples,
        "slo": {k: v for k, v in asdict(slo).items() if v is not None},
        "good_requests": good,
        "goodput": rate(good),
    }


def record_dict(r: RequestRecord, result: LoadResult) -> dict:
    """One request; `start_ms` counts from the measured phase's start (warm-up requests: < 0)."""

    def ms(s: float | None) -> float | None:
        return None if s is None else round(s * _MS, 3)

    return {
        "warmup": r.warmup,
        "ok": r.ok,
        "error": r.error,
        "status": r.status,
        "error_body": r.error_body,
        "start_ms": ms(r.start - result.t0) if r.start else None,  # 0: cancelled before it was sent
        "start_unix": round(result.t0_unix + r.start - result.t0, 6) if r.start else None,
        "ttft_ms": ms(r.ttft),
        "itl_ms": ms(r.itl),
        "e2e_ms": ms(r.e2e),
        "output_tokens": r.output_tokens if r.ok else None,
        "max_tokens": r.max_tokens,
        "prompt_tokens": r.prompt_tokens,
        "client_prompt_tokens": r.request.prompt_tokens,
        "chunk_times_ms": [ms(t) for t in r.chunk_times],
    }


def records(result: LoadResult) -> list[dict]:
    return [record_dict(r, result) for r in result.warmup + result.records]


def format_summary(s: dict) -> str:
    def row(name: str, d: dict) -> str:
        if not d["count"]:
            return f"  {name:<9} (none)"
        return (
            f"  {name:<9} mean {d['mean']:>9.1f}  p50 {d['p50']:>9.1f}  p90 {d['p90']:>9.1f}  "
            f"p99 {d['p99']:>9.1f}"
        )

    lines = [
        f"== {s['label']}{'  (interrupted)' if s['interrupted'] else ''} ==",
        f"  requests  {s['completed']} ok, {s['failed']} failed, {s['cancelled']} cancelled "
        f"in {s['duration_s']:.2f} s (+{s['warmup_requests']} warm-up)",
        f"  throughput {s['request_throughput']:.3f} req/s, {s['output_token_throughput']:.1f} "
        f"output tok/s, {s['input_token_throughput']:.1f} input tok/s",
        f"  goodput   {s['goodput']:.3f} req/s ({s['good_requests']} met the SLO "
        f"{s['slo'] or '(none)'})",
        "  latency (ms):",
        row("TTFT", s["ttft_ms"]),
        row("ITL", s["itl_ms"]),
        row("e2e", s["e2e_ms"]),
    ]
    if s["errors"]:
        lines.append("  errors    " + ", ".join(f"{k}: {v}" for k, v in s["errors"].items()))
        for kind, example in s["error_examples"].items():
            lines.append(f"    {kind}: {example[:200]}")
    return "\n".join(lines)
