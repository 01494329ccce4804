"""Mid-stream migration (router/routing/migration.py) on real processes: 16 streams in flight over
a router, a prefill node and two decode nodes (D1 with PP 2, D2 with PP 1), in fp32 and in bf16
with batch-invariant nodes (`--batch-invariant`), while the decode node with more of them fails:
its front SIGKILLed, one of its ranks SIGKILLed, one of its ranks SIGSTOPped past the router's
--stream-idle-timeout, or it drains on SIGTERM. Every stream must end exactly as the same request
undisturbed:
- greedy /generate: transformers' tokens in fp32, the undisturbed answer in bf16;
- seeded sampling (/v1/completions, `seed`), a JSON-schema `response_format` and a forced tool
  call (/v1/chat/completions): the answer of the same request before the fault.
The router must count the migrations, each on the run's replay path (fp32: the new decode node
prefills prompt + tokens sent itself; bf16: a prefill node does and moves the KV); afterwards a
fresh node is taken back and nothing is held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
import torch
from cluster import NODE_ARGS, group_members, held_port, start, wait_healthy
from metrics_scrape import counter
from one_thread import one_torch_thread
from pd_cluster import FAST_TIMEOUTS, wait_pages_free
from reference import hf_greedy, load_hf
from tiny_model import QWEN25_TEMPLATE, build_tiny_model

from pdserve.engine.model.linear import batch_invariant_why_not
from pdserve.router.metrics import MIGRATION_CAUSES

pytestmark = pytest.mark.failover

IDLE_S = 6.0  # the router's --stream-idle-timeout: a stalled rank's streams move after it
DRAIN_GRACE_S = 1.0  # the nodes' --drain-grace: what a draining node still runs moves after it
MAX_NEW = 200
PROMPTS = [[5 + i, 9, 13 + 2 * i, 22, 31, 40 + i, 41, 7] for i in range(4)]
ARRAY = {  # long enough that a stream is still going when the fault hits
    "type": "object",
    "properties": {"xs": {"type": "array", "items": {"type": "integer"}, "minItems": 24}},
    "required": ["xs"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {"name": "record", "parameters": ARRAY},
}
# The breakers (the node's, the pair's) are kept shut: health probes alone take D1 out and back, so
# a fresh D1 gets its share of streams at once (a half-open breaker lets one through at a time).
ROUTER_ARGS = [
    "--health-interval", "0.5", "--health-timeout", "5", "--health-failure-threshold", "3",
    "--health-success-threshold", "2", "--decode-policy", "round_robin",
    "--request-timeout", "60", "--stream-idle-timeout", str(IDLE_S),
    "--cb-failure-threshold", "100000", "--pair-failure-threshold", "100000",
    "--disagg-min-prompt-tokens", "0", "--log-level", "warning",
]  # fmt: skip


def requests() -> list[tuple[str, str, dict]]:
    """(kind, path, body) of the 16 streams."""
    out = []
    for i, ids in enumerate(PROMPTS):
        sp = {"max_tokens": MAX_NEW, "ignore_eos": True}
        out.append(("greedy", "/generate", {"input_ids": ids, "sampling_params": sp}))
        out.append(
            (
                "seeded",
                "/v1/completions",
                {"model": "qwen", "prompt": ids, "max_tokens": MAX_NEW, "temperature": 1.0,
                 "seed": 100 + i, "ignore_eos": True},
            )
        )  # fmt: skip
        ask = [{"role": "user", "content": f"numbers please {i}"}]
        out.append(
            (
                "json_schema",
                "/v1/chat/completions",
                {"model": "qwen", "messages": ask, "max_tokens": 400, "temperature": 0,
                 "response_format": {"type": "json_schema",
                                     "json_schema": {"name": "xs", "schema": ARRAY}}},
            )
        )  # fmt: skip
        out.append(
            (
                "tool_call",
                "/v1/chat/completions",
                {"model": "qwen", "messages": ask, "max_tokens": 400, "temperature": 0,
                 "tools": [TOOL], "tool_choice": "required"},
            )
        )  # fmt: skip
    return out


class Stream:
    """One streamed answer: what the client got, in order."""

    def __init__(self, kind: str):
        self.kind, self.tokens, self.text, self.tool_args = kind, [], [], []
        self.finish, self.error, self.events = None, None, 0
        self.failed = ""  # the client's own failure (no answer, a broken stream)

    def take(self, event: dict) -> None:
        self.events += 1
        if "error" in event:
            self.error = event["error"].get("message")
        if "choices" not in event:  # native
            self.tokens.extend(event.get("token_ids") or [])
            reason = (event.get("meta_info") or {}).get("finish_reason")
            self.finish = (reason or {}).get("type") or self.finish
            return
        for c in event["choices"]:
            self.finish = c.get("finish_reason") or self.finish
            if "text" in c:
                self.text.append(c["text"] or "")
                continue
            delta = c.get("delta") or {}
            self.text.append(delta.get("content") or "")
            for call in delta.get("tool_calls") or ():
                self.tool_args.append((call.get("function") or {}).get("arguments") or "")

    def answer(self):
        if self.kind == "greedy":
            return self.tokens
        return "".join(self.text), "".join(self.tool_args)


async def stream_one(c: httpx.AsyncClient, url: str, s: Stream, path: str, body: dict) -> Stream:
    try:
        async with c.stream("POST", url + path, json={**body, "stream": True}) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    s.take(json.loads(line[6:]))
    except BaseException as e:  # seen by the fault's thread, which would otherwise wait it out
        s.failed = f"{type(e).__name__}: {e}"[:500]
        raise
    return s


def run_all(url: str, on_way=None) -> list[Stream]:
    """The 16 streams at once; `on_way(streams)` runs in a thread once every one has its first
    events (the fault)."""

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = requests()
            streams = [Stream(kind) for kind, _, _ in reqs]
            tasks = [
                asyncio.create_task(stream_one(c, url, s, path, body))
                for s, (_, path, body) in zip(streams, reqs, strict=True)
            ]
            if on_way is not None:
                await asyncio.to_thread(on_way, streams)
            return await asyncio.gather(*tasks)

    return asyncio.run(main())


# fp32 is exact as it is; bf16 is exact only where a token's bits do not depend on its batch
DTYPE_ARGS = {"float32": [], "bfloat16": ["--dtype", "bfloat16", "--batch-invariant"]}
# Each run takes one replay path for every migration, so both are tested every time: in fp32 the
# new decode node prefills prompt + tokens sent itself (every prompt is "short"); in bf16 a prefill
# node does and moves the KV (the queue rule off, and no prefix cache for the rules to weigh).
REPLAY = {
    "float32": ("decode_only", [], ["--disagg-min-prompt-tokens", "1000000"]),
    "bfloat16": ("disaggregated", ["--no-prefix-cache"], ["--disagg-local-prefill-cost", "0"]),
}


class Unhit(Exception):
    """Every stream ended before the fault found one in flight: that run tested nothing."""


class Cluster:
    def __init__(self, model: Path, tmp: Path, dtype: str):
        self.model, self.tmp, self.dtype = model, tmp, dtype
        self.holds = contextlib.ExitStack()  # the ports, until every process here has stopped
        self.ports = {n: held_port(self.holds) for n in ("p", "d1", "d2", "router")}
        self.bport = held_port(self.holds)
        self.pp = {"p": 1, "d1": 2, "d2": 1}
        self.procs: dict = {}
        self.stacks = {n: contextlib.ExitStack() for n in self.ports}
        self.starts = dict.fromkeys(self.ports, 0)

    def url(self, name: str) -> str:
        return f"http://127.0.0.1:{self.ports[name]}"

    def launch(self, name: str) -> None:
        role = "prefill" if name == "p" else "decode"
        cmd = [role, "--model", str(self.model), "--pp", str(self.pp[name])]
        cmd += ["--port", str(self.ports[name]), *NODE_ARGS, "--max-context", "1024"]
        cmd += ["--drain-grace", str(DRAIN_GRACE_S), *DTYPE_ARGS[self.dtype]]
        cmd += REPLAY[self.dtype][1]
        if name == "p":
            cmd += ["--bootstrap-port", str(self.bport)]
        self.starts[name] += 1
        log = self.tmp / f"{name}-{self.starts[name]}.log"
        self.stacks[name] = contextlib.ExitStack()
        _, self.procs[name] = self.stacks[name].enter_context(
            start(cmd, self.ports[name], log, env=FAST_TIMEOUTS, wait=False)
        )
        self.logs = {**getattr(self, "logs", {}), name: log}

    def __enter__(self) -> Cluster:
        try:
            for name in ("p", "d1", "d2"):
                self.launch(name)
            for name in ("p", "d1", "d2"):
                wait_healthy(self.url(name), self.procs[name], 240, self.logs[name])
            cmd = ["router", "--port", str(self.ports["router"])]
            cmd += ["--prefill", self.url("p"), str(self.bport)]
            cmd += ["--decode", self.url("d1"), "--decode", self.url("d2"), *ROUTER_ARGS]
            cmd += REPLAY[self.dtype][2]
            self.stacks["router"].enter_context(
                start(cmd, self.ports["router"], self.tmp / "router.log")
            )
            self.wait_all_healthy()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for stack in self.stacks.values():  # the router first
            stack.close()
        self.holds.close()

    def workers(self) -> dict[str, dict]:
        got = httpx.get(self.url("router") + "/workers", timeout=10).json()["workers"]
        return {w["url"]: w for w in got}

    def wait_all_healthy(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not all(w["healthy"] for w in self.workers().values()):
            assert time.monotonic() < deadline, f"not every worker healthy: {self.workers()}"
            time.sleep(0.2)

    def ranks(self, name: str) -> dict[int, int]:
        out = {}
        for pid, stat, comm in group_members(self.procs[name].pid):
            m = re.fullmatch(r"decode-pp(\d+)", comm.strip())
            if m and "Z" not in stat:
                out[int(m.group(1))] = pid
        return out

    def restart(self, name: str) -> None:
        """A fresh node on the same port, back in the router."""
        self.stacks[name].close()
        self.launch(name)
        wait_healthy(self.url(name), self.procs[name], 240, self.logs[name])
        self.wait_all_healthy()

    def busy_decode(self, streams: list[Stream], timeout: float = 60) -> str:
        """The decode node ("d1" or "d2") with the most streams open, once every stream has
        its first events (a fault before a stream's first token is a plain retry, not a
        migration). Either node may be the busier: just after a restart the router's choices
        are not even (docs/RELIABILITY.md)."""
        deadline = time.monotonic() + timeout
        while True:
            load = {n: self.workers()[self.url(n)]["in_flight"] for n in ("d1", "d2")}
            failed = [(s.kind, s.failed) for s in streams if s.failed]
            assert not failed, f"a stream failed before the fault: {failed}"
            # a stream that already finished counts as started (a busy machine sends many
            # tokens per event, so a short answer may have fewer than 3)
            started = all(s.events >= 3 or s.finish for s in streams)
            if started and max(load.values()) >= 1:
                return max(load, key=load.get)
            states = [(s.kind, s.events, s.finish) for s in streams]
            if all(s.finish for s in streams):
                raise Unhit(f"every stream ended before the fault: {states}")
            assert time.monotonic() < deadline, f"no stream on a decode node: {load}, {states}"
            time.sleep(0.01)

    def last_rank(self, name: str) -> int:
        ranks = self.ranks(name)
        return ranks[max(ranks)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(
        tmp_path_factory.mktemp("migration-model") / "qwen", num_layers=4, seed=3,
        chat_template=QWEN25_TEMPLATE,
    )  # fmt: skip


@pytest.fixture(scope="module", params=list(DTYPE_ARGS))
def cluster(model, tmp_path_factory, request):
    if request.param == "bfloat16":
        why = batch_invariant_why_not(torch.bfloat16)
        if why:
            pytest.skip(f"no batch-invariant bf16 on this CPU: {why}")
    with Cluster(model, tmp_path_factory.mktemp("migration"), request.param) as c:
        yield c


@pytest.fixture(scope="module")
def undisturbed(cluster, model):
    """The answers without a fault: greedy ones are transformers' in fp32."""
    streams = run_all(cluster.url("router"))
    if cluster.dtype == "float32":
        with one_torch_thread():
            want = hf_greedy(load_hf(model), PROMPTS, MAX_NEW)
        greedy = [s.answer() for s in streams if s.kind == "greedy"]
        assert greedy == want
    for s in streams:
        assert s.error is None and s.finish in ("length", "stop", "tool_calls"), vars(s)
    return [s.answer() for s in streams]


def moved(cluster: Cluster, cause: str) -> float:
    return counter(
        cluster.url("router"), "pdserve_router_migrations_total", cause=cause, outcome="resumed"
    )


def replays(cluster: Cluster) -> dict[str, float]:
    """Migrations by the path of their replay."""
    return {
        path: counter(
            cluster.url("router"),
            "pdserve_router_route_decisions_total",
            path=path,
            reason="migration",
        )
        for path in ("decode_only", "disaggregated")
    }


def check_fault(cluster: Cluster, undisturbed: list, fault, causes: tuple[str, ...]) -> None:
    before, paths = sum(moved(cluster, c) for c in causes), replays(cluster)
    for attempt in (1, 2):  # a second set of streams where the first ended before the fault
        try:
            streams = run_all(cluster.url("router"), fault)
            break
        except Unhit:
            if attempt == 2:
                raise
    after, paths_after = sum(moved(cluster, c) for c in causes), replays(cluster)
    for s, want in zip(streams, undisturbed, strict=True):
        assert s.error is None, (s.kind, s.error)
        assert s.answer() == want, s.kind
    every = {c: moved(cluster, c) for c in MIGRATION_CAUSES}  # to say what moved them instead
    assert after > before, f"no stream moved for {causes}; moves so far by cause: {every}"
    path = REPLAY[cluster.dtype][0]
    grown = {p: paths_after[p] - paths[p] for p in paths}
    assert grown[path] >= after - before and sum(grown.values()) == grown[path], grown


def test_sigkill_of_a_decode_front(cluster, undisturbed):
    hit = []

    def fault(streams):
        hit.append(cluster.busy_decode(streams))
        os.kill(cluster.procs[hit[0]].pid, signal.SIGKILL)

    try:
        check_fault(cluster, undisturbed, fault, ("connection", "stream_cut"))
    finally:  # a failed check leaves the next test a whole cluster
        if hit:
            cluster.restart(hit[0])


def test_sigkill_of_a_decode_rank(cluster, undisturbed):
    hit = []

    def fault(streams):
        hit.append(cluster.busy_decode(streams))
        os.kill(cluster.last_rank(hit[0]), signal.SIGKILL)

    try:
        # the node reports its dead rank (node_failure), and its /health fails at once: on a
        # loaded machine the router's probes may see that before the report reaches the stream
        check_fault(cluster, undisturbed, fault, ("node_failure", "node_unhealthy"))
    finally:  # a failed check leaves the next test a whole cluster
        if hit:
            cluster.restart(hit[0])


def test_sigstop_of_a_decode_rank_past_the_idle_timeout(cluster, undisturbed):
    stopped = []

    def fault(streams):
        pid = cluster.last_rank(cluster.busy_decode(streams))
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)

    try:
        check_fault(cluster, undisturbed, fault, ("idle_timeout", "node_unhealthy"))
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    # the node comes back by itself: the router's aborts reach its ranks, its pages are freed
    cluster.wait_all_healthy(timeout=60)
    left = wait_pages_free(cluster.url("d1"), cluster.url("d2"), timeout=30)
    assert not any(any(v) for v in left.values()), left


def test_sigterm_drains_a_decode_node(cluster, undisturbed):
    """SIGTERM drains the node under the 16 streams: each ends exact (finished within the grace
    period or moved), the router stops choosing the node before it goes, and it exits 0.
    (`POST /drain` does the same: the rolling restart drains every node with it.)
    The node's last rank is paused (SIGSTOP) from just before the SIGTERM until the grace period
    is over, so its streams outlast the grace by construction: on an idle machine 200 tokens of
    the tiny model take well under its 1 s, and then nothing would move. The pause stays far
    below the router's idle timeout and the node's rank-report staleness, so the only cause a
    stream can move for is the drain."""
    hit, seen, paused = [], {}, []

    def fault(streams):
        hit.append(cluster.busy_decode(streams))
        url = cluster.url(hit[0])
        paused.append(cluster.last_rank(hit[0]))
        os.kill(paused[0], signal.SIGSTOP)
        grace_over = time.monotonic() + DRAIN_GRACE_S + 0.5
        os.kill(cluster.procs[hit[0]].pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while not seen.get("draining"):
            w = cluster.workers()[url]
            seen["draining"] = w["draining"] and w["healthy"]  # chosen no more, not failed
            assert time.monotonic() < deadline, "the router never saw the node draining"
            time.sleep(0.05)
        time.sleep(max(0.0, grace_over - time.monotonic()))
        os.kill(paused.pop(), signal.SIGCONT)  # the aborts the grace's end sent now run

    try:
        check_fault(cluster, undisturbed, fault, ("node_draining",))
        assert cluster.procs[hit[0]].wait(timeout=30) == 0
    finally:
        for pid in paused:
            os.kill(pid, signal.SIGCONT)
        if hit:
            cluster.restart(hit[0])
