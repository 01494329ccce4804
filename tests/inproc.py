"""Nodes whose PP ranks are threads of the test process: a colocated node, or a prefill node and a
decode node joined by the in-memory KV transfer (kv_transfer/in_memory.py).

Each rank is built the way a rank process builds itself (runtime/rank/process.py `build_rank`, the
PD rank modules' `make_loop` and `BUILD_KWARGS`), with two seams swapped: the PP group is the
in-memory one (runtime/rank/pp_comm_memory.py) and the KV managers join an `InMemoryFabric`. PP0 of
a node talks to a `MemoryFront`, whose requests and events go through the wire codec. The prefill
node's consensus store is the real one (ZMQ on 127.0.0.1), and each rank thread keeps its own rank
consensus checker (consensus/rank_checker.py `bind`), compared every 8 turns as in a node.

A node can be paused at a turn boundary (`pause`): every rank finishes the turn before the one
chosen and waits, so the test thread reads the ranks' state (stats, pools) while nothing moves.
Every wait is bounded; a rank that raises stops the whole cluster and the error is raised in the
test thread at its next wait.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pdserve.consensus import rank_checker
from pdserve.decode_node import rank as decode_rank
from pdserve.kv_transfer.in_memory import InMemoryFabric
from pdserve.kv_transfer.manager import TransferConfig
from pdserve.pd_common.messages import PDAddRequest, PDRankSpec, PrefillDoneEvent
from pdserve.pd_common.rank_setup import pool_desc, sliding_pool_desc
from pdserve.prefill_node import rank as prefill_rank
from pdserve.runtime.messages import (
    AbortRequest,
    AddRequest,
    ErrorEvent,
    Event,
    FinishEvent,
    RankStats,
    TokenEvent,
    pack,
    unpack,
)
from pdserve.runtime.rank.front_link import rank_stats
from pdserve.runtime.rank.pp_comm_memory import CommClosed, MemoryPPGroup
from pdserve.runtime.rank.process import RankParts, build_rank, colocated_loop
from pdserve.runtime.rank.slot_loop import SlotLoop
from pdserve.runtime.rank_spec import RankSpec

# The real-process tests' node flags (tests/pd_cluster.py NODE_ARGS), fp32 for HF-exact outputs.
ENGINE = {
    "page_size": 4,
    "chunk_size": 16,
    "max_batch_tokens": 64,
    "max_total_tokens": 8192,
    "max_running": 32,
    "threads": 1,
    "dtype": "float32",
}
WAIT_S = 60.0  # the bound of every wait of the test thread
_ids = itertools.count()  # rids and rooms unique in the test process
PP_TIMEOUT_S = 30.0  # the in-memory PP group's receive/commit bound


class ClusterError(RuntimeError):
    """A rank of the cluster raised; its error is the cause."""


class MemoryFront:
    """PP0's FrontIO: requests in, events out, each through runtime/messages.py's codec."""

    def __init__(self, on_wait: Callable[[], None]):
        self._cond = threading.Condition()
        self._inbox: list[bytes] = []
        self.events: dict[str, list[Event]] = {}
        self.dropped: dict[str, int] = {}
        self.stepping = False  # the test runs the node turn by turn: no idle wait
        self._on_wait = on_wait  # raises when a rank died

    def submit(self, *msgs: Any) -> None:
        data = pack(list(msgs))
        with self._cond:
            self._inbox.append(data)
            self._cond.notify_all()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def poll(self, timeout_ms: int) -> list[Any]:
        with self._cond:
            if not self._inbox and timeout_ms > 0 and not self.stepping:
                self._cond.wait(timeout_ms / 1000)
            batches, self._inbox = self._inbox, []
        out: list[Any] = []
        for data in batches:
            good, bad = unpack(data)
            if bad:
                self.dropped["malformed"] = self.dropped.get("malformed", 0) + len(bad)
            out.extend(good)
        return out

    def report(self, events: list[Event]) -> None:
        good, bad = unpack(pack(events))
        assert not bad, f"PP0 reported events that do not decode: {bad}"
        with self._cond:
            for e in good:
                self.events.setdefault(e.rid, []).append(e)
            self._cond.notify_all()

    def wait_terminal(self, rid: str, timeout: float = WAIT_S) -> list[Event]:
        """The events of `rid` once one of them ends it (FinishEvent, ErrorEvent, PrefillDone)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(e.terminal for e in self.events.get(rid, [])):
                self._on_wait()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{rid}: no final event within {timeout:g} s")
                self._cond.wait(min(left, 0.1))
            return list(self.events[rid])


class RankThread(threading.Thread):
    def __init__(self, node: Node, rank: int, build: Callable[[], SlotLoop]):
        super().__init__(name=f"{node.name}-pp{rank}", daemon=True)
        self.node, self.rank, self._build = node, rank, build
        self.loop: SlotLoop | None = None
        self.touched: set[int] = set()  # every page a forward of this rank read or wrote
        self.ready = threading.Event()
        self.checker = rank_checker.RankChecker()  # this rank's decisions (consensus checker)

    def run(self) -> None:
        rank_checker.bind(self.checker)
        try:
            self.loop = self._build()
            self._record_pages(self.loop)
            self.ready.set()
            for t in itertools.count():
                if not self.node.gate(self.rank, t):
                    return
                self.loop.iteration(t)
        except CommClosed as e:
            if not self.node.stopping:  # a stopping node closes its group under its ranks
                self.node.cluster.fail(self, e)
        except BaseException as e:  # reported to the test thread
            self.node.cluster.fail(self, e)
        finally:
            self.ready.set()
            rank_checker.bind(None)

    def _record_pages(self, loop: SlotLoop) -> None:
        forward = loop.runner.forward

        def recording(batch, hidden_in=None):
            for e in batch.entries:
                self.touched.update(e.pages)
            return forward(batch, hidden_in)

        loop.runner.forward = recording


class Node:
    """One node's ranks (threads), its PP group and its front."""

    def __init__(self, cluster: Cluster, name: str, size: int):
        self.cluster, self.name, self.size = cluster, name, size
        self.group = MemoryPPGroup(size, PP_TIMEOUT_S) if size > 1 else None
        self.front = MemoryFront(cluster.check)
        self.ranks: list[RankThread] = []
        self._cond = threading.Condition()
        self._started = [-1] * size  # the turn each rank is in (or last finished, when parked)
        self._parked = [-1] * size  # the turn each rank waits before
        self._pause_at: int | None = None
        self.stopping = False

    def start(self, build: Callable[[int, Any, MemoryFront | None], SlotLoop]) -> None:
        for r in range(self.size):
            comm = self.group.comm(r) if self.group else None
            front = self.front if r == 0 else None
            self.ranks.append(RankThread(self, r, lambda r=r, c=comm, f=front: build(r, c, f)))
        for t in self.ranks:
            t.start()

    @property
    def loops(self) -> list[SlotLoop]:
        return [t.loop for t in self.ranks]

    # --- pausing at a turn boundary ------------------------------------------------------------
    def gate(self, rank: int, t: int) -> bool:
        """A rank's wait before turn `t`: False once the node stops."""
        with self._cond:
            while not self.stopping:
                if self._pause_at is None or t < self._pause_at:
                    self._started[rank] = t
                    return True
                self._parked[rank] = t
                self._cond.notify_all()
                self._cond.wait(0.5)
            return False

    def pause(self) -> None:
        """Every rank finishes the turns up to the latest one any rank started, then waits."""
        with self._cond:
            self._park_at(max(self._started) + 1)

    def step(self) -> None:
        """Paused: every rank runs one more turn and waits again."""
        with self._cond:
            assert self._pause_at is not None, "step() needs a paused node"
            self._park_at(self._pause_at + 1)

    def _park_at(self, at: int) -> None:
        self._pause_at = at
        self._cond.notify_all()
        self.front.wake()  # PP0 may be in its idle wait for requests
        deadline = time.monotonic() + WAIT_S
        while any(p != at for p in self._parked):
            self.cluster.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.name}: ranks not paused at turn {at}: {self._parked}")
            self._cond.wait(0.05)
        # Every rank ran the same turns: the same decisions, so the same consensus digest.
        digests = {t.checker.digest63() for t in self.ranks}
        assert len(digests) == 1, f"{self.name}: the ranks' decisions differ before turn {at}"

    def resume(self) -> None:
        with self._cond:
            self._pause_at = None
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self.stopping = True
            self._cond.notify_all()
        if self.group is not None:
            self.group.close()

    def join(self) -> None:
        for t in self.ranks:
            t.join(timeout=WAIT_S)
            assert not t.is_alive(), f"{t.name} did not stop"
        for t in self.ranks:
            if t.loop is not None:
                t.loop.close()

    def stats(self) -> list[RankStats]:
        """Every rank's stats (call it paused)."""
        return [rank_stats(loop, r) for r, loop in enumerate(self.loops)]


class Cluster:
    """The nodes of one test; `check` raises the first error of any rank."""

    def __init__(self):
        self.nodes: list[Node] = []
        self.error: tuple[str, BaseException] | None = None
        self._lock = threading.Lock()

    def node(self, name: str, size: int) -> Node:
        n = Node(self, name, size)
        self.nodes.append(n)
        return n

    def fail(self, rank: RankThread, e: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = (rank.name, e)
        for n in self.nodes:
            n.stop()

    def check(self) -> None:
        if self.error is not None:
            name, e = self.error
            raise ClusterError(f"{name} failed: {type(e).__name__}: {e}") from e

    def wait_ready(self) -> None:
        """Waits until every rank built its loop; stops the cluster if one could not."""
        deadline = time.monotonic() + WAIT_S
        try:
            for n in self.nodes:
                for t in n.ranks:
                    t.ready.wait(max(0.0, deadline - time.monotonic()))
                    self.check()
                    assert t.ready.is_set(), f"{t.name} not built within {WAIT_S:g} s"
        except BaseException:
            self.stop()
            raise

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Every node paused at a turn boundary (nothing moves, no transfer runs)."""
        try:
            for n in self.nodes:
                n.pause()
            yield
        finally:
            for n in self.nodes:
                n.resume()

    @contextlib.contextmanager
    def stepping(self) -> Iterator[Cluster]:
        """Every node paused for the block, to be run turn by turn (`step_until`); what the
        block submits is read in the node's next turn."""
        with self.paused():
            for n in self.nodes:
                n.front.stepping = True
            try:
                yield self
            finally:
                for n in self.nodes:
                    n.front.stepping = False

    def step_until(self, pred: Callable[[], bool], max_turns: int = 2000) -> None:
        """Inside `stepping`: runs every node one turn at a time until `pred()` holds."""
        for _ in range(max_turns):
            if pred():
                return
            for n in self.nodes:
                n.step()
        raise TimeoutError(f"not reached within {max_turns} turns")

    def stats(self) -> dict[str, list[RankStats]]:
        with self.paused():
            return {n.name: n.stats() for n in self.nodes}

    def wait_settled(self, timeout: float = WAIT_S) -> dict[str, list[RankStats]]:
        """Waits until no rank holds a page, locks a prefix-cache page or has a queued request;
        returns the stats that showed it (the last ones on timeout)."""
        deadline = time.monotonic() + timeout
        while True:
            got = self.stats()
            if all(settled(s) for ranks in got.values() for s in ranks):
                return got
            if time.monotonic() > deadline:
                return got
            time.sleep(0.05)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        for n in self.nodes:
            n.join()


def settled(s: RankStats) -> bool:
    return s.held_pages == 0 and s.locked_cached_pages == 0 and not any(s.queues.values())


def _spec(model: Path, role: str, pp: int, rank: int, engine: dict, **kw) -> RankSpec:
    spec_cls = RankSpec if role == "colocated" else PDRankSpec
    return spec_cls(
        model=str(model),
        engine={**ENGINE, **engine},
        pp_size=pp,
        pp_rank=rank,
        dist_init="",
        role=role,
        **kw,
    )


# --- colocated ------------------------------------------------------------------------------------
@dataclass
class Result:
    """What a client of a node saw for one request."""

    tokens: list[int] = field(default_factory=list)
    finish: FinishEvent | None = None
    error: ErrorEvent | None = None
    prefill: Event | None = None  # PD: the prefill node's answer (PrefillDoneEvent or ErrorEvent)

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish is not None and self.finish.kind != "abort"


def result_of(events: list[Event]) -> Result:
    res = Result()
    for e in events:
        if isinstance(e, TokenEvent):
            res.tokens.append(e.token)
        elif isinstance(e, FinishEvent):
            res.finish = e
        elif isinstance(e, ErrorEvent):
            res.error = e
    return res


class ColocatedCluster(Cluster):
    """A colocated node (`pdserve serve`) of `pp` ranks. `on_parts(parts)` runs on each rank
    after `build_rank` (a test's way to change one rank)."""

    def __init__(
        self,
        model: Path,
        pp: int,
        engine: dict | None = None,
        async_depth: int = 0,
        on_parts: Callable[[RankParts], None] | None = None,
    ):
        super().__init__()
        self.node_ = self.node("colocated", pp)

        def build(rank: int, comm, front) -> SlotLoop:
            spec = _spec(model, "colocated", pp, rank, engine or {}, async_depth=async_depth)
            parts = build_rank(spec, comm=comm)
            parts.front = front
            if on_parts is not None:
                on_parts(parts)
            return colocated_loop(parts)

        self.node_.start(build)
        self.wait_ready()

    def submit(self, rid: str, ids: list[int], max_new: int, **params) -> None:
        p = {"max_tokens": max_new, "ignore_eos": True, **params}
        self.node_.front.submit(AddRequest(rid, list(ids), p))

    def result(self, rid: str) -> Result:
        return result_of(self.node_.front.wait_terminal(rid))

    def generate_all(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        rids = [f"c{next(_ids)}" for _ in prompts]
        for rid, ids in zip(rids, prompts, strict=True):
            self.submit(rid, ids, max_new)
        out = []
        for rid in rids:
            r = self.result(rid)
            assert r.ok, (rid, r)
            out.append(r.tokens)
        return out


# --- prefill + decode ----------------------------------------------------------------------------


class PDCluster(Cluster):
    """A prefill node of `ppp` ranks, a decode node of `dpp` ranks, joined by an InMemoryFabric."""

    def __init__(
        self,
        model: Path,
        ppp: int,
        dpp: int,
        *,
        prefill_engine: dict | None = None,
        decode_engine: dict | None = None,
        transfer: TransferConfig | None = None,
        spec: dict | None = None,
    ):
        """`spec`: RankSpec fields for every rank of both nodes (`waiting_timeout_s=...`)."""
        super().__init__()
        spec = spec or {}
        self.fabric = InMemoryFabric(ppp)
        self.transfer = transfer or TransferConfig(quarantine_s=5.0)
        self.prefill = self.node("prefill", ppp)
        self.decode = self.node("decode", dpp)

        def build_prefill(rank: int, comm, front) -> SlotLoop:
            rank_spec = _spec(model, "prefill", ppp, rank, prefill_engine or {}, **spec)
            parts = build_rank(rank_spec, comm=comm, **prefill_rank.BUILD_KWARGS)
            parts.front = front
            kv = self.fabric.prefill_manager(pool_desc(parts), rank, self.transfer)
            return prefill_rank.make_loop(parts, kv)

        def build_decode(rank: int, comm, front) -> SlotLoop:
            rank_spec = _spec(model, "decode", dpp, rank, decode_engine or {}, **spec)
            parts: RankParts = build_rank(rank_spec, comm=comm, **decode_rank.BUILD_KWARGS)
            parts.front = front
            kv = self.fabric.decode_manager(
                pool_desc(parts),
                rank,
                decode_rank.dst_slices(parts),
                decode_rank.AUX_SLOTS,
                self.transfer,
                sliding_pool_desc(parts),
            )
            return decode_rank.make_loop(parts, kv)

        self.prefill.start(build_prefill)
        self.decode.start(build_decode)
        self.wait_ready()

    def submit(
        self,
        rid: str,
        ids: list[int],
        max_new: int,
        room: int | None = None,
        sides: tuple[str, ...] = ("prefill", "decode"),
        resume: list[int] = (),
        **params,
    ) -> int:
        """What the router does: one request and room to both nodes (`sides`); returns the room.
        `resume`: the tokens a migrated stream already sent (AddRequest.output_ids)."""
        room = room if room is not None else next(_ids) + 1000
        p = {"max_tokens": max_new, "ignore_eos": True, **params}
        out = list(resume)
        if "prefill" in sides:
            self.prefill.front.submit(PDAddRequest(rid, list(ids), p, room, "", output_ids=out))
        if "decode" in sides:
            addr = self.fabric.address
            self.decode.front.submit(PDAddRequest(rid, list(ids), p, room, addr, output_ids=out))
        return room

    def check_late_prefill_after_decode_abort(
        self, rid: str, ids: list[int], max_new: int, room: int
    ) -> None:
        """`rid` was sent to the decode node alone and aborted there: its answer is an abort
        error, and its prefill side, coming later, is refused as `aborted_by_decode`."""
        r = self.result(rid, sides=("decode",))
        assert r.error is not None and "abort" in r.error.message, r
        self.submit(rid, ids, max_new, sides=("prefill",), room=room)
        r = self.result(rid, sides=("prefill",))
        assert isinstance(r.prefill, ErrorEvent), r
        assert "aborted_by_decode" in r.prefill.message, r.prefill

    def submit_local(self, rid: str, ids: list[int], max_new: int) -> None:
        """A decode-local request (no bootstrap fields: the decode node prefills it itself)."""
        p = {"max_tokens": max_new, "ignore_eos": True}
        self.decode.front.submit(AddRequest(rid, list(ids), p))

    def abort(self, rid: str, side: str, reason: str = "client_abort") -> None:
        node = self.prefill if side == "prefill" else self.decode
        node.front.submit(AbortRequest(rid, reason))

    def result(self, rid: str, sides: tuple[str, ...] = ("prefill", "decode")) -> Result:
        res = Result()
        if "decode" in sides:
            res = result_of(self.decode.front.wait_terminal(rid))
        if "prefill" in sides:
            res.prefill = self.prefill.front.wait_terminal(rid)[-1]
        return res

    def generate_all(self, prompts: list[list[int]], max_new: int) -> list[list[int]]:
        rids = [f"r{next(_ids)}" for _ in prompts]
        for rid, ids in zip(rids, prompts, strict=True):
            self.submit(rid, ids, max_new)
        out = []
        for rid in rids:
            r = self.result(rid)
            assert r.ok and isinstance(r.prefill, PrefillDoneEvent), (rid, r)
            out.append(r.tokens)
        return out

    def decode_pools(self) -> list[torch.Tensor]:
        """A copy of every decode rank's KV pool (call it paused)."""
        return [loop.runner.pool.kv.clone() for loop in self.decode.loops]


@contextlib.contextmanager
def running(cluster_factory: Callable[[], Cluster]) -> Iterator[Any]:
    """A cluster for the block; every rank thread stopped and joined after it, error or not."""
    cluster = None
    torch_threads = torch.get_num_threads()  # build_rank sets the process's torch threads
    before = set(threading.enumerate())
    try:
        cluster = cluster_factory()
        yield cluster
        cluster.check()
    finally:
        if cluster is not None:
            cluster.stop()
        torch.set_num_threads(torch_threads)
    for t in set(threading.enumerate()) - before:  # the ranks' and their stores' threads
        t.join(timeout=WAIT_S)
        assert not t.is_alive(), f"thread {t.name} outlived its cluster"
