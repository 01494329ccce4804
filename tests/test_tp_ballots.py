"""A TP group's ballot (pd_common/loop_base.py PDLoop.stage_ballots): the stage votes as if each
of its ranks were a voter of the ring (consensus/vote.py merge), in one collective over the group;
and the quarantine's flags hold only where they hold on every rank. The group here is threads
whose MIN/MAX are computed together, as gloo's all-reduce would."""

from __future__ import annotations

import random
import threading
from types import SimpleNamespace

from pdserve.consensus.kvpoll import KVPoll
from pdserve.consensus.vote import PREALLOC, TRANSFERRED, Ballot, merge
from pdserve.pd_common.loop_base import PDLoop


class ThreadGroup:
    """`size` threads' min_max, elementwise over what each contributed."""

    def __init__(self, size: int):
        self.size, self.parts = size, {}
        self.calls = 0
        self.barrier = threading.Barrier(size, timeout=10)

    def member(self, rank: int):
        group = self

        class Member:
            def min_max(self, values):
                group.parts[rank] = values
                if rank == 0:
                    group.calls += 1
                group.barrier.wait()
                cols = list(zip(*(group.parts[r] for r in range(group.size)), strict=True))
                out = [min(c) for c in cols], [max(c) for c in cols]
                group.barrier.wait()
                return out

        return Member()


def group_ballots(observed_per_rank, quiet_per_rank):
    """Each rank's stage_ballots, run in threads as one TP group."""
    group = ThreadGroup(len(observed_per_rank))
    out: list = [None] * len(observed_per_rank)

    def run(rank):
        loop = SimpleNamespace(tp=group.member(rank))
        out[rank] = PDLoop.stage_ballots(loop, observed_per_rank[rank], quiet_per_rank[rank])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(out))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return out, group.calls


def ring(ballots: list[Ballot]) -> tuple[frozenset, frozenset]:
    """The ring's tally over `ballots`, one voter each."""
    tally = ballots[0].resolved()
    for b in ballots[1:]:
        tally = merge(tally, *b.resolved())
    return tally


def test_a_tp_group_votes_as_its_ranks_would_in_the_ring():
    rng = random.Random(3)
    polls = list(KVPoll)
    for case in range(300):
        size = rng.choice([2, 3])
        rooms = rng.sample(range(50), rng.randint(0, 6))
        aborted = [r for r in rooms if rng.random() < 0.2]  # replicated: the same on every rank
        per_rank = [
            {
                kind: (
                    {r: rng.choice(polls[1:] if kind == PREALLOC else polls) for r in rooms},
                    aborted,
                )
                for kind in (PREALLOC, TRANSFERRED)
            }
            for _ in range(size)
        ]
        quarantine = rng.sample(range(50, 60), rng.randint(0, 3))
        quiet = [{r: rng.random() < 0.6 for r in quarantine} for _ in range(size)]
        got, calls = group_ballots(per_rank, quiet)
        assert calls == (1 if rooms or quarantine else 0), case  # one collective a turn, or none
        for kind in (PREALLOC, TRANSFERRED):
            voters = [Ballot.from_statuses(kind, *rank[kind]) for rank in per_rank]
            want = ring(voters)
            for ballots, _ in got:  # every rank of the group casts the same ballot
                assert ballots[kind].resolved() == want, (case, kind)
        held = frozenset(r for r in quarantine if all(q[r] for q in quiet))
        assert all(flags == held for _, flags in got), case


def test_without_tp_the_ballot_is_the_ranks_own():
    loop = SimpleNamespace(tp=None)
    statuses = {1: KVPoll.Success, 2: KVPoll.Failed, 3: KVPoll.Transferring}
    ballots, quiet = PDLoop.stage_ballots(loop, {TRANSFERRED: (statuses, [1])}, {9: True, 8: False})
    assert ballots[TRANSFERRED] == Ballot.from_statuses(TRANSFERRED, statuses, [1])
    assert quiet == {9}
