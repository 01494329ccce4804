"""An elastic node's ranks change cores with their role: `pdserve up --elastic` plans each node's
cores in both roles (up_cores.py), and a flipping rank moves its threads there
(infra/affinity.py move_threads, elastic_node/loop.py)."""

from __future__ import annotations

import os
import threading

import pytest

import pdserve.up_cores as up_cores
from pdserve.infra.affinity import move_threads
from pdserve.up_args import UpConfig


def test_up_plans_an_elastic_prefill_node_off_the_decode_core(monkeypatch):
    """2 prefill + 1 decode node on 2 cores: decode-0 alone on core 0 is the plan's first rank,
    prefill-0 on core 1, and prefill-1 shares core 0 (prefill gets both cores while it has the
    load). As a decode node prefill-1 must leave core 0, where decode-0 runs."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(up_cores, "bind_cores", lambda cores: None)
    cpus = up_cores.plan_cluster_cores(
        UpConfig(elastic=True, prefill_nodes=2), n_models=1, say=lambda msg: None
    )

    def flags(role: str) -> dict[str, str]:
        out = cpus(role, 1)
        return {k: v for k, v in zip(out[::2], out[1::2], strict=True)}

    pre0, pre1, dec0 = flags("prefill"), flags("prefill"), flags("decode")
    assert (pre0["--cpus"], pre1["--cpus"], dec0["--cpus"]) == ("1", "0", "0")
    assert pre1["--prefill-cpus"] == "0" and pre1["--decode-cpus"] == "1"
    assert dec0["--decode-cpus"] == "0"
    static = up_cores.plan_cluster_cores(UpConfig(prefill_nodes=2), 1, say=lambda msg: None)
    assert "--decode-cpus" not in static("prefill", 1)  # only elastic nodes move


def _plan(monkeypatch, cores: set[int], **cfg):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: cores)
    monkeypatch.setattr(up_cores, "bind_cores", lambda cores: None)
    cpus = up_cores.plan_cluster_cores(UpConfig(elastic=True, **cfg), 1, say=lambda msg: None)

    def flags(role: str, pp: int = 1) -> dict[str, str]:
        out = cpus(role, pp)
        return {k: v for k, v in zip(out[::2], out[1::2], strict=True)}

    return flags


def test_up_keeps_an_elastic_decode_node_turned_prefill_on_its_own_core(monkeypatch):
    """1 prefill + 2 decode nodes on 2 cores: decode-0 on core 0, decode-1 on core 1, prefill-0
    on core 0. As a prefill node decode-1 stays on core 1, where no prefill rank runs: the move
    must not leave a core idle (the earlier plan sent it to core 0, beside both other ranks)."""
    flags = _plan(monkeypatch, {0, 1}, prefill_nodes=1, decode_nodes=2)
    dec0, dec1, pre0 = flags("decode"), flags("decode"), flags("prefill")
    assert (dec0["--cpus"], dec1["--cpus"], pre0["--cpus"]) == ("0", "1", "0")
    assert dec1["--prefill-cpus"] == "1"
    assert dec0["--prefill-cpus"] == "1"  # core 0 has prefill-0
    assert pre0["--decode-cpus"] == "0"  # one decode rank on each core: the plan's first


def test_up_leaves_elastic_nodes_on_their_own_cores_where_cores_suffice(monkeypatch):
    """8 cores for 3 ranks at PP 1 and one at PP 2: every rank has cores of its own, and a flip
    keeps them (the earlier plan put a flipped rank onto another rank's cores)."""
    flags = _plan(monkeypatch, set(range(8)), prefill_nodes=2, decode_nodes=1, decode_pp=2)
    pre0, pre1, dec0 = flags("prefill"), flags("prefill"), flags("decode", 2)
    for f, role in ((pre0, "decode"), (pre1, "decode"), (dec0, "prefill")):
        assert f[f"--{role}-cpus"] == f["--cpus"], f


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move between")
def test_move_threads_moves_only_the_threads_on_the_old_cores():
    a, b = sorted(os.sched_getaffinity(0))[:2]
    bound, release, seen = threading.Event(), threading.Event(), {}

    def worker() -> None:
        os.sched_setaffinity(0, {a})
        bound.set()
        release.wait(10)
        seen["cores"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    try:
        assert bound.wait(10)
        before = os.sched_getaffinity(0)
        assert move_threads({a}, {b}) >= 1
        if not before <= {a}:  # this thread may run beyond core a: it stays where it was
            assert os.sched_getaffinity(0) == before
        os.sched_setaffinity(0, before)
    finally:
        release.set()
        t.join(10)
    assert seen["cores"] == {b}
