"""The elastic controller (opt-in: `pdserve router --elastic`, `pdserve up --elastic`): it moves
elastic nodes between the prefill and the decode role as the load shifts (docs/ROUTER.md "Elastic
nodes"; the flip itself is docs/ARCHITECTURE.md section 14).

Every `interval_s` it reads the load the router already predicts from (router/routing/
latency_model.py), per role, over the eligible nodes:

    ttft   the prefill wait a new prompt would see: the smallest predicted time for the prefill
           nodes to finish what is queued on them (decode nodes' own queues when no prefill node
           is up, since decode nodes then prefill)
    itl    the decode step time: the largest predicted step of a decode node at the streams it
           has open

Each number over its target is that role's pressure, and the larger of the two is the
cluster's. The role under more pressure asks for a node when its pressure passes `busy` (short
past `high`), and the controller moves the least loaded elastic node of the other role to it, but
only if the cluster's pressure, predicted again with each role's work spread over its nodes after
the move, falls under `gain` x what it is now. That rule is its own hysteresis: the move back
would raise the pressure it lowered, so it is never asked for on the same load. It also holds
where a move would only move the bottleneck, or where a role's number barely falls with its work
(a decode step that is mostly fixed cost) while the giving role has work of its own. A role that
stays idle without the node (under `busy` after the move), and keeps another, gives it for less:
the pressure need only fall under `spare_gain` x what it is now. It loses nothing by the move,
and stays too idle to ask for the node back on the same load. Under a closed loop of clients
inside their targets a busy role still gains from the other's idle node, but a busy (not short)
role never takes the other's last node. A wish must last `sustain_s`, and no move comes within
`dwell_s` of the last one. A decode node is never taken from the last one of its model's decode
nodes; the last prefill node may go (short only), because decode nodes prefill the prompts
themselves when none is left.

The decision is a pure function of a load snapshot (`decide`; `weigh` says why it holds), so it
is tested on numbers; the controller only times it, runs the flip (`WorkerRegistry.change_role`),
and reports every move with its reason in the log, the metrics (`pdserve_router_role_flips_total`)
and `GET /workers`. For autoscalers, `replicas_needed` scales each role's node count by how far
its number is from its target, and the gauge `pdserve_router_role_replicas_needed` gives that per
role the nodes were started in (`replicas_to_start`), which is what an autoscaler's StatefulSets
count.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass

from pdserve.router.config import ElasticConfig

logger = logging.getLogger(f"pdserve.router[{os.getpid()}]")

DEFAULT_TTFT_TARGET_MS = 2000.0  # without --ttft-slo-ms or --elastic-ttft-target-ms
DEFAULT_ITL_TARGET_MS = 100.0  # without --itl-slo-ms or --elastic-itl-target-ms


@dataclass(frozen=True)
class NodeLoad:
    """One eligible node, as the latency model predicts it now."""

    url: str
    role: str  # prefill or decode
    elastic: bool
    queued_tokens: int  # prompt tokens sent to it and not yet prefilled
    streams: int  # requests the router has open on it
    wait_s: float  # predicted time to prefill what is queued on it
    wait_per_token_s: float  # the fit's slope: the wait one more queued token adds
    step_s: float  # predicted decode step at `streams` (decode nodes)
    step_per_stream_s: float  # the fit's slope: the step one more stream adds
    start_role: str = ""  # the role it was started in ("": `role`)
    replica: int | None = None  # its index in its role's autoscaled StatefulSet, if known


@dataclass(frozen=True)
class Move:
    url: str
    to: str  # the role it becomes
    reason: str  # prefill_short or decode_short
    ttft_s: float
    itl_s: float


def ttft_of(nodes: list[NodeLoad]) -> float:
    """The prefill wait a new prompt sees: the least loaded node that prefills (prefill nodes;
    decode nodes when none is up)."""
    pre = [n for n in nodes if n.role == "prefill"] or [n for n in nodes if n.role == "decode"]
    return min((n.wait_s for n in pre), default=0.0)


def itl_of(nodes: list[NodeLoad]) -> float:
    return max((n.step_s for n in nodes if n.role == "decode"), default=0.0)


def _moved(nodes: list[NodeLoad], mover: NodeLoad, to: str) -> list[NodeLoad]:
    """The same load after `mover` serves `to`: its old role's queue or streams spread over that
    role's other nodes, and the new role's spread over one node more. The mover prefills or steps
    at the new role's nodes' mean fit (its own where that role has none)."""
    old = [n for n in nodes if n.role == mover.role and n is not mover]
    new = [n for n in nodes if n.role == to]
    rest = [n for n in nodes if n.role not in (mover.role, to)]
    gave_q, gave_s = mover.queued_tokens / max(len(old), 1), mover.streams / max(len(old), 1)
    out = [_load(n, n.queued_tokens + gave_q, n.streams + gave_s) for n in old]
    k = len(new) + 1
    # the last prefill node's queue is prefilled by the decode nodes once it has gone
    carried = 0 if old else mover.queued_tokens
    queue_each = (sum(n.queued_tokens for n in new) + carried) / k
    streams_each = sum(n.streams for n in new) / k
    out += [_load(n, queue_each, streams_each) for n in new]
    per_token = _mean([n.wait_per_token_s for n in new], mover.wait_per_token_s)
    per_stream = _mean([n.step_per_stream_s for n in new], mover.step_per_stream_s)
    base = _mean([n.step_s - n.streams * n.step_per_stream_s for n in new], 0.0)
    out.append(
        NodeLoad(
            mover.url,
            to,
            mover.elastic,
            round(queue_each),
            round(streams_each),
            queue_each * per_token,
            per_token,
            base + streams_each * per_stream,
            per_stream,
        )
    )
    return rest + out


def _load(n: NodeLoad, queued: float, streams: float) -> NodeLoad:
    """`n` with `queued` tokens and `streams` streams, along its fits' slopes."""
    wait = max(n.wait_s + (queued - n.queued_tokens) * n.wait_per_token_s, 0.0)
    step = max(n.step_s + (streams - n.streams) * n.step_per_stream_s, 0.0)
    return NodeLoad(
        n.url,
        n.role,
        n.elastic,
        round(queued),
        round(streams),
        wait,
        n.wait_per_token_s,
        step,
        n.step_per_stream_s,
    )


def _mean(xs: list[float], default: float) -> float:
    return sum(xs) / len(xs) if xs else default


def role_pressure(nodes: list[NodeLoad], role: str, ttft_target_s: float, itl_target_s: float):
    """One role's number over its target: the prefill wait, or the decode step."""
    if role == "prefill":
        return ttft_of(nodes) / ttft_target_s
    return itl_of(nodes) / itl_target_s


def pressure(nodes: list[NodeLoad], ttft_target_s: float, itl_target_s: float) -> float:
    """The cluster's worst role: the larger of prefill wait and decode step over their targets."""
    return max(role_pressure(nodes, r, ttft_target_s, itl_target_s) for r in ("prefill", "decode"))


def decide(nodes: list[NodeLoad], cfg: ElasticConfig, ttft_target_s: float, itl_target_s: float):
    """The move the load asks for now, or None. `nodes`: the eligible nodes of one model."""
    return weigh(nodes, cfg, ttft_target_s, itl_target_s)[0]


def weigh(
    nodes: list[NodeLoad], cfg: ElasticConfig, ttft_target_s: float, itl_target_s: float
) -> tuple[Move | None, str]:
    """`decide`'s move, and in words why there is none (for the status page and the benches).

    The role whose number is further over its target takes a node from the other role, if that
    lowers the cluster's pressure (`pressure`, predicted again after the move) to under `gain` x
    what it is now. Below `busy` x its target no role asks for a node; under `high` x its target
    (busy, not short) it leaves the other role one node at least."""
    ttft, itl = ttft_of(nodes), itl_of(nodes)
    p_pre, p_dec = ttft / ttft_target_s, itl / itl_target_s  # each role's number over its target
    now = max(p_pre, p_dec)
    if now <= cfg.busy:
        return None, f"idle (ttft {p_pre:.2f}, itl {p_dec:.2f} of target)"
    to, p_to = ("prefill", p_pre) if p_pre >= p_dec else ("decode", p_dec)
    giver = "decode" if to == "prefill" else "prefill"
    reason = f"{to}_short" if p_to > cfg.high else f"{to}_busy"
    givers = [n for n in nodes if n.role == giver]
    if p_to <= cfg.high and len(givers) < 2:
        return None, f"{reason}: {giver} has one node only"
    load = (lambda n: n.streams) if giver == "decode" else (lambda n: n.queued_tokens)
    mover = _least_loaded(givers, load)
    if mover is None:
        return None, f"{reason}: no {giver} node to spare"
    moved = _moved(nodes, mover, to)
    after = pressure(moved, ttft_target_s, itl_target_s)
    # a role that stays idle without the node gives it for any real gain: it loses nothing, and
    # stays too idle to ask for it back on the same load
    # (never the role's last node: with none left, its work lands on the other role)
    spare = len(givers) > 1 and role_pressure(moved, giver, ttft_target_s, itl_target_s) <= cfg.busy
    if after >= (cfg.spare_gain if spare else cfg.gain) * now:
        return None, f"{reason}: a move gains too little (pressure {now:.2f} -> {after:.2f})"
    return Move(mover.url, to, reason, ttft, itl), ""


def _least_loaded(role_nodes: list[NodeLoad], load) -> NodeLoad | None:
    """The elastic node of a role that would give the least work away, ties by URL (the same
    choice every time); None if that role has one node only or no elastic one."""
    if len(role_nodes) < 2 and role_nodes and role_nodes[0].role == "decode":
        return None  # the last decode node never goes
    candidates = sorted((n for n in role_nodes if n.elastic), key=lambda n: (load(n), n.url))
    return candidates[0] if candidates else None


def replicas_needed(nodes: list[NodeLoad], ttft_target_s: float, itl_target_s: float):
    """Nodes each role needs for its targets: its node count scaled by its number over its
    target (at least one decode node; prefill may need none, decode nodes prefill then)."""
    prefills = sum(n.role == "prefill" for n in nodes)
    decodes = sum(n.role == "decode" for n in nodes)
    ttft, itl = ttft_of(nodes), itl_of(nodes)
    pre = math.ceil(max(prefills, 1) * ttft / ttft_target_s) if ttft_target_s > 0 else prefills
    dec = math.ceil(max(decodes, 1) * itl / itl_target_s) if itl_target_s > 0 else decodes
    return {"prefill": pre, "decode": max(dec, 1)}


def replicas_to_start(nodes: list[NodeLoad], need: dict[str, int]) -> dict[str, int]:
    """`need` (nodes per role served) as nodes per role started in, what an autoscaler counts
    (one StatefulSet per role): a role's nodes that serve the other role now count for it too,
    the other's that serve it count against it. So where the controller's flips already meet
    the need, the counts stay as they are, and a node flipped out of its role keeps its pod.

    A StatefulSet shrinks from its highest pod ordinal, so a role's count never falls to or below
    the `replica` index of one of its nodes that serves the other role now: a scale-down would
    stop that node, the other role's, not one of its own idle ones."""
    out = dict(need)
    keep = {role: 0 for role in out}
    for n in nodes:
        if n.start_role and n.start_role != n.role:
            out[n.start_role] += 1
            out[n.role] -= 1
            if n.replica is not None:
                keep[n.start_role] = max(keep[n.start_role], n.replica + 1)
    return {role: max(0, k, keep[role]) for role, k in out.items()}


class ElasticController:
    """Runs `decide` every `interval_s` on the router's event loop and makes the moves."""

    def __init__(self, cfg: ElasticConfig, slo, registry, model, metrics, on_moved=lambda: None):
        self.cfg, self.registry, self.model, self.metrics = cfg, registry, model, metrics
        self.on_moved = on_moved  # the router's pairs follow the roles
        self.ttft_target_s = (cfg.ttft_target_ms or slo.ttft_ms or DEFAULT_TTFT_TARGET_MS) / 1e3
        self.itl_target_s = (cfg.itl_target_ms or slo.itl_ms or DEFAULT_ITL_TARGET_MS) / 1e3
        self._task: asyncio.Task | None = None
        self._short_since: dict[tuple[str, str], float] = {}  # (url, to) -> first seen
        self._last_move = -math.inf
        self.flipping: str | None = None
        self.moves: deque[dict] = deque(maxlen=32)  # the last moves, for GET /workers
        self.last: dict = {}

    def loads(self) -> dict[str | None, list[NodeLoad]]:
        """The eligible PD nodes' loads, per model."""
        out: dict[str | None, list[NodeLoad]] = {}
        for w in self.registry.all():
            if w.role not in ("prefill", "decode") or not w.eligible():
                continue
            # the streams' own step: one that carries the node's prefills is slow whatever the
            # decode role's size, and would ask for decode nodes that only prefill more
            wait_fit, step_fit = self.model.prefill_fit(w), self.model.decode_step_fit(w.url)
            out.setdefault(w.model, []).append(
                NodeLoad(
                    w.url,
                    w.role,
                    w.elastic,
                    w.queued_prompt_tokens,
                    w.in_flight,
                    wait_fit.predict(w.queued_prompt_tokens) if w.queued_prompt_tokens else 0.0,
                    wait_fit.coefficients()[1],
                    step_fit.predict(w.in_flight),
                    step_fit.coefficients()[1],
                    w.start_role or "",
                    w.replica,
                )
            )
        return out

    def tick(self, now: float) -> Move | None:
        """One look at the load: the gauges, and the move that is due now, if any."""
        due = None
        seen = set()
        total = {"prefill": 0, "decode": 0}
        for model, nodes in sorted(self.loads().items(), key=lambda kv: str(kv[0])):
            need = replicas_needed(nodes, self.ttft_target_s, self.itl_target_s)
            by_start = replicas_to_start(nodes, need)
            for role, n in by_start.items():
                total[role] += n
            self.last = {
                "model": model,
                "ttft_s": round(ttft_of(nodes), 4),
                "itl_s": round(itl_of(nodes), 4),
                "replicas_needed": need,
                "replicas_by_start_role": by_start,
            }
            move, held = weigh(nodes, self.cfg, self.ttft_target_s, self.itl_target_s)
            self.last["held"] = held
            if move is None:
                continue
            key = (move.url, move.to)
            seen.add(key)
            since = self._short_since.setdefault(key, now)
            if now - since >= self.cfg.sustain_s and now - self._last_move >= self.cfg.dwell_s:
                due = due or move
        for role, n in total.items():
            self.metrics.role_replicas_needed.labels(role=role).set(n)
        self._short_since = {k: v for k, v in self._short_since.items() if k in seen}
        return None if self.flipping else due

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.interval_s)
            try:
                move = self.tick(time.monotonic())
                if move is not None:
                    await self.make(move)
            except Exception:  # never stop controlling on one bad look
                logger.exception("elastic controller: a tick failed")

    async def make(self, move: Move) -> None:
        worker = self.registry.get(move.url)
        if worker is None:
            return
        old = worker.role
        self.flipping = move.url
        t0 = time.monotonic()
        logger.warning(
            "elastic: %s %s -> %s (%s: predicted ttft %.3f s, itl %.4f s)",
            move.url,
            old,
            move.to,
            move.reason,
            move.ttft_s,
            move.itl_s,
        )
        outcome = "done"
        try:
            await self.registry.change_role(
                worker, move.to, self.cfg.flip_timeout_s, self.cfg.flip_grace_s
            )
        except (RuntimeError, TimeoutError) as exc:
            outcome = "failed"
            logger.error("elastic: %s did not become %s: %s", move.url, move.to, exc)
        finally:
            self.flipping = None
            self._last_move = time.monotonic()
            self._short_since.clear()
            self.on_moved()
        self.metrics.role_flips.labels(to=move.to, reason=move.reason, outcome=outcome).inc()
        self.moves.append(
            {
                "at": round(time.time(), 3),  # wall clock, for reading it against a bench's load
                "url": move.url,
                "from": old,
                "to": move.to,
                "reason": move.reason,
                "ttft_s": round(move.ttft_s, 4),
                "itl_s": round(move.itl_s, 4),
                "seconds": round(time.monotonic() - t0, 3),
                "outcome": outcome,
            }
        )

    def describe(self) -> dict:
        return {
            "ttft_target_s": self.ttft_target_s,
            "itl_target_s": self.itl_target_s,
            "flipping": self.flipping,
            "last": self.last,
            "moves": list(self.moves),
        }

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="router-elastic")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
