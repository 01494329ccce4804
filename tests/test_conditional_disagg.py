"""Issue #18: conditional disaggregation on a real `pdserve up` cluster (prefill PP 1, decode PP 2)
of tiny6.

The router sends prompts shorter than --disagg-min-prompt-tokens to the decode node alone, which
prefills them itself, mixed with the streams it is decoding; longer prompts use the PD pair. Every
answer is token-identical to transformers and every route is counted by reason. The rank
consensus checker is on in every rank (PDSERVE_RANK_CONSENSUS_CHECK, tests/cluster.py).

The cluster runs with tracing off (no --otlp-traces-endpoint, the router's --debug-requests 0), so
it is also where tracing off is checked: no exporter thread, socket or span anywhere
(tests/test_tracing.py checks the same things are there with tracing on)."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest
from cluster import free_port, launched, node_args, secret_auth
from metrics_scrape import scrape, total
from reference import hf_greedy, load_hf
from tracing_checks import CLIENT_SPAN, PROMPT, TRACE, cluster_procs, outside_connections

MIN_PROMPT = 40
MAX_NEW = 10
ROUTER_ARGS = (
    f"--disagg-min-prompt-tokens {MIN_PROMPT} --disagg-local-prefill-cost 0 "
    "--disagg-decode-prefix-fraction 2 --health-interval 1 --debug-requests 0"
)


@pytest.fixture(scope="module")
def cluster(tiny6, tmp_path_factory, request):
    log, port = tmp_path_factory.mktemp("cond") / "up.log", free_port()
    args = ["--model", str(tiny6), "--port", str(port), "--prefill-pp", "1", "--decode-pp", "2"]
    args += ["--node-args", " ".join(node_args(max_running=None)), "--router-args", ROUTER_ARGS]
    with launched(args, log) as up:
        request.getfixturevalue("prompts")  # transformers' answers, computed while it loads
        proc = up.ready(timeout=240)
        yield f"http://127.0.0.1:{port}", secret_auth(log), proc


@pytest.fixture(scope="module")
def prompts(tiny6):
    """8 long prompts (disaggregated) and 4 short ones (decode-only), with their HF answers."""
    rng = random.Random(18)
    long = [[rng.randrange(3, 380) for _ in range(rng.randrange(60, 90))] for _ in range(8)]
    short = [[rng.randrange(3, 380) for _ in range(rng.randrange(4, MIN_PROMPT))] for _ in range(4)]
    model = load_hf(tiny6)
    return long, short, hf_greedy(model, long, MAX_NEW), hf_greedy(model, short, MAX_NEW)


def body(ids: list[int], max_new: int, stream: bool = False) -> dict:
    return {
        "input_ids": ids,
        "stream": stream,
        "sampling_params": {"max_tokens": max_new, "temperature": 0, "ignore_eos": True},
    }


async def generate(ac: httpx.AsyncClient, url: str, ids: list[int], max_new: int) -> list[int]:
    r = await ac.post(f"{url}/generate", json=body(ids, max_new))
    assert r.status_code == 200, r.text
    return r.json()["token_ids"]


def local_prompt_tokens(url: str, auth: httpx.Auth) -> float:
    workers = httpx.get(f"{url}/workers", auth=auth, timeout=5).json()["workers"]
    decode = next(w["url"] for w in workers if w["role"] == "decode")
    return total(scrape(decode), "pdserve_decode_local_prompt_tokens_total")


def decisions(url: str) -> dict[str, float]:
    fam = scrape(url)
    return {
        reason: total(fam, "pdserve_router_route_decisions_total", path=path, reason=reason)
        for path, reason in (("decode_only", "short_prompt"), ("disaggregated", "default"))
    }


def test_short_prompts_are_prefilled_on_the_decode_node_among_running_streams(cluster, prompts):
    """8 long prompts stream through the PD pair with 10x the tokens; 4 short prompts sent while
    they decode are prefilled by the decode node between their steps. All 12 are HF-exact."""
    url, auth, _ = cluster
    long, short, want_long, want_short = prompts
    before, local_before = decisions(url), local_prompt_tokens(url, auth)

    async def run():
        async with httpx.AsyncClient(timeout=120) as ac:
            running = [asyncio.create_task(generate(ac, url, p, 10 * MAX_NEW)) for p in long]
            await asyncio.sleep(0.5)  # the long ones are prefilled and decoding by now, mostly
            local = await asyncio.gather(*(generate(ac, url, p, MAX_NEW) for p in short))
            return await asyncio.gather(*running), local

    got_long, got_short = asyncio.run(run())
    assert [g[:MAX_NEW] for g in got_long] == want_long
    assert got_short == want_short
    after = decisions(url)
    assert after["short_prompt"] - before["short_prompt"] == len(short)
    assert after["default"] - before["default"] == len(long)
    assert local_prompt_tokens(url, auth) - local_before == sum(map(len, short))


def test_the_decode_only_route_leaves_nothing_held(cluster, prompts):
    """After decode-only requests, aborted ones included, the decode node holds no pages."""
    url, auth, _ = cluster
    _, short, _, want_short = prompts

    async def run():
        async with httpx.AsyncClient(timeout=120) as ac:
            # long answers, cut by the client while they decode
            aborted = [asyncio.create_task(generate(ac, url, p, 400)) for p in short]
            await asyncio.sleep(0.3)
            for t in aborted:
                t.cancel()
            await asyncio.gather(*aborted, return_exceptions=True)
            return await asyncio.gather(*(generate(ac, url, p, MAX_NEW) for p in short))

    assert asyncio.run(run()) == want_short
    workers = httpx.get(f"{url}/workers", auth=auth, timeout=5).json()["workers"]
    decode = next(w["url"] for w in workers if w["role"] == "decode")
    deadline = time.monotonic() + 30
    while True:
        info = httpx.get(f"{decode}/server_info", auth=auth, timeout=5).json()
        held = [r["held_pages"] for r in info["ranks"]]
        if not any(held) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(held) == 2 and not any(held), held


def test_the_router_learns_from_each_node_whether_it_keeps_prompts(cluster):
    """The decode_prefix_hit rule uses the decode node's prefix tree only if that node keeps
    finished prompts' KV: its /server_info says so (`--no-prefix-cache`: false), and the router's
    worker list shows what it learnt (the rule itself: tests/test_disagg_rules.py)."""
    url, auth, _ = cluster
    workers = httpx.get(f"{url}/workers", auth=auth, timeout=5).json()["workers"]
    for w in workers:
        info = httpx.get(f"{w['url']}/server_info", auth=auth, timeout=5).json()
        assert info["prefix_cache"] is True and w["prefix_cache"] is True, (w, info)


def test_tracing_off_has_no_exporter_thread_socket_or_spans(cluster):
    """A request under a client's traceparent, through both nodes of a cluster with tracing off:
    nothing is recorded, no node gets a trace context, no process runs an exporter thread or holds
    a socket to anything outside the cluster."""
    url, auth, proc = cluster
    before = decisions(url)
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 4}
    headers = {"traceparent": f"00-{TRACE}-{CLIENT_SPAN}-01"}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    # the PD pair served it (the prompt is longer than --disagg-min-prompt-tokens): both nodes
    # would have had the request's trace context, were tracing on
    assert decisions(url)["default"] - before["default"] == 1
    rid = r.json()["id"].split("-", 1)[1]
    listed = httpx.get(f"{url}/debug/requests", auth=auth, timeout=10).json()
    assert listed["requests"] == [] and listed["exporter"] is None
    assert not [t for t in listed["threads"] if t.startswith("Otel")]
    workers = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]
    for w in workers:
        info = httpx.get(f"{w['url']}/server_info", auth=auth, timeout=10).json()
        assert not [t for t in info["threads"] if t.startswith("Otel")], w["role"]
        spans = httpx.get(f"{w['url']}/debug/spans/{rid}", auth=auth, timeout=10)
        assert spans.status_code == 404, spans.text  # no trace context reached the node
    assert outside_connections(cluster_procs(proc)) == []
