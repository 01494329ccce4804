"""The elastic controller's decisions (router/routing/elastic.py) on load snapshots: which node
moves to which role, and when not; the sustain and dwell times; the per-role node estimate."""

from __future__ import annotations

from dataclasses import replace

from pdserve.router.config import BreakerConfig, ElasticConfig, SloConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.routing.circuit import CircuitBreaker
from pdserve.router.routing.elastic import (
    ElasticController,
    NodeLoad,
    decide,
    itl_of,
    replicas_needed,
    replicas_to_start,
    ttft_of,
    weigh,
)
from pdserve.router.routing.worker import Worker
from pdserve.router.routing.workers import WorkerRegistry

CFG = ElasticConfig(enabled=True)
TTFT, ITL = 2.0, 0.1  # targets, seconds


def node(url, role, queued=0, streams=0, elastic=True, per_token=1e-3, per_stream=2e-3):
    return NodeLoad(
        url,
        role,
        elastic,
        queued,
        streams,
        queued * per_token,
        per_token,
        0.01 + streams * per_stream,
        per_stream,
    )


def decode_at(url, streams, step, per_stream):
    """A decode node whose predicted step at `streams` is `step`."""
    return NodeLoad(url, "decode", True, 0, streams, 0.0, 1e-3, step, per_stream)


def test_a_long_prefill_queue_takes_the_least_busy_decode_node():
    nodes = [
        node("p0", "prefill", queued=4000),  # 4 s of prefill queued: past 0.8 x 2 s
        node("d0", "decode", streams=8),
        node("d1", "decode", streams=2),
    ]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and (move.url, move.to, move.reason) == (
        "d1",
        "prefill",
        "prefill_short",
    )


def test_slow_decode_steps_take_the_least_queued_prefill_node():
    nodes = [
        node("p0", "prefill", queued=300),
        node("p1", "prefill", queued=100),
        node("d0", "decode", streams=60),  # a 0.13 s step: past 0.8 x 0.1 s
    ]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and (move.url, move.to, move.reason) == ("p1", "decode", "decode_short")


def test_no_move_where_it_would_only_move_the_bottleneck():
    # prefill is short (2x its target), but the decode nodes' streams over one node less would
    # take the step to 1.7x its target: the pressure falls only to 0.85x of what it is
    nodes = [
        node("p0", "prefill", queued=4000),
        *(node(f"d{i}", "decode", streams=40) for i in range(2)),
    ]
    move, why = weigh(nodes, CFG, TTFT, ITL)
    assert move is None and why.startswith("prefill_short: a move gains too little")
    # decode is short, and the prefill queue moved to the other prefill node would pass it
    nodes = [
        node("p0", "prefill", queued=1500),
        node("p1", "prefill", queued=1500),
        node("d0", "decode", streams=60),
    ]
    assert decide(nodes, CFG, TTFT, ITL) is None
    # with less queued, the same shortage takes a prefill node: both roles end under target
    nodes[:2] = [node("p0", "prefill", queued=900), node("p1", "prefill", queued=900)]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and (move.to, move.reason) == ("decode", "decode_short")


def test_a_decode_step_of_mostly_fixed_cost_gives_no_reason_to_move():
    """What 2 prefill + 1 decode nodes measured in a decode-heavy phase on a 2-core machine: the
    step is at half its target, but spreading the streams barely shortens it, while the prefill
    wait would double: no move."""
    nodes = [
        node("p0", "prefill", queued=300, per_token=1.1e-3),
        node("p1", "prefill", queued=320, per_token=1.1e-3),
        decode_at("d0", streams=8, step=0.0308, per_stream=6e-4),
    ]
    move, why = weigh(nodes, CFG, TTFT, 0.06)
    assert move is None and why.startswith("decode_busy: a move gains too little"), why


def test_an_idle_prefill_role_gives_a_node_for_a_small_gain():
    """The decode phase of bench/results/elastic_phases.md (07:08 run, 2 prefill + 1 decode): no
    prompt queued, the step 25.4 ms at 8 streams against a 60 ms target, mostly fixed cost.
    Spread over two decode nodes it falls to 0.91x, short of `gain` (0.8x), and the old rule held
    the move for 28 s of the phase, while 1 prefill + 2 decode nodes served it at 0.83-0.87x the
    step. The prefill role stays idle without the node, so the move is taken; after it, the idle
    prefill role asks for nothing, and decode may not take its last node."""
    nodes = [
        node("p0", "prefill"),
        node("p1", "prefill"),
        decode_at("d0", streams=8, step=0.0254, per_stream=6e-4),
    ]
    move, why = weigh(nodes, CFG, TTFT, 0.06)
    assert move is not None and (move.url, move.to, move.reason) == ("p0", "decode", "decode_busy")
    after = [
        node("p1", "prefill"),
        decode_at("d0", streams=4, step=0.0230, per_stream=6e-4),
        decode_at("p0", streams=4, step=0.0230, per_stream=6e-4),
    ]
    move, why = weigh(after, CFG, TTFT, 0.06)
    assert move is None and why.startswith("decode_busy: prefill has one node only"), why
    # a prefill role that would be busy without the node (0.35 of its target after the move,
    # over busy): the same move, which the smaller gain would take (pressure 0.42 -> 0.38), holds
    busy = [node("p0", "prefill", queued=350), node("p1", "prefill", queued=350), nodes[2]]
    move, why = weigh(busy, CFG, TTFT, 0.06)
    assert move is None and why.startswith("decode_busy: a move gains too little"), why


def test_the_last_prefill_node_is_never_spare():
    """Its queue would land on the decode nodes (whose step alone the controller reads), so it
    goes only for the full gain: 1,200 tokens queued (0.6 of 2 s), two decode nodes at 0.85 of a
    60 ms step. One node more would bring the step to 0.80 (0.94x), which is no reason to prefill
    every prompt between the streams' steps."""
    nodes = [
        node("p0", "prefill", queued=1200, per_token=1e-3),
        decode_at("d0", streams=16, step=0.051, per_stream=6e-4),
        decode_at("d1", streams=16, step=0.051, per_stream=6e-4),
    ]
    move, why = weigh(nodes, CFG, TTFT, 0.06)
    assert move is None and why.startswith("decode_short: a move gains too little"), why


def test_the_move_back_comes_when_prefill_is_short_again():
    """The state that kept an elastic cluster in 1 prefill + 2 decode nodes through a prefill
    phase (bench/results/elastic_phases.md, 05:58 run): a 3.4 s predicted prefill wait against
    2 s, a 30 ms step against 60 ms that is mostly fixed cost. The earlier rule held (the decode
    role, at half its target, could not stay under 0.5 x it with one node less); moving a decode
    node back to prefill halves the wait and barely lengthens the step."""
    nodes = [
        node("p0", "prefill", queued=3100, per_token=1.1e-3),
        decode_at("d0", streams=4, step=0.0297, per_stream=6e-4),
        decode_at("d1", streams=4, step=0.0290, per_stream=6e-4),
    ]
    move = decide(nodes, CFG, TTFT, 0.06)
    assert move is not None and (move.url, move.to, move.reason) == (
        "d0",
        "prefill",
        "prefill_short",
    )
    # and once it is back, the same load asks for no move to decode
    after = [
        node("p0", "prefill", queued=1550, per_token=1.1e-3),
        node("d0", "prefill", queued=1550, per_token=1.1e-3),
        decode_at("d1", streams=8, step=0.032, per_stream=6e-4),
    ]
    assert decide(after, CFG, TTFT, 0.06) is None


def test_the_last_decode_node_and_fixed_nodes_never_move():
    nodes = [node("p0", "prefill", queued=9000), node("d0", "decode", streams=0)]
    assert decide(nodes, CFG, TTFT, ITL) is None
    nodes = [
        node("p0", "prefill", queued=9000),
        node("d0", "decode", elastic=False),
        node("d1", "decode", elastic=False),
    ]
    assert decide(nodes, CFG, TTFT, ITL) is None
    # the last prefill node may go: decode nodes prefill when none is left
    nodes = [node("p0", "prefill", queued=0), node("d0", "decode", streams=60)]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and move.to == "decode"


def test_a_move_does_not_ask_for_the_opposite_move():
    """The band between low and high: after a decode node became a prefill node (its streams
    moved to the other decode nodes), the decode side is still under `high`."""
    nodes = [
        node("p0", "prefill", queued=4000),
        node("d0", "decode", streams=6),
        node("d1", "decode", streams=4),
        node("d2", "decode", streams=2),
    ]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and move.url == "d2"
    after = [
        node("p0", "prefill", queued=2000),
        node("d2", "prefill"),
        node("d0", "decode", streams=7),
        node("d1", "decode", streams=5),
    ]
    assert itl_of(after) < CFG.high * ITL
    assert decide(after, CFG, TTFT, ITL) is None or decide(after, CFG, TTFT, ITL).to != "decode"


def test_replicas_needed_scale_with_the_predicted_latency():
    nodes = [
        node("p0", "prefill", queued=5000),
        node("d0", "decode", streams=60),
        node("d1", "decode"),
    ]
    assert ttft_of(nodes) == 5.0 and abs(itl_of(nodes) - 0.13) < 1e-9
    assert replicas_needed(nodes, TTFT, ITL) == {"prefill": 3, "decode": 3}
    assert replicas_needed([node("d0", "decode")], TTFT, ITL) == {"prefill": 0, "decode": 1}


def test_a_flipped_node_counts_for_the_role_it_started_in():
    """An autoscaler counts pods by the StatefulSet that started them: where the controller has
    flipped a prefill node to decode and that meets the need, the counts by start role stay what
    is running (2 prefill pods, 1 decode pod), where counts by role served would shrink prefill
    to 1 (possibly removing the flipped node) and grow decode to 2."""
    flipped = replace(node("p1", "decode"), start_role="prefill")
    nodes = [node("p0", "prefill"), flipped, node("d0", "decode")]
    need = {"prefill": 1, "decode": 2}
    assert replicas_to_start(nodes, need) == {"prefill": 2, "decode": 1}
    assert replicas_to_start(nodes, {"prefill": 0, "decode": 1}) == {"prefill": 1, "decode": 0}
    plain = [node("p0", "prefill"), node("d0", "decode")]
    assert replicas_to_start(plain, need) == need  # nothing flipped: the same counts
    c = _controller(nodes)
    c.tick(0.0)
    served = c.last["replicas_needed"]
    assert c.last["replicas_by_start_role"] == replicas_to_start(nodes, served)
    for role in ("prefill", "decode"):
        got = c.metrics.registry.get_sample_value(
            "pdserve_router_role_replicas_needed", {"role": role}
        )
        assert got == c.last["replicas_by_start_role"][role]


def test_a_scale_down_never_reaches_a_flipped_node():
    """A StatefulSet shrinks from its highest ordinal. Prefill pod 1, flipped to decode, serves
    the second decode node; when prefill needs no node, counting it for prefill alone would ask
    for 1 prefill pod, and the scale-down would stop pod 1, a decode node, not idle pod 0. Its
    ordinal keeps the count at 2 until the controller moves it back; an unflipped pod, or one
    whose ordinal is unknown, does not."""
    flipped = replace(node("p1", "decode"), start_role="prefill", replica=1)
    nodes = [replace(node("p0", "prefill"), replica=0), flipped, node("d0", "decode")]
    assert replicas_to_start(nodes, {"prefill": 0, "decode": 1}) == {"prefill": 2, "decode": 0}
    low = [replace(node("p0", "decode"), start_role="prefill", replica=0), node("p1", "prefill")]
    assert replicas_to_start(low, {"prefill": 0, "decode": 1}) == {"prefill": 1, "decode": 0}
    unknown = [replace(flipped, replica=None), node("d0", "decode")]
    assert replicas_to_start(unknown, {"prefill": 0, "decode": 1}) == {"prefill": 1, "decode": 0}


class FakeRegistry:
    def all(self):
        return []


def _controller(loads):
    c = ElasticController(
        ElasticConfig(enabled=True, sustain_s=3, dwell_s=20),
        SloConfig(),
        FakeRegistry(),
        None,
        RouterMetrics(),
    )
    c.loads = lambda: {"m": loads}  # the snapshot under test
    return c


def test_a_shortage_must_last_and_moves_keep_their_distance():
    loads = [
        node("p0", "prefill", queued=4000),
        node("d0", "decode", streams=8),
        node("d1", "decode", streams=2),
    ]
    c = _controller(loads)
    assert c.tick(100.0) is None  # first seen
    assert c.tick(102.0) is None  # not for 3 s yet
    move = c.tick(103.0)
    assert move is not None and move.url == "d1"
    c._last_move, c._short_since = 103.0, {}  # what make() leaves
    assert c.tick(110.0) is None and c.tick(120.0) is None  # within the dwell time
    assert c.tick(123.5) is not None
    c.flipping = "d1"
    assert c.tick(130.0) is None  # one move at a time
    assert c.last["replicas_needed"] == {"prefill": 2, "decode": 1}


def test_an_idle_role_gives_a_node_to_a_busy_one_and_keeps_one():
    """Under its targets a closed loop still waits on the busy role: a role under `idle` x its
    target beside one over `busy` x its own gives it a node, but never its last one."""
    nodes = [
        node("p0", "prefill", queued=10),  # a 0.01 s wait: idle against 2 s
        node("p1", "prefill", queued=0),
        node("d0", "decode", streams=12),  # a 0.034 s step: over 0.3 x 0.1 s
    ]
    move = decide(nodes, CFG, TTFT, ITL)
    assert move is not None and (move.url, move.to, move.reason) == ("p1", "decode", "decode_busy")
    assert decide([n for n in nodes if n.url != "p1"], CFG, TTFT, ITL) is None  # the last one
    nodes = [
        node("p0", "prefill", queued=1000),  # 1 s: over 0.3 x 2 s
        node("d0", "decode", streams=0),
        node("d1", "decode", streams=0),
    ]
    move = decide(nodes, CFG, TTFT, 0.2)  # idle steps: 0.01 s against 0.2 s
    assert move is not None and (move.to, move.reason) == ("prefill", "prefill_busy")


def test_the_router_learns_the_role_an_elastic_node_started_in():
    """From the node's /server_info; only an elastic node's counts, and only a PD role."""
    w = Worker("http://n:1", "decode", CircuitBreaker(BreakerConfig()))
    WorkerRegistry._learn(w, {"elastic": True, "role": "decode", "start_role": "prefill"})
    assert w.start_role == "prefill"
    WorkerRegistry._learn(w, {"elastic": True, "role": "decode", "start_role": "colocated"})
    assert w.start_role is None
    WorkerRegistry._learn(w, {"role": "decode", "start_role": "prefill"})  # not elastic
    assert w.start_role is None
