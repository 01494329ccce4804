"""The slot loop of a colocated node with its ranks as threads (tests/inproc.py), and the seams that
make that possible: the in-memory PP group (runtime/rank/pp_comm_memory.py) and the per-thread rank
consensus checker (consensus/rank_checker.py). Real processes: tests/test_pp_node.py."""

from __future__ import annotations

import random
import threading
from collections import Counter

import pytest
import torch
from inproc import ClusterError, ColocatedCluster, running, settled

from pdserve.consensus import rank_checker
from pdserve.runtime.messages import AbortRequest
from pdserve.runtime.rank.idle_wait import IdleWait
from pdserve.runtime.rank.pp_comm import Msg
from pdserve.runtime.rank.pp_comm_memory import CommClosed, MemoryPPGroup
from pdserve.runtime.rank.slot_loop import RankDivergence

MAX_NEW = 12


# PP 4 over 6 layers is the uneven split 2/2/1/1 (earlier ranks take the extra layers).
SLICES = {1: [(0, 6)], 2: [(0, 3), (3, 6)], 3: [(0, 2), (2, 4), (4, 6)]}
SLICES[4] = [(0, 2), (2, 4), (4, 5), (5, 6)]


@pytest.mark.parametrize(
    "pp,depth",
    [(1, 0), (2, 0), (3, 0), (4, 0), (2, 1)],
    ids=["pp1", "pp2", "pp3", "pp4-uneven-2/2/1/1", "pp2-async1"],
)
def test_colocated_matches_transformers(pp, depth, tiny6, tiny6_greedy):
    prompts, reference = tiny6_greedy
    with running(lambda: ColocatedCluster(tiny6, pp, async_depth=depth)) as c:
        slices = [(lp.runner.model.layer_start, lp.runner.model.layer_end) for lp in c.node_.loops]
        assert slices == SLICES[pp]
        got = c.generate_all(prompts, MAX_NEW)
        for i, (g, want) in enumerate(zip(got, reference, strict=True)):
            assert g == want[:MAX_NEW], f"prompt {i} (len {len(prompts[i])}) differs"
        stats = c.wait_settled()
        assert all(settled(s) for s in stats["colocated"]), stats
        # A prompt seen before is served from the prefix cache, and the answer stays the same.
        assert c.generate_all(prompts[-1:], MAX_NEW) == [reference[-1][:MAX_NEW]]
        stats = c.wait_settled()
        assert all(settled(s) and s.prefix_hit_tokens > 0 for s in stats["colocated"]), stats
        assert all(t.checker.calls > 0 for t in c.node_.ranks)


def test_planted_divergence_is_caught(tiny6, tiny6_greedy):
    """Each rank thread keeps its own consensus checker: a rank-local allocation on one rank (the
    kind of bug the checker is for) stops the node at the next comparison."""
    prompts, _ = tiny6_greedy

    def plant(parts):
        if parts.spec.pp_rank == 1:
            parts.runner.pool.allocator.alloc(1)

    with (
        pytest.raises(ClusterError) as err,
        running(lambda: ColocatedCluster(tiny6, 2, on_parts=plant)) as c,
    ):
        c.generate_all(prompts[3:], MAX_NEW)
    cause = err.value.__cause__
    assert isinstance(cause, RankDivergence), repr(cause)
    assert "first diverging call" in str(cause) and "'schedule'" in str(cause), str(cause)


def _phase(loop, rid: str) -> str:
    """Where PP0 has `rid`: waiting, prefilling (mid-prompt), decoding, or ended."""
    req = loop.sched.reqs.get(rid)
    if req is None:
        return "ended"
    if req.status.value == "waiting":
        return "waiting"
    return "decoding" if req.output_ids else "prefilling"


def _storm_turns(c, rids, rng, p_abort: float) -> Counter:
    """Runs the node turn by turn until every request in `rids` ended, aborting each live one with
    probability `p_abort` before each turn; returns where the aborted ones were (`_phase`)."""
    front, aborted = c.node_.front, Counter()
    pp0 = c.node_.loops[0]

    def ended(rid):
        return any(e.terminal for e in front.events.get(rid, []))

    for _ in range(3000):
        live = [rid for rid in rids if rid not in aborted and not ended(rid)]
        if not live:
            return aborted
        for rid in live:
            if rng.random() < p_abort:
                front.submit(AbortRequest(rid, "client_abort"))
                aborted[rid] = _phase(pp0, rid)
        c.node_.step()
    raise AssertionError("the storm's requests did not end within 3000 turns")


def test_abort_storm_pp3(tiny6, tiny6_greedy):
    """Aborts at seeded random turns of a PP 3 node, on any of its three slots: in the waiting
    queue (8 running places for 60 requests), between prefill chunks, while decoding, and after the
    answer ended. Every request ends; a finished answer is the reference, an aborted one a prefix
    of it; no page stays held or locked, and the node still answers. (The same through HTTP streams
    that clients cut: tests/test_chaos_abort_storm.py, 1,000 requests through `pdserve up`.)"""
    prompts, reference = tiny6_greedy
    rng = random.Random(3)
    with running(lambda: ColocatedCluster(tiny6, 3, engine={"max_running": 8})) as c:
        rids = {f"s{i}": i % len(prompts) for i in range(60)}
        with c.stepping():
            for rid, k in rids.items():
                c.submit(rid, prompts[k], MAX_NEW)
            aborted = _storm_turns(c, list(rids), rng, p_abort=0.01)
        where = Counter(aborted.values())
        assert where["waiting"] and where["prefilling"] and where["decoding"], where
        cut = 0
        for rid, k in rids.items():
            r = c.result(rid)
            want = reference[k][:MAX_NEW]
            if r.ok:
                assert r.tokens == want, (rid, r)
            else:
                assert rid in aborted and r.finish is not None and r.finish.kind == "abort", r
                assert r.tokens == want[: len(r.tokens)], (rid, r)
                cut += 1
        assert 10 <= cut < len(rids) - 10, (cut, where)
        # Aborts for requests that already ended change nothing.
        done = [rid for rid in rids if rid not in aborted][:5]
        c.node_.front.submit(*(AbortRequest(rid, "client_abort") for rid in done))
        stats = c.wait_settled()
        assert all(settled(s) for s in stats["colocated"]), stats
        assert c.generate_all(prompts[:2], MAX_NEW) == [x[:MAX_NEW] for x in reference[:2]]


def test_rank_checker_is_per_thread():
    mine, other = rank_checker.RankChecker(), rank_checker.RankChecker()
    seen = {}

    def rank(checker, name):
        rank_checker.bind(checker)
        rank_checker.checker().record(name, [1], None)
        seen[name] = rank_checker.checker()
        rank_checker.bind(None)

    threads = [
        threading.Thread(target=rank, args=(mine, "a")),
        threading.Thread(target=rank, args=(other, "b")),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert seen == {"a": mine, "b": other}
    assert mine.calls == other.calls == 1 and mine.digest63() != other.digest63()
    assert rank_checker.checker() is rank_checker.CHECKER  # an unbound thread: the process's


def test_the_switch_is_read_per_call_from_the_environment(monkeypatch):
    """A rank forked from a zygote imported its decision points under the zygote's environment;
    its own environment decides (configure_from_env), whatever it was at definition time."""
    monkeypatch.setattr(rank_checker, "ENABLED", False)
    point = rank_checker.rank_consensus("probe", args=lambda x: x)(lambda x: x + 1)
    mine = rank_checker.RankChecker()
    rank_checker.bind(mine)
    try:
        monkeypatch.setenv(rank_checker.ENV, "1")
        rank_checker.configure_from_env()
        assert point(1) == 2 and mine.calls == 1
        monkeypatch.setenv(rank_checker.ENV, "0")
        rank_checker.configure_from_env()
        assert point(2) == 3 and mine.calls == 1
    finally:
        rank_checker.bind(None)


# --- the in-memory PP group -----------------------------------------------------------------------
def test_messages_go_through_msgpack_and_kinds_are_parked():
    group = MemoryPPGroup(2, timeout_s=5)
    a, b = group.comm(0), group.comm(1)
    a.send_obj(1, [("x", 1)], Msg.META)
    a.send_tensor(1, torch.arange(3.0), Msg.HIDDEN)
    a.send_obj(1, {"k": b"v"}, Msg.OUTPUT)
    assert b.recv(0, Msg.OUTPUT) == {"k": b"v"}  # the two before it are parked
    assert torch.equal(b.recv(0, Msg.HIDDEN), torch.arange(3.0))
    assert b.recv(0, Msg.META) == [["x", 1]]  # a tuple crossed the wire as a list
    with pytest.raises(TypeError):
        a.send_obj(1, object())
    a.commit()  # every send was received: nothing to wait for
    assert (a.prev, a.next, b.prev, b.next) == (1, 1, 0, 0)


def test_commit_waits_for_the_receiver_and_waits_are_bounded():
    group = MemoryPPGroup(2, timeout_s=0.3)
    a, b = group.comm(0), group.comm(1)
    a.send_obj(1, 1, Msg.META, commit_after=2)
    a.commit()  # turn 1: not due yet
    with pytest.raises(TimeoutError, match="not received"):
        a.commit()  # turn 2: due, and rank 1 never took it
    with pytest.raises(TimeoutError, match="nothing from 1"):
        a.recv(1, Msg.META)
    got = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(CommClosed, b.recv, 0, Msg.VOTE)))
    b.recv(0, Msg.META)
    t.start()
    group.close()
    t.join(timeout=5)
    assert not t.is_alive() and got
    with pytest.raises(CommClosed):
        a.send_obj(1, 2)


def test_collectives_meet_in_call_order():
    group = MemoryPPGroup(3, timeout_s=5)
    out = {}

    def rank(r):
        comm = group.comm(r)
        out[r] = (comm.all_min_max([r, -r]), comm.all_gather([r * 10]))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    for r in range(3):
        assert out[r] == (([0, -2], [2, 0]), [[0], [10], [20]])
    with pytest.raises(TimeoutError, match="waited"):
        MemoryPPGroup(2, timeout_s=0.2).comm(0).all_gather([1])


def test_idle_wait_backs_off_and_resets():
    """PP0's wait for the front (runtime/rank/idle_wait.py): none with work; with only outstanding
    work it doubles to its 20 ms cap while that work does not move and restarts when it moves; idle,
    it doubles to 250 ms; a message restarts it."""
    w = IdleWait(first_ms=5, idle_max_ms=250, outstanding_max_ms=20)
    room = (("transfer", 1),)
    assert [w.next(False, room) for _ in range(4)] == [5, 10, 20, 20]
    assert w.next(False, (("running", 1),)) == 5  # the room moved on
    assert w.next(True, None) == 0
    assert [w.next(False, None) for _ in range(8)] == [5, 10, 20, 40, 80, 160, 250, 250]
    w.woken()
    assert w.next(False, None) == 5
    with pytest.raises(ValueError, match="first_ms"):
        IdleWait(first_ms=0)
