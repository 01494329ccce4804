"""Traces across a real cluster (docs/TRACING.md): `pdserve up` at PD layout (2, 3) exporting to an
in-process OTLP/HTTP receiver (tests/otlp_receiver.py). One request under a client's traceparent is
one trace with every stage, one tree, nested times; the router's /debug/requests shows it (internal
token) and `pdserve trace ID` prints it. With tracing off there is no exporter thread or socket:
tests/test_conditional_disagg.py checks that on its cluster, which runs with tracing off."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest
from cluster import ROOT, node_args, up
from otlp_receiver import OtlpReceiver
from tracing_checks import CLIENT_SPAN, PROMPT, TRACE, cluster_procs, outside_connections

NODE_ARGS = " ".join(node_args())
ROUTER = {"router.request", "router.admission_queue", "router.attempt"}
NODES = {"prefill.request", "decode.request"}
PREFILL_RANK = {"bootstrap", "bootstrap.handshake", "bootstrap.wait_decode_alloc", "waiting"}
PREFILL_RANK = {f"prefill.{n}" for n in PREFILL_RANK | {"chunk", "kv_transfer", "release_vote"}}
PREFILL_RANK |= {"prefill.finish"}
DECODE_RANK = {"decode.prealloc", "decode.transferred_vote", "decode.first_token"}
DECODE_RANK |= {"decode.decode", "decode.finish"}
EXPORTER_THREAD = "OtelBatchSpanRecordProcessor"
SHORT_PROMPT = 8


def _complete(spans: list[dict]) -> bool:
    names = {s["name"] for s in spans}
    if not names >= ROUTER | NODES | PREFILL_RANK | DECODE_RANK:
        return False
    ranks = lambda names, n: all(  # noqa: E731
        {s["attrs"].get("pp_rank") for s in spans if s["name"] == name} == set(range(n))
        for name in names
    )
    return ranks(PREFILL_RANK, 2) and ranks(DECODE_RANK, 3)


@pytest.fixture(scope="module")
def traced(tiny6, tmp_path_factory):
    """A (2, 3) cluster exporting to the receiver, and one streamed completion under a client's
    traceparent: (router url, signing auth, response id, the trace's exported spans, log)."""
    log = tmp_path_factory.mktemp("tracing") / "up.log"
    with OtlpReceiver() as rx:
        args = ["--prefill-pp", "2", "--decode-pp", "3", "--node-args", NODE_ARGS]
        # prompts under 8 tokens are prefilled on the decode node (the tests' default: never)
        router = f"--health-interval 1 --disagg-min-prompt-tokens {SHORT_PROMPT}"
        args += ["--router-args", router, "--otlp-traces-endpoint", rx.url]
        with up(tiny6, log, args) as (url, proc, auth):
            model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
            body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "stream": True}
            body["temperature"] = 0
            headers = {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}
            with httpx.stream(
                "POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120
            ) as r:
                assert r.status_code == 200
                lines = [x for x in r.iter_lines() if x.startswith("data: {")]
            rid = json.loads(lines[0][6:])["id"]
            spans = rx.wait_for(TRACE, _complete)
            print(f"\none PD request at (2, 3): {len(spans)} spans exported")
            yield url, auth, rid, spans, proc, rx


def test_one_request_is_one_trace_with_every_stage(traced):
    _, _, _, spans, _, _ = traced
    names = {s["name"] for s in spans}
    missing = (ROUTER | NODES | PREFILL_RANK | DECODE_RANK) - names
    assert not missing, f"stages missing from the trace: {sorted(missing)}"
    assert _complete(spans), "a rank's stage is missing"
    by_id = {s["span_id"]: s for s in spans}
    assert len(by_id) == len(spans), "span ids repeat"
    (root,) = [s for s in spans if s["name"] == "router.request"]
    assert root["parent_id"] == CLIENT_SPAN, "the client's traceparent is the root's parent"
    for s in spans:
        if s is root:
            continue
        assert s["parent_id"] in by_id, f"{s['name']} hangs on a span not in the trace"
        p, hops = s, 0
        while p is not root:  # one tree: every span reaches the root
            p, hops = by_id[p["parent_id"]], hops + 1
            assert hops < 10
        parent = by_id[s["parent_id"]]
        assert parent["start_ns"] <= s["start_ns"] <= s["end_ns"], (s["name"], parent["name"])
        if parent["service"] == s["service"]:
            assert s["end_ns"] <= parent["end_ns"], f"{s['name']} outlasts {parent['name']}"
    for s in spans:
        if s["name"] in ("prefill.request", "decode.request"):
            assert by_id[s["parent_id"]]["name"] == "router.attempt"
        if s["name"].startswith("prefill.bootstrap."):
            assert by_id[s["parent_id"]]["name"] == "prefill.bootstrap"
        if s["name"] == "prefill.kv_transfer":
            assert s["attrs"]["bytes"] > 0 and s["attrs"]["descriptors"] > 0, s
    for rank in (0, 1):
        chunks = [
            s for s in spans if s["name"] == "prefill.chunk" and s["attrs"]["pp_rank"] == rank
        ]
        assert len(chunks) >= 2, f"prefill pp{rank}: {len(chunks)} chunk spans"
    (attempt,) = [s for s in spans if s["name"] == "router.attempt"]
    assert "first_token" in attempt["events"]
    assert (attempt["attrs"]["path"], attempt["attrs"]["reason"]) == ("disaggregated", "default")
    finishes = [s for s in spans if s["name"] == "decode.finish"]
    assert {s["attrs"]["finish_reason"] for s in finishes} <= {"length", "stop"}
    assert root["attrs"]["finish_reason"] == finishes[0]["attrs"]["finish_reason"]
    assert {s["service"] for s in spans} == {"pdserve-router", "pdserve-prefill", "pdserve-decode"}


def test_debug_requests_and_pdserve_trace(traced):
    url, auth, rid, spans, _, _ = traced
    assert httpx.get(f"{url}/debug/requests", timeout=10).status_code == 401
    assert httpx.get(f"{url}/debug/requests/{TRACE}", timeout=10).status_code == 401
    listed = httpx.get(f"{url}/debug/requests", auth=auth, timeout=10).json()
    assert TRACE in [r["id"] for r in listed["requests"]]
    one = httpx.get(f"{url}/debug/requests/{rid}", auth=auth, timeout=10)
    assert one.status_code == 200, one.text
    got = one.json()
    assert got["id"] == TRACE and not got["unavailable"]
    stages = {(s["name"], s["attrs"].get("pp_rank")) for s in got["spans"]}
    assert stages == {(s["name"], s["attrs"].get("pp_rank")) for s in spans}
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=auth.secret)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "trace", rid, "--router", url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"trace {TRACE}")
    for name in ROUTER | NODES | PREFILL_RANK | DECODE_RANK:
        assert any(line.strip().startswith(name + " ") for line in lines), name
    assert "█" in out.stdout
    env.pop("PDSERVE_INTERNAL_TOKEN")
    env.pop("PDSERVE_INTERNAL_TOKEN_FILE", None)
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "trace", rid, "--router", url],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 1 and "401" in out.stderr


def test_exporter_thread_and_socket_exist_when_on(traced):
    """The positive control of tests/test_conditional_disagg.py's tracing-off test (its cluster
    runs with tracing off): what that test looks for is there when tracing is on."""
    url, auth, _, _, proc, rx = traced
    listed = httpx.get(f"{url}/debug/requests", auth=auth, timeout=10).json()
    assert EXPORTER_THREAD in listed["threads"] and listed["exporter"]
    workers = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]
    for w in workers:
        info = httpx.get(f"{w['url']}/server_info", auth=auth, timeout=10).json()
        assert EXPORTER_THREAD in info["threads"], w["role"]
    outside = outside_connections(cluster_procs(proc))
    assert any(raddr.port == rx.port for _, raddr in outside), outside


@pytest.mark.parametrize(
    "missing", ["opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http.trace_exporter"]
)
def test_tracing_without_the_extra_says_what_to_install(monkeypatch, missing):
    """The SDK and its exporter are the `tracing` extra: asked for without them, the exporter
    says which extra to install."""
    from pdserve.infra.tracing import make_exporter

    for name in [m for m in sys.modules if m.startswith("opentelemetry")]:  # none imported yet
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'pdserve\[tracing\]'"):
        make_exporter("http://127.0.0.1:1", "router")


def test_a_decode_local_request_traces_its_wait_and_prompt_chunks(traced):
    """A prompt short enough to be prefilled on the decode node (`short_prompt`; token ids, so
    the router's count is exact) shows that
    prefill too: each decode rank's wait and its prompt chunks, whose tokens add up to the prompt;
    the router's admission span names the tenant."""
    url, _, _, _, _, rx = traced
    trace = "5cf92f3577b34da6a3ce929d0e0e4737"
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {
        "model": model,
        "prompt": list(range(11, 11 + SHORT_PROMPT - 3)),
        "max_tokens": 3,
        "temperature": 0,
    }
    headers = {"traceparent": f"00-{trace}-{CLIENT_SPAN}-01"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    stages = {(f"decode.{n}", rank) for n in ("waiting", "chunk", "finish") for rank in range(3)}
    stages |= {("router.admission_queue", None), ("router.attempt", None)}  # exported apart
    seen = lambda spans: {(s["name"], s["attrs"].get("pp_rank")) for s in spans}  # noqa: E731
    spans = rx.wait_for(trace, lambda spans: seen(spans) >= stages)
    assert seen(spans) >= stages, (
        f"missing: {sorted(stages - seen(spans))} of {sorted(seen(spans), key=str)}"
    )
    assert not [s["name"] for s in spans if s["name"].startswith("prefill.")], "not decode-local"
    for rank in range(3):
        chunks = [s for s in spans if s["name"] == "decode.chunk" and s["attrs"]["pp_rank"] == rank]
        assert sum(s["attrs"]["tokens"] for s in chunks) == prompt_tokens, (rank, chunks)
        (wait,) = [
            s for s in spans if s["name"] == "decode.waiting" and s["attrs"]["pp_rank"] == rank
        ]
        assert wait["end_ns"] <= min(s["start_ns"] for s in chunks)
    (admission,) = [s for s in spans if s["name"] == "router.admission_queue"]
    assert admission["attrs"]["tenant"] == "anonymous"
    (attempt,) = [s for s in spans if s["name"] == "router.attempt"]
    assert (attempt["attrs"]["path"], attempt["attrs"]["reason"]) == ("decode_only", "short_prompt")
    assert attempt["attrs"]["predicted_ttft_ms"] > 0
