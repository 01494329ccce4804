"""Ring votes and leader sync with threads standing in for ranks
(InMemoryRing), plus KVPoll rules."""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.consensus import (
    Ballot,
    ConsensusError,
    ConsensusTimeout,
    InMemoryRing,
    KVPoll,
    LeaderSync,
    PPGroupTransport,
    RingVote,
    Verdict,
    done_for,
    update_status,
)
from pdserve.consensus.vote import merge

JOIN_S = 20.0


def run_ranks(size: int, body, timeout_s: float = 5.0) -> list:
    """Run body(rank, transport) on `size` threads; return their results,
    re-raise the first error."""
    ring = InMemoryRing(size, timeout_s=timeout_s)
    results: list = [None] * size
    errors: list = []

    def target(rank: int) -> None:
        try:
            results[rank] = body(rank, ring.transport(rank))
        except BaseException as e:  # reported to the test below
            errors.append((rank, e))

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_S)
    assert not any(t.is_alive() for t in threads), "a rank thread hung"
    if errors:
        raise errors[0][1]
    return results


# ---- KVPoll -------------------------------------------------------------------------------------
def test_kvpoll_order_and_rule_table():
    assert [int(p) for p in KVPoll] == [0, 1, 2, 3, 4]
    assert update_status(None, KVPoll.Bootstrapping) == KVPoll.Bootstrapping
    assert update_status(None, KVPoll.WaitingForInput) == KVPoll.WaitingForInput
    assert update_status(None, KVPoll.Failed) == KVPoll.Failed
    for bad_start in (KVPoll.Transferring, KVPoll.Success):
        with pytest.raises(ValueError):
            update_status(None, bad_start)
    with pytest.raises(ValueError):
        update_status(KVPoll.Bootstrapping, 7)
    assert update_status(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert update_status(KVPoll.Success, KVPoll.Failed) == KVPoll.Failed
    assert update_status(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([KVPoll.Bootstrapping, KVPoll.WaitingForInput]),
    st.lists(st.sampled_from(list(KVPoll)), max_size=12),
)
def test_kvpoll_only_moves_up_and_failed_is_terminal(start, updates):
    cur = update_status(None, start)
    for new in updates:
        nxt = update_status(cur, new)
        if cur == KVPoll.Failed:
            assert nxt == KVPoll.Failed
        elif new != KVPoll.Failed:
            assert nxt == max(cur, new)
        cur = nxt


def test_done_for_kinds():
    assert done_for("release", KVPoll.Success) and done_for("release", KVPoll.Failed)
    assert not done_for("release", KVPoll.Transferring) and not done_for("release", None)
    assert done_for("prealloc", KVPoll.WaitingForInput) and not done_for(
        "prealloc", KVPoll.Bootstrapping
    )
    with pytest.raises(ValueError, match="known"):
        done_for("nope", KVPoll.Success)


# ---- ballots, merge, verdicts -------------------------------------------------------------------
def test_ballot_moves_aborted_from_good_to_bad():
    b = Ballot(good=frozenset({1, 2, 3}), bad=frozenset({4, 3}), aborted=frozenset({2, 9}))
    assert b.resolved() == (frozenset({1}), frozenset({2, 3, 4}))
    for bad_id in (1.5, True, KVPoll.Success, b"x"):
        with pytest.raises(TypeError):
            Ballot(good=frozenset({bad_id})).resolved()
    st_ = {1: KVPoll.Success, 2: KVPoll.Failed, 3: KVPoll.Transferring, 4: KVPoll.WaitingForInput}
    assert Ballot.from_statuses("release", st_).resolved() == (frozenset({1}), frozenset({2}))
    assert Ballot.from_statuses("prealloc", st_).resolved() == (
        frozenset({1, 3, 4}),
        frozenset({2}),
    )


sets = st.frozensets(st.integers(0, 15), max_size=10)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(sets, sets, sets), min_size=1, max_size=8))
def test_merge_equals_closed_form(ranks):
    resolved = [Ballot(g, b, a).resolved() for g, b, a in ranks]
    tally = resolved[0]
    for g, b in resolved[1:]:
        tally = merge(tally, g, b)
    goods = [g for g, _ in resolved]
    terms = [g | b for g, b in resolved]
    assert tally[0] == frozenset.intersection(*goods)
    assert tally[1] == frozenset.union(*[b for _, b in resolved]) & frozenset.intersection(*terms)
    assert not tally[0] & tally[1]


def test_partition_retries_ids_not_final_locally(caplog):
    v = Verdict(good=frozenset({1, 2}), bad=frozenset({3}))
    with caplog.at_level(logging.WARNING):
        good, bad, retry = v.partition(lambda i: i != 2, kind="release")
    assert (good, bad, retry) == (frozenset({1}), frozenset({3}), frozenset({2}))
    assert "retried next turn" in caplog.text


# ---- the property test: threads as ranks --------------------------------------------------------
@dataclass(frozen=True)
class Obs:
    final_at: int | None  # iteration from which the id is final on this rank (None: never)
    bad: bool  # final state is bad (Failed)
    aborted_at: int | None  # iteration from which the id is aborted on this rank


def obs_strategy(iters: int):
    when = st.one_of(st.none(), st.integers(0, iters))
    return st.builds(Obs, when, st.booleans(), st.one_of(st.none(), st.integers(0, iters)))


KINDS = ("release", "retract")
IDS = {"release": list(range(6)), "retract": [f"r{i}" for i in range(4)]}


def ballot_at(obs: dict, applied: set, i: int) -> Ballot:
    good = {
        x
        for x, o in obs.items()
        if x not in applied and o.final_at is not None and o.final_at <= i and not o.bad
    }
    bad = {
        x
        for x, o in obs.items()
        if x not in applied and o.final_at is not None and o.final_at <= i and o.bad
    }
    aborted = {
        x
        for x, o in obs.items()
        if x not in applied and o.aborted_at is not None and o.aborted_at <= i
    }
    return Ballot(frozenset(good), frozenset(bad), frozenset(aborted))


def vote_and_apply(rank, transport, obs: dict, slots: int, iters: int) -> list:
    """One rank's loop: vote its ballots each iteration, apply the verdict harvested from the
    next slot, and return what it applied (per iteration, per kind: (kind, good, bad))."""
    vote = RingVote(transport, slots, kinds=KINDS)
    applied = {k: set() for k in KINDS}
    log = []
    for i in range(iters):
        slot = i % slots
        vote.pass1(slot, {k: ballot_at(obs[k][rank], applied[k], i) for k in KINDS})
        verdicts = vote.pass2((slot + 1) % slots)
        row = []
        for k in KINDS:
            mine = obs[k][rank]
            good, bad, retry = verdicts[k].partition(
                lambda x, mine=mine, i=i: mine[x].final_at is not None and mine[x].final_at <= i,
                kind=k,
            )
            assert not retry, f"rank {rank} iteration {i}: {k} applied before final: {retry}"
            assert not (good | bad) & applied[k], "an id was applied twice"
            applied[k] |= good | bad
            row.append((k, good, bad))
        log.append(row)
    return log


def check_against_reference(log, obs: dict, kn: int, k: str, size: int, slots: int, iters: int):
    """Replay with the reference formula: the verdict applied in iteration i was cast in
    j = i - L + 1, from ballots that exclude ids applied before j, minus ids cast earlier and not
    yet applied."""
    for i in range(iters):
        _, good, bad = log[i][kn]
        j = i - slots + 1
        if j < 0:
            assert not good and not bad, "a verdict was applied before any vote in its slot"
            continue
        exp = [ballot_at(obs[k][r], applied_before(log, kn, j), j).resolved() for r in range(size)]
        pending = pending_at(log, kn, j, slots)
        final = frozenset.intersection(*[g | b for g, b in exp])
        assert good == frozenset.intersection(*[g for g, _ in exp]) - pending, (
            f"{k} good, iteration {i}"
        )
        assert bad == (frozenset.union(*[b for _, b in exp]) & final) - pending, (
            f"{k} bad, iteration {i}"
        )
        for x in good | bad:  # nothing before every rank was final; aborted => bad
            assert all(
                obs[k][r][x].final_at is not None and obs[k][r][x].final_at <= j
                for r in range(size)
            )
            if any(
                obs[k][r][x].aborted_at is not None and obs[k][r][x].aborted_at <= j
                for r in range(size)
            ):
                assert x in bad


def check_liveness(log, obs: dict, kn: int, k: str, size: int, slots: int, iters: int):
    """Liveness: an id final on every rank by iteration iters - L is applied by the end."""
    applied = applied_before(log, kn, iters)
    for x in IDS[k]:
        if all(
            obs[k][r][x].final_at is not None and obs[k][r][x].final_at <= iters - slots
            for r in range(size)
        ):
            assert x in applied, f"{k} id {x} final everywhere but never applied"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_every_rank_applies_the_same_verdict_in_the_same_slot(data):
    size = data.draw(st.integers(1, 8), label="pp_size")
    slots = size + data.draw(st.integers(0, 2), label="async_depth")
    iters = 2 * slots + 8
    obs = {
        k: [{x: data.draw(obs_strategy(iters)) for x in IDS[k]} for _ in range(size)] for k in KINDS
    }

    def rank_loop(rank, transport):
        return vote_and_apply(rank, transport, obs, slots, iters)

    logs = run_ranks(size, rank_loop)
    assert all(log == logs[0] for log in logs), "ranks applied different verdicts"
    log = logs[0]
    for kn, k in enumerate(KINDS):
        check_against_reference(log, obs, kn, k, size, slots, iters)
        check_liveness(log, obs, kn, k, size, slots, iters)


def applied_before(log, kn: int, j: int) -> set:
    """Ids applied (on every rank alike) in iterations < j."""
    return set().union(*[log[i][kn][1] | log[i][kn][2] for i in range(j)])


def pending_at(log, kn: int, j: int, slots: int) -> set:
    """Ids cast in a verdict before iteration j and applied in iteration >= j
    (harvest still to come)."""
    return set().union(
        *[log[i][kn][1] | log[i][kn][2] for i in range(j, min(len(log), j + slots - 1))]
    )


# ---- call order, protocol errors, timeouts ------------------------------------------------------
def test_pass1_twice_on_a_slot_is_a_protocol_error():
    vote = RingVote(InMemoryRing(1).transport(0), num_slots=2)
    vote.pass1(0, {})
    with pytest.raises(ConsensusError, match="again"):
        vote.pass1(0, {})
    with pytest.raises(ValueError):
        vote.pass1(5, {})
    with pytest.raises(ValueError, match="unknown vote kind"):
        vote.pass1(1, {"nope": Ballot()})


def test_ranks_out_of_step_raise_consensus_error():
    def body(rank, t):
        kinds = ("release",) if rank == 0 else ("release", "retract")
        RingVote(t, 2, kinds=kinds).pass1(0, {})

    with pytest.raises(ConsensusError, match="out of step"):
        run_ranks(2, body)


def test_silent_previous_rank_raises_timeout_with_context():
    ring = InMemoryRing(2, timeout_s=0.2)
    vote = RingVote(ring.transport(1), 2)
    with pytest.raises(ConsensusTimeout, match="slot 0"):
        vote.pass1(0, {})


def test_pp_group_transport_adapter_over_fake_group():
    links = {(s, d): queue.SimpleQueue() for s in range(3) for d in range(3)}

    def make(rank):
        def send(dst, payload):
            assert isinstance(payload, bytes)
            links[(rank, dst)].put(payload)

        def recv(src, timeout_s):
            try:
                return links[(src, rank)].get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError from None

        return PPGroupTransport(rank, 3, send, recv, timeout_s=2.0)

    ring_results: list = [None] * 3

    def target(r):
        t = make(r)
        v = RingVote(t, 1, kinds=("prealloc",))
        v.pass1(
            0,
            {
                "prealloc": Ballot(
                    good=frozenset({1, 2}), bad=frozenset({5} if r == 1 else ()) | {7}
                )
            },
        )
        ring_results[r] = (
            v.pass2(0)["prealloc"],
            LeaderSync(t).sync_polls([KVPoll.Success] if r == 0 else None),
        )

    threads = [threading.Thread(target=target, args=(r,), daemon=True) for r in range(3)]
    [t.start() for t in threads]
    [t.join(JOIN_S) for t in threads]
    assert ring_results == [(Verdict(frozenset({1, 2}), frozenset({7})), [KVPoll.Success])] * 3
    t0 = PPGroupTransport(
        0, 3, lambda d, p: None, lambda s, to: (_ for _ in ()).throw(TimeoutError()), 0.1
    )
    with pytest.raises(ConsensusTimeout):
        t0.recv_prev()


# ---- leader sync --------------------------------------------------------------------------------
@pytest.mark.parametrize("size", [1, 2, 5])
def test_leader_sync_sends_pp0_list_down_the_chain(size):
    polls = [KVPoll.WaitingForInput, KVPoll.Bootstrapping, KVPoll.Failed]

    def body(rank, t):
        sync, vote = LeaderSync(t), RingVote(t, 1)
        out = []
        for i in range(3):  # shares the links with a vote in the same iteration
            vote.pass1(0, {"release": Ballot(good=frozenset({i}))})
            out.append(sync.sync_polls(polls[i:] if rank == 0 else None))
            out.append(vote.pass2(0)["release"])
            out.append(sync.sync("rids", ["a", "b"] if rank == 0 else None))
        return out

    results = run_ranks(size, body)
    assert all(r == results[0] for r in results)
    assert results[0][0] == polls and results[0][1] == Verdict(frozenset({0}))


def test_leader_sync_misuse():
    t = InMemoryRing(2).transport(0)
    with pytest.raises(ValueError):
        LeaderSync(t).sync("x", None)
    with pytest.raises(ValueError):
        LeaderSync(InMemoryRing(2).transport(1)).sync("x", [1])

    def body(rank, t):
        return LeaderSync(t).sync("a" if rank == 0 else "b", [1] if rank == 0 else None)

    with pytest.raises(ConsensusError, match="out of step"):
        run_ranks(2, body)

    def not_polls(rank, t):
        sync = LeaderSync(t)
        return sync.sync("bootstrap", [2, 9]) if rank == 0 else sync.sync_polls(None)

    with pytest.raises(ConsensusError, match="non-KVPoll"):
        run_ranks(2, not_polls)
