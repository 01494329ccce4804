"""Chaos: faults injected into a real PD cluster while streaming clients keep it busy.

Router + prefill P1 (PP 2) and P2 (PP 1) + decode D1 (PP 2) and D2 (PP 1), every one a real
`pdserve` process group on loopback with the tests' fast KV timeouts. Streaming clients send greedy
requests whose tokens transformers gives. Faults, one per test: the router told a wrong bootstrap
port for P2, a D1 rank SIGKILLed while requests decode, a P1 rank SIGSTOPped mid-transfer for longer
than the transfer timeout and then continued, a P1 rank SIGKILLed mid-transfer. Every request must
end in exactly the reference tokens or in a clear error (an HTTP error body or an SSE error event,
never a 200 with other tokens, not even a wrong partial stream), within its timeout; the router must
route around the fault; a killed node must report unhealthy and stop its other ranks, and a fresh
node on the same port must be taken back into service. Each test leaves the cluster whole: every
node healthy in the router, no request in flight, no KV page held.
docs/RELIABILITY.md has the numbers.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from cluster import (
    NODE_ARGS,
    free_port,
    group_alive,
    group_members,
    held_port,
    start,
    wait_healthy,
)
from metrics_scrape import counter
from one_thread import one_torch_thread
from pd_cluster import FAST_TIMEOUTS, wait_pages_free
from reference import hf_greedy, load_hf

STALL_S = 9.5  # SIGSTOP length: longer than PDSERVE_KV_TRANSFER_TIMEOUT_S (8 s)
QUARANTINE_S = 15.0  # a failed room's decode pages outlast the stall (a stalled write resumes)
ENV = {**FAST_TIMEOUTS, "PDSERVE_KV_QUARANTINE_S": str(QUARANTINE_S)}
ROUTER_ARGS = [
    "--health-interval",
    "0.5",
    "--health-timeout",
    "2",
    "--health-failure-threshold",
    "2",
    "--health-success-threshold",
    "2",
    "--decode-policy",
    "round_robin",
    "--request-timeout",
    "40",
    "--stream-idle-timeout",
    "30",
    "--cb-open-seconds",
    "5",
    "--log-level",
    "warning",
]
CLIENT_TIMEOUT_S = 90.0  # one request, send to last byte: a hang fails the test
CLIENTS = 4

_rng = random.Random(21)
SHORT = [[_rng.randrange(3, 380) for _ in range(n)] for n in (5, 9, 17, 24, 33, 40, 12, 28)]
SHORT_NEW = (
    120  # long enough that what D1 decodes (its stats come twice a second) outlasts the kill
)
# Long prompts, 24 of their own per prefill-fault test: the test waits for P1's rank 1 to be seen
# (its stats come twice a second) in a chunked prefill, which only a prompt no node has cached takes
# (a cached one prefills its last chunk only), and cache_aware gives new prompts to the prefill node
# holding the least text until the other catches up, so the first few may all go to P2.
LONG_LENGTHS = [240 + 10 * (i * 7 % 19) for i in range(24)]  # 240 to 420 tokens
LONG = [[_rng.randrange(3, 380) for _ in range(n)] for n in LONG_LENGTHS]  # the stall
LONG_KILL = [[_rng.randrange(3, 380) for _ in range(n)] for n in LONG_LENGTHS]  # the SIGKILL
LONG_NEW = 4  # 15 to 27 chunks of 16 tokens: transfers are in flight for a while
FRESH = [[_rng.randrange(3, 380) for _ in range(n)] for n in (21, 26, 31, 36, 22, 27, 32, 37)]
FRESH_NEW = 8  # prompts no node has seen, so cache_aware spreads them over both prefill nodes


class References:
    """transformers' greedy answers, `refs[kind][i]` for prompt i of PROMPTS[kind]. Computed in a
    thread, kind by kind in the order the tests need them, from when the nodes start loading: the
    first test needs only its own kind (`refs[kind]` waits for that one)."""

    ORDER = ("fresh", "short", "long", "long_kill")

    def __init__(self, model_path: Path):
        self._refs = {kind: Future() for kind in self.ORDER}
        self._thread = threading.Thread(target=self._compute, args=(model_path,), daemon=True)
        self._thread.start()

    def _compute(self, model_path: Path) -> None:
        try:
            # a tiny model: more threads only spin against the nodes' ranks
            with one_torch_thread():
                model = load_hf(model_path)
                for kind in self.ORDER:
                    prompts, max_new = PROMPTS[kind]
                    self._refs[kind].set_result(hf_greedy(model, prompts, max_new))
        except BaseException as e:
            for ref in self._refs.values():
                if not ref.done():
                    ref.set_exception(e)

    def __getitem__(self, kind: str) -> list[list[int]]:
        return self._refs[kind].result(timeout=600)

    def join(self) -> None:
        self._thread.join(timeout=600)


# --- the cluster ----------------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    role: str
    pp: int
    port: int
    bport: int | None = None  # prefill: the bootstrap server's port
    proc: subprocess.Popen | None = None
    starts: int = 0
    stack: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class Chaos:
    def __init__(self, model: Path, tmp: Path):
        self.model, self.tmp = model, tmp
        self.holds = contextlib.ExitStack()  # every port here, until every process has stopped
        port = functools.partial(held_port, self.holds)
        self.nodes = {
            n.name: n
            for n in (
                Node("p1", "prefill", 2, port(), bport=port()),
                Node("p2", "prefill", 1, port(), bport=port()),
                Node("d1", "decode", 2, port()),
                Node("d2", "decode", 1, port()),
            )
        }
        self.router_port = port()
        self.router = f"http://127.0.0.1:{self.router_port}"
        self.stack = contextlib.ExitStack()
        self.refs: References | None = None

    def log(self, node: Node) -> Path:
        return self.tmp / f"{node.name}-{node.starts}.log"

    def launch(self, node: Node) -> None:
        """`pdserve prefill|decode` on the node's fixed port (and bootstrap port), not waiting."""
        cmd = [
            node.role,
            "--model",
            str(self.model),
            "--pp",
            str(node.pp),
            "--port",
            str(node.port),
            *NODE_ARGS,
        ]
        if node.bport:
            cmd += ["--bootstrap-port", str(node.bport)]
        node.starts += 1
        node.stack = contextlib.ExitStack()
        _, node.proc = node.stack.enter_context(
            start(cmd, node.port, self.log(node), env=ENV, wait=False)
        )

    def wait_node(self, node: Node) -> None:
        wait_healthy(node.url, node.proc, 240, self.log(node))

    def __enter__(self) -> Chaos:
        try:
            for node in self.nodes.values():
                self.launch(node)
            p1, p2, d1, d2 = self.nodes.values()
            cmd = [
                "router",
                "--port",
                str(self.router_port),
                "--prefill",
                p1.url,
                str(p1.bport),
                "--prefill",
                p2.url,
                str(p2.bport),
                "--decode",
                d1.url,
                "--decode",
                d2.url,
                *ROUTER_ARGS,
            ]
            _, router = self.stack.enter_context(
                start(cmd, self.router_port, self.tmp / "router.log", wait=False)
            )
            self.refs = References(self.model)  # while the nodes load
            for node in self.nodes.values():
                self.wait_node(node)
            wait_healthy(self.router, router, 120, self.tmp / "router.log")
            wait_for(
                lambda: all(w["healthy"] for w in self.workers().values()),
                60,
                "router sees every node healthy",
            )
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stack.close()  # the router first: no traffic while the nodes stop
        for node in self.nodes.values():
            node.stack.close()
        self.holds.close()
        if self.refs is not None:
            self.refs.join()

    def restart(self, node: Node) -> None:
        """Stops the whole node (front and whatever ranks are left),
        then a fresh one on the same port."""
        old = node.proc
        node.stack.close()
        assert group_alive(old.pid) == [], f"{node.name}: processes left after the node was stopped"
        self.launch(node)
        self.wait_node(node)

    # --- looking at it ---
    def ranks(self, node: Node) -> dict[int, int]:
        """pp_rank -> pid of the node's live rank processes: those of its process group that a
        rank names after itself (runtime/rank/process.py, e.g. decode-pp1)."""
        ranks = {}
        for pid, stat, comm in group_members(node.proc.pid):
            m = re.fullmatch(r"(prefill|decode)-pp(\d+)", comm.strip())
            if m and "Z" not in stat:
                ranks[int(m.group(2))] = pid
        return ranks

    def rank_stats(self, node: Node) -> list[dict | None]:
        return httpx.get(f"{node.url}/server_info", timeout=10).json()["ranks"]

    def workers(self) -> dict[str, dict]:
        return {
            w["url"]: w for w in httpx.get(f"{self.router}/workers", timeout=10).json()["workers"]
        }

    def router_healthy(self, node: Node) -> bool:
        return self.workers()[node.url]["healthy"]

    def kill_rank1(self, node: Node, seen: dict, what: str) -> dict:
        """SIGKILLs the node's pp_rank 1; records when,
        and when the router marked the node unhealthy."""
        ranks = self.ranks(node)
        assert sorted(ranks) == [0, 1], ranks
        seen["ranks"] = ranks
        os.kill(ranks[1], signal.SIGKILL)
        seen["killed"] = time.monotonic()
        wait_for(lambda: not self.router_healthy(node), 20, f"the router to mark {what} unhealthy")
        seen["marked"] = time.monotonic()
        time.sleep(3)  # the load goes on through the healthy nodes
        return seen

    def assert_whole(self) -> None:
        """Every node healthy (node and router), no request in flight anywhere, no KV page held."""
        urls = [n.url for n in self.nodes.values()]
        wait_for(
            lambda: all(w["healthy"] and w["in_flight"] == 0 for w in self.workers().values()),
            30,
            "every worker healthy with nothing in flight",
        )
        for url in urls:
            assert httpx.get(f"{url}/health", timeout=10).status_code == 200, url
        left = wait_pages_free(*urls, timeout=QUARANTINE_S + 30)
        assert not any(any(v) for v in left.values()), f"KV pages still held: {left}"
        for url in urls:
            assert httpx.get(f"{url}/server_info", timeout=10).json()["load"]["in_flight"] == 0, url
        for log in self.tmp.glob("*-*.log"):
            assert "diverged" not in log.read_text(), f"{log.name}: ranks diverged"


@pytest.fixture(scope="module")
def chaos(tiny6, tmp_path_factory):
    with Chaos(tiny6, tmp_path_factory.mktemp("chaos")) as c:
        yield c


@pytest.fixture
def refs(chaos):
    return chaos.refs


def wait_for(pred: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.2)


# --- the load -------------------------------------------------------------------------------------


@dataclass
class Outcome:
    kind: str  # which prompt set: short, long, fresh
    prompt: int
    t0: float
    t1: float = 0.0
    status: int | None = None
    tokens: list[int] = field(default_factory=list)
    error: str | None = None  # the message of an HTTP error body or an SSE error event
    broken: str | None = (
        None  # not a clear error: a client timeout, a cut connection, an unreadable body
    )


PROMPTS = {
    "short": (SHORT, SHORT_NEW),
    "long": (LONG, LONG_NEW),
    "long_kill": (LONG_KILL, LONG_NEW),
    "fresh": (FRESH, FRESH_NEW),
}


async def stream_one(c: httpx.AsyncClient, router: str, kind: str, i: int) -> Outcome:
    prompts, max_new = PROMPTS[kind]
    body = {
        "input_ids": prompts[i],
        "stream": True,
        "sampling_params": {"max_tokens": max_new, "ignore_eos": True},
    }
    out = Outcome(kind, i, time.monotonic())
    try:
        async with c.stream("POST", f"{router}/generate", json=body) as resp:
            out.status = resp.status_code
            if resp.status_code != 200:
                out.error = json.loads(await resp.aread())["error"]["message"]
            else:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if event.get("error"):
                        out.error = event["error"]["message"]
                        break
                    out.tokens.extend(event.get("token_ids", []))
    except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
        out.broken = f"{type(e).__name__}: {e}"
    out.t1 = time.monotonic()
    return out


def under_load(router: str, kinds: list[str], fault: Callable[[], object]):
    """One streaming client per entry of `kinds` sends prompts of that kind one after another while
    `fault()` runs in a thread; they stop once it returned (finishing what they sent).
    Returns (outcomes, fault's result)."""

    async def main():
        stop, outs = asyncio.Event(), []
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as c:

            async def client(kind: str, k: int) -> None:
                while not stop.is_set():
                    outs.append(await stream_one(c, router, kind, k % len(PROMPTS[kind][0])))
                    k += len(kinds)

            tasks = [asyncio.create_task(client(kind, k)) for k, kind in enumerate(kinds)]
            try:
                result = await asyncio.to_thread(fault)
            finally:
                stop.set()
                await asyncio.gather(*tasks)
        return outs, result

    return asyncio.run(main())


def send_all(router: str, kind: str, indices: list[int]) -> list[Outcome]:
    async def main():
        async with httpx.AsyncClient(timeout=CLIENT_TIMEOUT_S) as c:
            return await asyncio.gather(*(stream_one(c, router, kind, i) for i in indices))

    return asyncio.run(main())


def judge(outs: list[Outcome], refs: References) -> tuple[list[Outcome], list[Outcome]]:
    """(succeeded, failed). Every success is exactly the reference; every failure a clear error with
    whatever tokens it streamed a prefix of the reference;
    every request ended within its timeout."""
    ok, failed = [], []
    for o in outs:
        want = refs[o.kind][o.prompt]
        what = f"{o.kind} prompt {o.prompt} (status {o.status}, {len(o.tokens)} tokens)"
        assert o.broken is None, f"{what} did not end in an answer or a clear error: {o.broken}"
        assert o.t1 - o.t0 < CLIENT_TIMEOUT_S, what
        assert o.tokens == want[: len(o.tokens)], f"{what}: tokens differ from transformers"
        if o.error is None:
            assert o.status == 200 and o.tokens == want, (
                f"{what}: a 200 without the whole reference"
            )
            ok.append(o)
        else:
            assert (
                o.error.strip() and o.status is not None and (o.status >= 400 or o.status == 200)
            ), what
            failed.append(o)
    return ok, failed


def serve_until_used(chaos: Chaos, node: Node, refs: References, reason: str) -> None:
    """The router takes `node` back: with the other nodes of its role taken out of the router for a
    moment (cache_aware would keep sending the fresh prompts to whichever node already holds them,
    and how many are in flight at once decides ties), every fresh prompt goes through the router to
    `node`; each answer must be the reference and `node` must count them (`length` on a decode node,
    `prefill_done` on a prefill node). Once the node's circuit breaker is past its open period: one
    at a time while it is half-open (after the fault), which lets one request through at a time,
    the rest together once it is closed; again, up to three rounds, while some failed over (see
    below) and `node` counted fewer. The others are registered again after."""
    others = [n for n in chaos.nodes.values() if n.role == node.role and n is not node]
    wait_for(
        lambda: chaos.workers()[node.url]["circuit"] != "open",
        30,
        f"{node.name}'s breaker to let requests in",
    )
    before = counter(node.url, "pdserve_requests_total", finish_reason=reason)

    def counted() -> bool:
        return counter(node.url, "pdserve_requests_total", finish_reason=reason) >= before + len(
            FRESH
        )

    try:
        for n in others:
            r = httpx.delete(f"{chaos.router}/workers", params={"url": n.url}, timeout=10)
            assert r.status_code == 200, r.text
        # A room registered before a decode rank's next heartbeat after a prefill node's restart
        # fails over with peer_dead and is retried, maybe decode-only (docs/RELIABILITY.md): the
        # node must then count the fresh prompts over a second round, never an inexact answer.
        for round_ in range(3):
            pending = list(range(len(FRESH)))
            while pending:
                closed = chaos.workers()[node.url]["circuit"] == "closed"
                batch = pending if closed else pending[:1]
                _, failed = judge(send_all(chaos.router, "fresh", batch), refs)
                assert not failed, [o.error for o in failed]
                wait_for(
                    lambda: chaos.workers()[node.url]["in_flight"] == 0,
                    10,
                    f"the router to settle {node.name}'s requests",
                )
                pending = pending[len(batch) :]
            try:
                wait_for(counted, 10, f"{node.name} to count the {len(FRESH)} requests")
                break
            except AssertionError:
                if round_ == 2:
                    raise
    finally:
        for n in others:
            body = {
                "url": n.url,
                "role": n.role,
                **({"bootstrap_port": n.bport} if n.bport else {}),
            }
            r = httpx.post(f"{chaos.router}/workers", json=body, timeout=10)
            assert r.status_code == 200, r.text


def report(
    fault: str, outs: list[Outcome], ok: list[Outcome], failed: list[Outcome], retries: float
) -> None:
    errors = sorted({o.error for o in failed})
    slowest = max(o.t1 - o.t0 for o in outs)
    print(
        f"\n[chaos] {fault}: {len(outs)} requests, {len(ok)} succeeded (exact), "
        f"{len(failed)} failed, router retries {retries:g}, slowest request {slowest:.1f} s; "
        f"errors: {errors}"
    )


# --- the faults -----------------------------------------------------------------------------------


def test_bootstrap_server_unreachable(chaos, refs):
    """The router is told a port where nothing listens as P2's bootstrap port (through its own
    /workers API): decode nodes cannot find P2's ranks, P2's senders never see a registration, both
    sides end the room at the bootstrap timeout and the router retries on a new pair."""
    p2 = chaos.nodes["p2"]
    decodes = [chaos.nodes["d1"], chaos.nodes["d2"]]

    def register_p2(bootstrap_port: int) -> None:
        httpx.delete(f"{chaos.router}/workers", params={"url": p2.url}, timeout=10)
        r = httpx.post(
            f"{chaos.router}/workers",
            timeout=10,
            json={"url": p2.url, "role": "prefill", "bootstrap_port": bootstrap_port},
        )
        assert r.status_code == 200 and r.json()["worker"]["bootstrap_port"] == bootstrap_port, (
            r.text
        )

    def timeouts() -> float:
        return sum(
            counter(d.url, "pdserve_kv_transfer_failures_total", reason="bootstrap_timeout")
            for d in decodes
        )

    retries = lambda: counter(chaos.router, "pdserve_router_retries_total")  # noqa: E731
    timeouts0, retries0 = timeouts(), retries()

    def fault():
        wait_for(
            lambda: retries() >= retries0 + 2, 60, "two requests to fail on P2's bootstrap port"
        )

    try:
        register_p2(free_port())  # nothing listens there
        outs, _ = under_load(chaos.router, ["fresh"] * CLIENTS, fault)
    finally:
        register_p2(p2.bport)
    ok, failed = judge(outs, refs)
    report("bootstrap unreachable", outs, ok, failed, retries() - retries0)
    wait_for(
        lambda: timeouts() > timeouts0, 10, "the decode nodes to report the bootstrap timeouts"
    )
    # P1 is healthy: every request P2 could not serve is served by a new pair, none fails.
    assert not failed, [o.error for o in failed]
    assert httpx.get(f"{p2.url}/health", timeout=10).status_code == 200
    serve_until_used(chaos, p2, refs, "prefill_done")  # with the right port, P2 serves again
    chaos.assert_whole()


def _assert_dead_decode_node(
    chaos: Chaos, d1: Node, front: subprocess.Popen, why: list[str]
) -> None:
    """D1 after the SIGKILL of its rank 1 (`why`: the rank exits it may name as the reason)."""
    # The node: unhealthy with the reason, its other rank stopped, its front still answering.
    health = httpx.get(f"{d1.url}/health", timeout=10)
    assert health.status_code == 503 and any(w in health.json()["detail"] for w in why), health.text
    wait_for(lambda: chaos.ranks(d1) == {}, 15, "D1 to stop its other rank")
    assert front.poll() is None, "D1's front exited"
    pd_body = {
        "input_ids": SHORT[0],
        "bootstrap_room": 1,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": chaos.nodes["p1"].bport,
    }
    r = httpx.post(f"{d1.url}/generate", json=pd_body, timeout=10)
    assert r.status_code == 503 and "unhealthy" in r.json()["error"]["message"], r.text
    assert (
        f'pdserve_router_worker_healthy{{role="decode",worker="{d1.url}"}} 0.0'
        in httpx.get(f"{chaos.router}/metrics", timeout=10).text
    )


def test_decode_rank_sigkill_mid_decode(chaos, refs):
    """SIGKILL of D1's pp_rank 1 while D1 decodes: D1 ends its streams with a node failure that
    names the rank, and the router moves each of them to D2 mid-stream (router/routing/
    migration.py), so every client gets exactly transformers' tokens; D1 reports unhealthy and
    stops its other rank, the router stops sending there; a fresh `pdserve decode` on the same
    port is taken back and served."""
    d1 = chaos.nodes["d1"]
    front = d1.proc
    seen: dict = {}

    def fault():
        wait_for(
            lambda: (chaos.rank_stats(d1)[0] or {}).get("running", 0) > 0,
            60,
            "requests decoding on D1",
        )
        return chaos.kill_rank1(d1, seen, "D1")

    def moved() -> float:
        return counter(
            chaos.router, "pdserve_router_migrations_total", cause="node_failure", outcome="resumed"
        )

    retries0, moved0 = counter(chaos.router, "pdserve_router_retries_total"), moved()
    outs, seen = under_load(chaos.router, ["short"] * CLIENTS, fault)
    retries = counter(chaos.router, "pdserve_router_retries_total") - retries0
    ok, failed = judge(outs, refs)
    report(
        f"decode rank SIGKILL (router marked D1 unhealthy {seen['marked'] - seen['killed']:.1f} s "
        f"after the kill; {moved() - moved0:.0f} streams moved)",
        outs,
        ok,
        failed,
        retries,
    )
    # Every stream, those D1 was decoding included, ends with the whole reference answer.
    assert not failed, [o.error for o in failed]
    assert moved() > moved0, "no stream was decoding on D1 when its rank was killed"
    # The node names the first rank exit it sees: the killed rank (-9) or rank 0, which its dead
    # peer stops (1).
    why = [f"rank process {pid} (local #{r}) exited" for r, pid in seen["ranks"].items()]
    _assert_dead_decode_node(chaos, d1, front, why)
    # A fresh node on the same port comes back into service.
    chaos.restart(d1)
    wait_for(lambda: chaos.router_healthy(d1), 30, "the router to mark the new D1 healthy")
    serve_until_used(chaos, d1, refs, "length")
    chaos.assert_whole()


def _peer_dead(d: Node) -> float:
    """Rooms the decode node `d` failed because their prefill peer went silent."""
    return counter(d.url, "pdserve_kv_transfer_failures_total", reason="peer_dead")


def _stall_prefill_rank1(
    chaos: Chaos, p1: Node, ranks: dict[int, int], decodes: list[Node]
) -> dict[str, tuple]:
    """SIGSTOPs P1's pp_rank 1 once it prefills, for STALL_S, then SIGCONTs it. Returns, per decode
    node just before the resume: (rooms failed as peer_dead, quarantined, waiting for KV)."""
    dead0 = {d.name: _peer_dead(d) for d in decodes}
    wait_for(lambda: (chaos.rank_stats(p1)[1] or {}).get("running", 0) > 0, 60, "P1 prefilling")
    os.kill(ranks[1], signal.SIGSTOP)
    try:
        time.sleep(STALL_S)
        # D2 (PP 1) frees a failed room's pages as soon as its one rank allows: it must have
        # seen the fault for the check below to say anything.
        wait_for(
            lambda: _peer_dead(decodes[1]) > dead0["d2"],
            3,
            "D2 to fail a room of the silent rank",
        )
        # Just before it resumes: per decode node, the rooms failed for the silent rank, then
        # (a vote later) its rooms in quarantine and those still waiting for KV.
        dead = {d.name: _peer_dead(d) - dead0[d.name] for d in decodes}
        time.sleep(1)
        queues = {d.name: chaos.rank_stats(d)[0] for d in decodes}
        at_resume = {
            n: (dead[n], q["quarantine"], q["prealloc"] + q["transfer"]) for n, q in queues.items()
        }
    finally:
        os.kill(ranks[1], signal.SIGCONT)
    time.sleep(4)  # requests sent around the resume
    return at_resume


def test_prefill_rank_stalled_past_transfer_timeout(chaos, refs):
    """SIGSTOP of P1's pp_rank 1 (it sends the second half of the layers) while it prefills and
    transfers, for longer than the transfer timeout, then SIGCONT. Its rooms fail on both sides
    (the decode nodes first, `peer_dead`: its heartbeats stopped) and are retried elsewhere. When it
    resumes it may finish the write it was in and work off the registrations queued meanwhile: the
    decode pages of its failed rooms must still be quarantined then, never handed to a request that
    decodes from them. The node itself comes back without a restart."""
    p1 = chaos.nodes["p1"]
    decodes = [chaos.nodes["d1"], chaos.nodes["d2"]]
    ranks = chaos.ranks(p1)
    assert sorted(ranks) == [0, 1], ranks

    def fault():
        return _stall_prefill_rank1(chaos, p1, ranks, decodes)

    retries0 = counter(chaos.router, "pdserve_router_retries_total")
    # Short requests decode while the stalled rank's rooms fail: theirs are the pages a resumed
    # write would hit if a failed room's pages were reused too early.
    outs, at_resume = under_load(chaos.router, ["long"] * CLIENTS + ["short"] * 3, fault)
    retries = counter(chaos.router, "pdserve_router_retries_total") - retries0
    ok, failed = judge(outs, refs)
    report(
        "prefill rank SIGSTOP (at resume, per decode node (peer_dead, quarantined, "
        f"waiting for KV): {at_resume})",
        outs,
        ok,
        failed,
        retries,
    )
    assert retries >= 1, "no request was caught by the stall"
    # None of those rooms' pages went back to the pool. D2 (PP 1) failed each on its only rank: it
    # is in quarantine. On D1 (PP 2) a room fails once both ranks see it fail (rank 0 reads from
    # P1's rank 0, which is alive): until then it waits for KV, with its pages.
    dead, quarantined, _ = at_resume["d2"]
    assert quarantined >= dead, (
        f"D2 freed the pages of rooms the stalled rank could still write: {at_resume}"
    )
    dead, quarantined, waiting = at_resume["d1"]
    assert quarantined + waiting >= dead, (
        f"D1 freed the pages of rooms the stalled rank could still write: {at_resume}"
    )
    assert not failed, [o.error for o in failed]  # P2 is healthy: every retry finds a pair
    assert chaos.ranks(p1) == ranks, "P1's ranks changed: the stall was not survived"
    wait_for(
        lambda: httpx.get(f"{p1.url}/health", timeout=10).status_code == 200, 30, "P1 healthy again"
    )
    serve_until_used(chaos, p1, refs, "prefill_done")
    chaos.assert_whole()


def test_prefill_rank_sigkill_mid_transfer(chaos, refs):
    """SIGKILL of P1's pp_rank 1 while it prefills long prompts chunk by chunk (their first chunks
    already written to the decode nodes): those requests are retried on P2 before the client saw a
    byte; P1 reports unhealthy and stops its other rank; the router routes around it and takes the
    restarted node (same port, same bootstrap port) back."""
    p1 = chaos.nodes["p1"]
    front = p1.proc
    seen: dict = {}

    def prefilling() -> bool:
        info = httpx.get(f"{p1.url}/server_info", timeout=10).json()
        seen["pending"] = info["load"]["in_flight"]
        return seen["pending"] > 0 and (info["ranks"][1] or {}).get("running", 0) > 0

    def fault():
        wait_for(prefilling, 60, "P1 prefilling")
        return chaos.kill_rank1(p1, seen, "P1")

    retries0 = counter(chaos.router, "pdserve_router_retries_total")
    outs, seen = under_load(chaos.router, ["long_kill"] * CLIENTS, fault)
    retries = counter(chaos.router, "pdserve_router_retries_total") - retries0
    ok, failed = judge(outs, refs)
    report(
        f"prefill rank SIGKILL ({seen['pending']} requests on P1, router marked it unhealthy "
        f"{seen['marked'] - seen['killed']:.1f} s after the kill)",
        outs,
        ok,
        failed,
        retries,
    )
    assert retries >= 1, "no request was on P1 when its rank was killed"
    assert not failed, [o.error for o in failed]  # nothing had reached the client: all retried
    why = [f"rank process {pid} (local #{r}) exited" for r, pid in seen["ranks"].items()]
    health = httpx.get(f"{p1.url}/health", timeout=10)
    assert health.status_code == 503 and any(w in health.json()["detail"] for w in why), health.text
    wait_for(lambda: chaos.ranks(p1) == {}, 15, "P1 to stop its other rank")
    assert front.poll() is None, "P1's front exited"
    chaos.restart(p1)
    wait_for(lambda: chaos.router_healthy(p1), 30, "the router to mark the new P1 healthy")
    serve_until_used(chaos, p1, refs, "prefill_done")
    chaos.assert_whole()
