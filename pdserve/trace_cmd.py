"""`pdserve trace [ID]`: one request's timeline from the router as a text waterfall
(docs/TRACING.md); without ID, the list of the last requests.

ID is a trace id, an attempt's rid, or the response id the client saw (chatcmpl-..., cmpl-...).
The router's /debug/requests endpoints need the cluster secret (PDSERVE_INTERNAL_TOKEN or
PDSERVE_INTERNAL_TOKEN_FILE, as every pdserve process reads it).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

WIDTH = 48  # characters of the bar column


def add_trace_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("id", nargs="?", help="trace id, rid or response id; none: list the requests")
    ap.add_argument("--router", default="http://127.0.0.1:8000", help="the router's URL")
    ap.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the router")


def trace_main(args) -> int:
    import httpx

    from pdserve.infra.cluster_secret import cluster_secret
    from pdserve.infra.request_signing import signed_auth

    auth = signed_auth(cluster_secret())  # the secret signs the request; it is never sent
    path = f"/debug/requests/{args.id}" if args.id else "/debug/requests"
    try:
        resp = httpx.get(args.router.rstrip("/") + path, auth=auth, timeout=args.timeout)
    except httpx.HTTPError as e:
        print(f"pdserve trace: cannot reach {args.router}: {e}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        print(f"pdserve trace: {resp.status_code} {_message(resp)}", file=sys.stderr)
        return 1
    body = resp.json()
    print(waterfall(body) if args.id else listing(body))
    return 0


def _message(resp) -> str:
    try:
        return resp.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return resp.text[:200]


def listing(body: dict[str, Any]) -> str:
    lines = [f"{'id':32}  {'route':22} {'status':>6} {'ms':>10}  finish"]
    for r in body.get("requests", []):
        lines.append(
            f"{r['id']:32}  {r['route']:22} {r['status'] or '-':>6} "
            f"{r['duration_ms']:>10.1f}  {r['finish_reason'] or '-'}"
        )
    return "\n".join(lines)


def waterfall(body: dict[str, Any]) -> str:
    """One line per span, in tree order (children under their parent, by start): offset and
    duration in ms from the request's start, and a bar on a common scale."""
    spans = body["spans"]
    if not spans:
        return f"trace {body['id']}: no spans"
    t0 = min(s["start_ns"] for s in spans)
    t1 = max(max(s["end_ns"], s["start_ns"]) for s in spans)
    scale = WIDTH / max(t1 - t0, 1)
    by_parent: dict[str, list[dict]] = {}
    ids = {s["span_id"] for s in spans}
    for s in spans:
        key = s["parent_id"] if s["parent_id"] in ids else ""
        by_parent.setdefault(key, []).append(s)
    out = [
        f"trace {body['id']}  {body['route']}  status {body.get('status')}  "
        f"finish {body.get('finish_reason')}  {body['duration_ms']:.1f} ms",
        f"{'span':44} {'rank':>4} {'start ms':>9} {'ms':>9}  timeline",
    ]

    def walk(parent: str, depth: int) -> None:
        for s in sorted(by_parent.get(parent, []), key=lambda s: (s["start_ns"], s["name"])):
            end = max(s["end_ns"], s["start_ns"])
            a = int((s["start_ns"] - t0) * scale)
            b = max(a + 1, int((end - t0) * scale))
            bar = " " * a + "█" * (b - a)
            rank = s["attrs"].get("pp_rank", "")
            name = ("  " * depth + s["name"])[:44]
            start_ms, dur_ms = (s["start_ns"] - t0) / 1e6, (end - s["start_ns"]) / 1e6
            out.append(f"{name:44} {rank!s:>4} {start_ms:9.2f} {dur_ms:9.2f}  {bar}")
            walk(s["span_id"], depth + 1)

    walk("", 0)
    for miss in body.get("unavailable", []):
        out.append(f"(no spans from the {miss['role']} node {miss['node']}, rid {miss['rid']})")
    return "\n".join(out)
