"""Chaos: an abort storm through a whole cluster (`pdserve up`: router + 1 prefill node + 1 decode
node).

1,000 streaming requests go through the router with a seeded mix of fates: run to the end,
cancelled before the first byte, after a few tokens, during a multi-chunk prefill, right after
the first token (the KV transfer's end), or given up by a client read timeout; chat and completions;
more in flight than the small KV pools hold, so requests queue and decodes are retracted. Afterwards
no request is left hanging, every finished answer is the transformers greedy reference, every rank
of every node holds no KV, every queue is empty, the router's and nodes' counters agree, and the
cluster still answers. Then Ctrl-C must leave no process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster import ClusterAuth, free_port, group_alive, node_args, pdserve_up
from metrics_scrape import scrape, total
from one_thread import hf_greedy_one_thread
from pd_cluster import FAST_TIMEOUTS

# (prefill PP, decode PP). One layout: prefill slices 2/2/2 against decode slices 3/3, so every
# decode rank reads from two prefill ranks and the middle prefill rank writes to both. The aligned
# layout (2, 2) is checked elsewhere: every layout (1..3)x(1..3) with aborts at every stage,
# quarantine and retraction in tests/test_inproc_pd.py; random aborts on both sides through real
# PP-2 processes in tests/test_pd_nodes.py; PP-2 pairs under streaming load and rank kills in
# tests/test_chaos_faults.py; `pdserve up` PP 2 / PP 2 and its Ctrl-C in tests/test_up.py.
LAYOUTS = [(3, 2)]
N_REQUESTS = 1000
CONCURRENCY = 48  # client requests in flight
MAX_NEW = 16  # the longest answer; references are computed this long
# Small pools (128 pages of 4 tokens) so requests queue on both nodes and decodes are retracted;
# chunk 16 so the long prompts take up to 7 prefill chunks.
NODE_ARGS = " ".join(node_args(max_total_tokens=512, max_running=None))
# Requests wait in the decode node's prealloc queue while their prefill senders bootstrap: the
# tests' 8 s KV timeouts would turn that queueing into failures.
# Quarantine stays short for the settle time.
KV_TIMEOUTS = {
    **FAST_TIMEOUTS,
    "PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "90",
    "PDSERVE_KV_WAITING_TIMEOUT_S": "90",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "30",
}
# Hang bounds. A stream silent for 60 s (httpx's read timeout) or a request alive for 120 s is a
# hang; the storm as a whole takes about 2 minutes on a busy 2-core machine and must end within 8.
STORM_BOUND_S = 480.0
REQUEST_BOUND_S = 120.0
SETTLE_S = 60.0  # quarantine (10 s in FAST_TIMEOUTS) + release votes + stats push

# Fates, with their weights in the mix.
FATES = {
    "complete": 30,
    "before_first_byte": 12,
    "after_tokens": 16,
    "during_prefill": 12,
    "after_first_token": 14,
    "client_timeout": 16,
}
ROUTES = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


# --- the cluster and the prompts ------------------------------------------------------------------


def default_sigint() -> None:
    """A shell without job control starts background jobs with SIGINT ignored;
    Ctrl-C must reach `up`."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


SECRET = "storm-cluster-secret"  # `pdserve up` takes the cluster secret from its environment
AUTH = ClusterAuth(SECRET)  # internal calls are signed with the secret


@dataclass
class Cluster:
    url: str
    proc: subprocess.Popen
    log: Path
    pp: dict[str, int]  # role -> PP size


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda lay: f"prefill{lay[0]}-decode{lay[1]}")
def cluster(request, tiny6, tmp_path_factory):
    """`pdserve up --prefill-pp P --decode-pp D` on tiny6: small pools, a short quarantine, long
    bootstrap timeouts, and the rank consensus checker on (a divergence would kill a rank)."""
    ppp, dpp = request.param
    port = free_port()
    log = tmp_path_factory.mktemp(f"storm{ppp}{dpp}") / "up.log"
    args = [
        "--model",
        str(tiny6),
        "--port",
        str(port),
        "--prefill-pp",
        str(ppp),
        "--decode-pp",
        str(dpp),
        "--node-args",
        NODE_ARGS,
        "--router-args",
        "--health-interval 1",
    ]
    env = {
        **os.environ,
        **KV_TIMEOUTS,
        "PDSERVE_LOG_LEVEL": "WARNING",
        "PDSERVE_INTERNAL_TOKEN": SECRET,
    }
    # a busy 2-core machine starts 8 or 9 processes slowly
    with pdserve_up(args, log, timeout=480, env=env, preexec_fn=default_sigint) as proc:
        yield Cluster(f"http://127.0.0.1:{port}", proc, log, {"prefill": ppp, "decode": dpp})


@dataclass
class Prompt:
    route: str  # "chat" or "completion"
    payload: dict  # the prompt part of the OpenAI body
    ids: list[int]  # what the node prefills (chat: after the template)
    ref: list[int]  # greedy reference, MAX_NEW tokens
    ref_text: list[str]  # ref_text[n]: decoded text of the first n reference tokens

    @property
    def long(self) -> bool:
        return len(self.ids) > 32  # at least three prefill chunks


@pytest.fixture(scope="module")
def prompts(tiny6) -> list[Prompt]:
    """24 distinct prompts (12 completions as token ids, 12 chats), reused by the whole storm."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny6))
    rng = random.Random(2024)
    out = []
    for n in (3, 5, 8, 12, 17, 23, 31, 40, 52, 64, 80, 100):
        ids = [rng.randrange(3, len(tok)) for _ in range(n)]
        out.append(Prompt("completion", {"prompt": ids}, ids, [], []))
    # fmt: off
    words = [
        "the", "cache", "page", "prefill", "decode", "rank", "router", "slot", "layer", "token",
        "pipeline", "transfer",
    ]
    # fmt: on
    for n in (1, 2, 3, 5, 8, 12, 16, 20, 24, 30, 36, 44):
        q = " ".join(rng.choice(words) for _ in range(n))
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(Prompt("chat", {"messages": [{"role": "user", "content": q}]}, ids, [], []))
    refs = hf_greedy_one_thread(tiny6, [p.ids for p in out], MAX_NEW)
    for p, ref in zip(out, refs, strict=True):
        p.ref = ref
        p.ref_text = [tok.decode(ref[:n], skip_special_tokens=True) for n in range(MAX_NEW + 1)]
    assert sum(p.long for p in out) >= 8
    return out


# --- one request of the storm ---------------------------------------------------------------------


@dataclass
class Plan:
    i: int
    fate: str
    prompt: int
    max_tokens: int
    logprobs: bool  # token ids come back in the logprobs entries
    delay_s: float = 0.0  # before_first_byte / during_prefill: cancel after this
    after_tokens: int = 0  # after_tokens: close the stream once this many arrived
    read_timeout_s: float = 0.0  # client_timeout: httpx read timeout


@dataclass
class Outcome:
    plan: Plan
    end: str = ""  # completed | cancelled | gave_up | http_<status> | stream_error | hang
    sent: bool = False  # the whole request went out (so the router must count it)
    status: int | None = None
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    error: str = ""
    seconds: float = 0.0


def make_plans(prompts: list[Prompt], seed: int) -> list[Plan]:
    rng = random.Random(seed)
    names, weights = list(FATES), list(FATES.values())
    long_ones = [i for i, p in enumerate(prompts) if p.long]
    plans = []
    for i in range(N_REQUESTS):
        fate = rng.choices(names, weights)[0]
        prompt = rng.choice(long_ones) if fate == "during_prefill" else rng.randrange(len(prompts))
        plan = Plan(i, fate, prompt, rng.randint(4, MAX_NEW), logprobs=rng.random() < 0.5)
        if fate == "before_first_byte":
            plan.delay_s = rng.uniform(0.0, 0.03)
        elif fate == "during_prefill":
            plan.delay_s = rng.uniform(0.02, 0.6)
        elif fate == "after_tokens":
            plan.after_tokens = rng.randint(2, 4)
        elif fate == "client_timeout":
            plan.read_timeout_s = rng.uniform(0.05, 1.5)
        plans.append(plan)
    return plans


def chunk_tokens(chunk: dict) -> tuple[list[int] | None, str, str | None]:
    """(token ids from the logprobs entries or None, text, finish_reason) of one OpenAI SSE
    chunk."""
    choice = chunk["choices"][0]
    lp = choice.get("logprobs")
    ids = None
    if lp is not None:
        names = [e["token"] for e in lp["content"]] if "content" in lp else lp["tokens"]
        ids = [int(t.removeprefix("token_id:")) for t in names]
    text = (
        (choice["delta"].get("content") or "") if "delta" in choice else (choice.get("text") or "")
    )
    return ids, text, choice.get("finish_reason")


def _request_body(model: str, prompt: Prompt, plan: Plan) -> dict:
    """The streamed greedy OpenAI body of one planned request (token ids in logprobs if asked)."""
    body = {
        "model": model,
        **prompt.payload,
        "max_tokens": plan.max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    if plan.logprobs:
        body["logprobs"] = True if prompt.route == "chat" else 0
        body["return_tokens_as_token_ids"] = True  # tokens as "token_id:<id>"
    return body


async def _record_error_body(r: httpx.Response, out: Outcome) -> None:
    """A non-200 answer: its status as the end, and its OpenAI error message."""
    raw = await r.aread()
    out.end = f"http_{r.status_code}"
    try:
        out.error = json.loads(raw)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        out.error = f"not an OpenAI error body: {raw[:200]!r}"


async def _read_sse(r: httpx.Response, out: Outcome, cancel_at: int | None) -> None:
    """Reads a 200 answer's SSE stream into `out`; returns early (the caller then closes the
    socket mid-stream) once `cancel_at` chunks carried tokens."""
    pieces = 0  # chunks that carried tokens
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            if out.end != "stream_error":
                out.end = "completed" if out.finish_reason else "stream_error"
                out.error = "" if out.finish_reason else "[DONE] without a finish_reason"
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            out.end, out.error = "stream_error", str(chunk["error"].get("message"))
            continue
        if not chunk.get("choices"):
            continue
        ids, text, reason = chunk_tokens(chunk)
        out.text += text
        if ids:
            out.tokens.extend(ids)
        out.finish_reason = reason or out.finish_reason
        pieces += bool(ids or text)
        if cancel_at and pieces >= cancel_at:
            out.end = "cancelled"
            return  # the caller then leaves its block, which closes the socket mid-stream
    out.end = out.end or "stream_error"
    out.error = out.error or "the stream ended without [DONE]"


async def one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: Prompt, plan: Plan
) -> Outcome:
    out = Outcome(plan)
    body = _request_body(model, prompt, plan)
    timeout = (
        httpx.Timeout(60.0, read=plan.read_timeout_s)
        if plan.read_timeout_s
        else httpx.Timeout(60.0)
    )
    cancel_at = {"after_first_token": 1, "after_tokens": plan.after_tokens}.get(plan.fate)
    t0 = time.monotonic()

    async def trace(event: str, _info: dict) -> None:
        if event == "http11.send_request_body.complete":
            out.sent = True

    async def read() -> None:
        async with client.stream(
            "POST",
            f"{url}{ROUTES[prompt.route]}",
            json=body,
            timeout=timeout,
            extensions={"trace": trace},
        ) as r:
            out.status = r.status_code
            if r.status_code != 200:
                await _record_error_body(r, out)
                return
            await _read_sse(r, out, cancel_at)

    try:
        async with asyncio.timeout(REQUEST_BOUND_S):
            if plan.delay_s:
                try:
                    async with asyncio.timeout(plan.delay_s):
                        await read()
                except TimeoutError:
                    out.end = "cancelled"
            else:
                await read()
    except httpx.TimeoutException:
        out.end = "gave_up" if plan.read_timeout_s else "hang"
        out.error = "client read timeout"
    except TimeoutError:
        out.end, out.error = "hang", f"no end within {REQUEST_BOUND_S:.0f} s"
    except httpx.HTTPError as e:
        out.end, out.error = "transport_error", f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0
    return out


QUEUE_NAMES = ("bootstrap", "waiting", "inflight", "prealloc", "transfer", "running", "retracted")


async def watch_queues(
    nodes: dict[str, str], peak: dict[str, dict[str, int]], stop: asyncio.Event
) -> None:
    """The longest queue seen on each node's PP0 (its stats, pushed twice a second)."""
    async with httpx.AsyncClient(timeout=10, auth=AUTH) as c:
        while not stop.is_set():
            for role, node in nodes.items():
                try:
                    rank0 = (await c.get(f"{node}/server_info")).json()["ranks"][0] or {}
                except httpx.TransportError:
                    # A failed poll fails only this side watch (seen with 3 xdist workers: "server
                    # disconnected without sending a response" on a reused connection). The
                    # storm's own requests and the checks after it say whether the node is well.
                    continue
                for q in QUEUE_NAMES:
                    peak[role][q] = max(peak[role].get(q, 0), rank0.get(q, 0))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.5)


async def run_storm(
    url: str, model: str, prompts: list[Prompt], plans: list[Plan], nodes: dict[str, str]
) -> tuple[list[Outcome], dict[str, dict[str, int]]]:
    sem = asyncio.Semaphore(CONCURRENCY)
    limits = httpx.Limits(max_connections=CONCURRENCY * 2, max_keepalive_connections=CONCURRENCY)
    peak: dict[str, dict[str, int]] = {role: {} for role in nodes}
    stop = asyncio.Event()

    async def gated(client, plan):
        async with sem:
            return await one_request(client, url, model, prompts[plan.prompt], plan)

    watcher = asyncio.create_task(watch_queues(nodes, peak, stop))
    try:
        async with httpx.AsyncClient(limits=limits) as client:
            async with asyncio.timeout(STORM_BOUND_S):
                outcomes = await asyncio.gather(*(gated(client, p) for p in plans))
    finally:
        stop.set()
        await watcher
    return outcomes, peak


# --- reading the cluster's state ------------------------------------------------------------------


def node_urls(url: str) -> dict[str, str]:
    return {
        w["role"]: w["url"]
        for w in httpx.get(f"{url}/workers", auth=AUTH, timeout=10).json()["workers"]
    }


def idle_state(nodes: dict[str, str]) -> dict[str, dict]:
    """What must be zero on an idle cluster, per node: KV per rank (the metric, and the rank's own
    count of held pages: every allocated page that is not an unlocked prefix-cache page, so a
    leaked page shows too), prefix-cache pages a request still locks, queue lengths, front
    requests."""
    got = {}
    for role, node in nodes.items():
        m = scrape(node)
        info = httpx.get(f"{node}/server_info", auth=AUTH, timeout=10).json()
        got[role] = {
            "kv_used_tokens": [
                v
                for _, v in sorted(
                    m["pdserve_kv_pool_used_tokens"], key=lambda s: int(s[0]["pp_rank"])
                )
            ],
            "queues": {
                f"pp{lab['pp_rank']}:{lab['queue']}": v
                for lab, v in m["pdserve_queue_requests"]
                if v
            },
            "quarantine": [r.get("quarantine", 0) for r in info["ranks"]],
            "held_pages": [r["held_pages"] for r in info["ranks"]],
            "locked_cached_pages": [r["locked_cached_pages"] for r in info["ranks"]],
            "front_pending": info["load"]["in_flight"],
            "ranks": len(info["ranks"]),
        }
    return got


def is_idle(state: dict[str, dict], pp: dict[str, int]) -> bool:
    return all(
        len(s["kv_used_tokens"]) == pp[role]
        and not any(s["kv_used_tokens"])
        and not s["queues"]
        and not any(s["quarantine"])
        and not any(s["held_pages"])
        and not any(s["locked_cached_pages"])
        and s["front_pending"] == 0
        for role, s in state.items()
    )


# --- the storm -----------------------------------------------------------------------------------


@dataclass
class Storm:
    outcomes: list[Outcome]
    wall_s: float
    settle_s: float
    idle: dict[str, dict]  # idle_state() after the settle time
    peak_queues: dict[str, dict[str, int]]  # role -> queue -> longest seen on PP0 during the storm
    router: tuple[dict, dict]  # the router's metrics before and after
    nodes: dict[str, tuple[dict, dict]]  # role -> the node's metrics before and after
    retractions: int  # on decode PP0


@pytest.fixture(scope="module")
def storm(cluster, prompts) -> Storm:
    url, pp = cluster.url, cluster.pp
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    nodes = node_urls(url)
    router_before, nodes_before = scrape(url), {role: scrape(n) for role, n in nodes.items()}
    plans = make_plans(prompts, seed=pp["prefill"] * 10 + pp["decode"])
    t0 = time.monotonic()
    outcomes, peak = asyncio.run(run_storm(url, model, prompts, plans, nodes))
    wall = time.monotonic() - t0
    t1 = time.monotonic()
    while True:
        idle = idle_state(nodes)
        if is_idle(idle, pp) or time.monotonic() - t1 > SETTLE_S:
            break
        time.sleep(0.5)
    settle = time.monotonic() - t1
    retractions = httpx.get(f"{nodes['decode']}/server_info", auth=AUTH, timeout=10).json()[
        "ranks"
    ][0]["retractions"]
    result = Storm(
        outcomes,
        wall,
        settle,
        idle,
        peak,
        (router_before, scrape(url)),
        {role: (nodes_before[role], scrape(n)) for role, n in nodes.items()},
        retractions,
    )
    by_fate = Counter(f"{o.plan.fate}->{o.end}" for o in outcomes)
    print(
        f"\nstorm prefill PP {pp['prefill']} / decode PP {pp['decode']}: {len(outcomes)} requests "
        f"in {wall:.1f} s, idle after {settle:.1f} s, decode retractions {retractions}, "
        f"load {os.getloadavg()}\n  longest queues on PP0: {peak}"
        f"\n  ends: {dict(Counter(o.end for o in outcomes))}\n  by fate: "
        f"{dict(sorted(by_fate.items()))}"
    )
    return result


def test_every_request_ends_and_every_answer_is_the_reference(storm, prompts):
    outs = storm.outcomes
    assert len(outs) == N_REQUESTS
    hangs = [o for o in outs if o.end in ("hang", "")]
    assert not hangs, [(o.plan, o.status, o.error, o.text, round(o.seconds)) for o in hangs[:5]]
    # No request we did not cancel may fail: the nodes are healthy, only clients misbehave.
    failed = [o for o in outs if o.end not in ("completed", "cancelled", "gave_up")]
    assert not failed, Counter((o.plan.fate, o.end, o.error[:120]) for o in failed).most_common(10)
    for o in outs:
        p, plan = prompts[o.plan.prompt], o.plan
        want = p.ref[: plan.max_tokens]
        # Whatever arrived, even from a cancelled request, is the start of the reference.
        assert o.tokens == want[: len(o.tokens)], (plan, o.tokens, want)
        assert p.ref_text[plan.max_tokens].startswith(o.text), (
            plan,
            o.text,
            p.ref_text[plan.max_tokens],
        )
        if o.end == "completed":
            assert o.finish_reason == "length", (plan, o.finish_reason)
            assert o.text == p.ref_text[plan.max_tokens], (plan, o.text)
            assert o.tokens == (want if plan.logprobs else []), (plan, o.tokens, want)
    ends = Counter(o.end for o in outs)
    # The mix really happened: answers ran to the end, and every kind of cancellation landed.
    assert ends["completed"] >= N_REQUESTS // 5 and ends["cancelled"] >= N_REQUESTS // 5, ends
    assert ends["gave_up"] >= 10, ends
    for fate in ("before_first_byte", "during_prefill"):
        assert any(
            o.plan.fate == fate and o.status is None and o.end == "cancelled" for o in outs
        ), fate
    for fate in ("after_tokens", "after_first_token"):
        assert any(
            o.plan.fate == fate and (o.tokens or o.text) and o.end == "cancelled" for o in outs
        ), fate


def test_kv_pools_and_queues_are_empty_on_every_rank(storm, cluster):
    """After the settle time: no KV held on any rank of any node, no queued request,
    no front request."""
    for role, s in storm.idle.items():
        assert s["ranks"] == cluster.pp[role], (role, s)
        assert len(s["kv_used_tokens"]) == cluster.pp[role] and not any(s["kv_used_tokens"]), (
            role,
            s,
        )
        assert not s["queues"] and not any(s["quarantine"]), (role, s)
        assert len(s["held_pages"]) == cluster.pp[role] and not any(s["held_pages"]), (role, s)
        assert not any(s["locked_cached_pages"]), (role, s)  # an unlock missed on an abort path
        assert s["front_pending"] == 0, (role, s)


def test_the_storm_made_the_cluster_queue_and_retract(storm):
    """The small pools really were under pressure (otherwise the storm tests less than it claims):
    decodes were retracted, requests waited for decode pages (prealloc) and so did their prefill
    senders (bootstrap: the decode side registers only once it has the pages)."""
    assert storm.retractions > 0
    peak = storm.peak_queues
    assert peak["decode"]["prealloc"] > 1 and peak["prefill"]["bootstrap"] > 1, peak


def test_router_and_node_counters_agree(storm, cluster, prompts):
    outs = storm.outcomes
    rb, ra = storm.router
    for kind, route in ROUTES.items():
        mine = [o for o in outs if prompts[o.plan.prompt].route == kind]
        statuses = {lab["status"] for lab, _ in ra.get("pdserve_router_requests_total", [])}
        d = {
            st: total(ra, "pdserve_router_requests_total", route=route, status=st)
            - total(rb, "pdserve_router_requests_total", route=route, status=st)
            for st in statuses
        }
        # Every request that went out whole was recorded once
        # (one cancelled while being sent may not be).
        sent = sum(o.sent for o in mine)
        assert sent <= sum(d.values()) <= len(mine), (kind, d, sent, len(mine))
        completed = sum(o.end == "completed" for o in mine)
        left_mid_stream = sum(o.end != "completed" and o.status == 200 for o in mine)
        assert completed <= d.get("200", 0) <= completed + left_mid_stream, (kind, d, completed)
        # Valid requests, healthy nodes: the router answered or saw the client leave, nothing else.
        assert {st for st, n in d.items() if n} <= {"200", "499"}, (kind, d)
    # The decode node finished (length) at least every request the router answered in full, and the
    # prefill node handed over (prefill_done) at least as many.
    router_ok = sum(
        total(ra, "pdserve_router_requests_total", route=r, status="200")
        - total(rb, "pdserve_router_requests_total", route=r, status="200")
        for r in ROUTES.values()
    )
    delta = {
        role: {
            reason: total(a, "pdserve_requests_total", finish_reason=reason)
            - total(b, "pdserve_requests_total", finish_reason=reason)
            for reason in ("length", "prefill_done", "abort")
        }
        for role, (b, a) in storm.nodes.items()
    }
    assert (
        delta["decode"]["length"] >= router_ok and delta["prefill"]["prefill_done"] >= router_ok
    ), (delta, router_ok)
    # Nothing is left in flight at the router, and no node was marked unhealthy.
    workers = httpx.get(f"{cluster.url}/workers", auth=AUTH, timeout=10).json()["workers"]
    assert all(w["in_flight"] == 0 and w["healthy"] for w in workers), workers


def test_no_unhandled_error_in_any_log(storm, cluster):
    """Client cancellations are routine: no process of the cluster may log a traceback for one."""
    lines = cluster.log.read_text(errors="replace").splitlines()
    bad = [
        i
        for i, ln in enumerate(lines)
        if "Traceback" in ln or "unhandled error" in ln or " ERROR " in ln
    ]
    assert not bad, "\n---\n".join("\n".join(lines[i : i + 40]) for i in bad[:3])


def test_cluster_still_answers_correctly(storm, cluster, prompts):
    model = httpx.get(f"{cluster.url}/v1/models", timeout=10).json()["data"][0]["id"]
    longest = {
        route: max((p for p in prompts if p.route == route), key=lambda p: len(p.ids))
        for route in ROUTES
    }
    for p in longest.values():
        body = {
            "model": model,
            **p.payload,
            "max_tokens": MAX_NEW,
            "temperature": 0,
            "ignore_eos": True,
        }
        r = httpx.post(f"{cluster.url}{ROUTES[p.route]}", json=body, timeout=60)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        text = choice["message"]["content"] if p.route == "chat" else choice["text"]
        assert text == p.ref_text[MAX_NEW] and choice["finish_reason"] == "length"


def test_ctrl_c_leaves_no_process(storm, cluster):
    """Runs last: SIGINT to `pdserve up` stops the router, both nodes, the rank zygote and every
    rank."""
    up_router_nodes_zygote = 1 + 1 + 2 + 1
    alive = group_alive(cluster.proc.pid, wait_s=0)
    assert len(alive) == up_router_nodes_zygote + sum(cluster.pp.values())
    cluster.proc.send_signal(signal.SIGINT)
    assert cluster.proc.wait(timeout=60) == 0, cluster.log.read_text()[-2000:]
    assert group_alive(cluster.proc.pid) == [], "processes left behind after Ctrl-C"
