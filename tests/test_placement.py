"""The core plan: which cores each rank's compute threads own, and where the I/O processes go."""

from __future__ import annotations

import os

import pytest

from pdserve.runtime.placement import Placement, parse_cpus, plan_placement


@pytest.mark.parametrize("cores", range(1, 9))
@pytest.mark.parametrize("ranks", range(1, 5))
def test_plan_for_1_to_4_ranks_on_1_to_8_cores(ranks, cores):
    plan = plan_placement(ranks, list(range(cores)))
    assert len(plan.rank_cores) == ranks and all(plan.rank_cores)
    used = [c for rc in plan.rank_cores for c in rc]
    assert set(used) | set(plan.io_cores) <= set(range(cores))
    assert not set(used) & set(plan.io_cores), "the I/O core runs no compute thread"
    if ranks < cores:
        # no compute core is shared, one is kept for I/O, every other core computes
        assert not plan.shared and len(plan.io_cores) == 1 and len(used) == cores - 1
        sizes = [len(rc) for rc in plan.rank_cores]
        assert max(sizes) - min(sizes) <= 1
    else:
        # ranks >= cores: one core per rank, round-robin, nothing left for I/O
        assert plan.io_cores == () and all(len(rc) == 1 for rc in plan.rank_cores)
        assert len(set(used)) == cores and plan.shared == (ranks > cores)


def test_explicit_threads_per_rank():
    assert plan_placement(1, [0, 1], threads=2) == Placement(((0, 1),), ())
    assert plan_placement(2, range(8), threads=2) == Placement(((0, 1), (2, 3)), (4, 5, 6, 7))
    assert plan_placement(3, [0, 1], threads=1).rank_cores == ((0,), (1,), (0,))
    # a process limited to some cores plans over those only
    assert plan_placement(2, [4, 6, 7]) == Placement(((4,), (6,)), (7,))


def test_describe_and_flag():
    plan = plan_placement(3, range(4))
    assert plan.flag(0, 1) == "0" and plan.flag(1, 2) == "1;2"
    text = plan.describe(["prefill pp0", "decode pp0", "decode pp1"])
    assert "prefill pp0 -> core 0" in text and "fronts/router -> core 3" in text
    assert "shared" in plan_placement(4, [0, 1]).describe(["a", "b", "c", "d"])


def test_fronts_share_the_last_rank_core_when_none_is_left():
    """With no core left over, the fronts and the router go on the last rank's cores (where
    `pdserve up` puts a prefill rank), not wherever the scheduler drops them; with an I/O core,
    there."""
    two = plan_placement(2, [0, 1])
    assert two.io_cores == () and two.front_cores(last_rank_shares=True) == (1,)
    assert two.front_cores(last_rank_shares=False) == ()
    text = two.describe(["decode-0 pp0", "prefill-0 pp0"], two.front_cores(True))
    assert "fronts/router -> core 1 (none left over: shared with prefill-0 pp0)" in text
    three = plan_placement(2, [0, 1, 2])
    assert three.front_cores(last_rank_shares=True) == three.io_cores == (2,)


def test_parse_cpus_names_the_problem():
    mine = sorted(os.sched_getaffinity(0))
    assert parse_cpus(f"{mine[0]}", 1) == ((mine[0],),)
    with pytest.raises(ValueError, match="2 core group"):
        parse_cpus(f"{mine[0]};{mine[-1]}", 1)
    with pytest.raises(ValueError, match="not available"):
        parse_cpus("4095", 1)
    with pytest.raises(ValueError, match="expected core numbers"):
        parse_cpus("a,b", 1)
    with pytest.raises(ValueError):
        plan_placement(0, [0])
