"""The router follows its same-host workers' fronts onto their cores (router/cpu_affinity.py): a
router started by hand next to a colocated node leaves the rank's compute core to the rank."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from cluster import NODE_ARGS, free_port, start

from pdserve.router.cpu_affinity import FrontCores, is_loopback, parse_front_cpus

ROOT = Path(__file__).resolve().parents[1]
CORES = sorted(os.sched_getaffinity(0))
two_cores = pytest.mark.skipif(len(CORES) < 2, reason="needs two cores to move between")


def thread_cores(pid: int) -> set[frozenset[int]]:
    """The distinct core sets of `pid`'s threads (a thread that ends meanwhile is skipped)."""
    got = set()
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            got.add(frozenset(os.sched_getaffinity(int(t))))
        except ProcessLookupError:
            pass
    return got


def wait_thread_cores(pid: int, want: frozenset[int], timeout: float = 20) -> set[frozenset[int]]:
    """`thread_cores(pid)` once every thread is on `want`, or at the timeout."""
    deadline = time.monotonic() + timeout
    while (got := thread_cores(pid)) != {want} and time.monotonic() < deadline:
        time.sleep(0.2)
    return got


def test_front_cpus_are_read_only_from_loopback_workers_and_bounded():
    assert is_loopback("http://127.0.0.1:8201") and is_loopback("http://localhost:1")
    assert is_loopback("http://[::1]:30000")
    assert not is_loopback("http://10.0.0.5:8201") and not is_loopback("http://node-a:8201")
    assert parse_front_cpus([1, 0]) == {0, 1}
    for bad in ([], [1.0], [-1], [True], [4096], "1", None, list(range(4097)), {"0": 1}):
        assert parse_front_cpus(bad) is None, bad
    # a remote worker's fronts, and bad lists, never move it
    fc = FrontCores(allowed=CORES)
    assert fc.learn("http://10.0.0.5:1", CORES[:1]) is None and fc.fronts == frozenset()
    assert fc.learn("http://127.0.0.1:1", "0") is None
    # cores it may not take (gone from its cpuset since it started): it stays and says so
    before = os.sched_getaffinity(0)
    gone = FrontCores(allowed=[*CORES, 4000])
    assert gone.learn("http://127.0.0.1:1", [4000]) is None and gone.bound is None
    assert os.sched_getaffinity(0) == before


MOVES = """
import json, os, threading
from pdserve.router.cpu_affinity import FrontCores
stop = threading.Event()
t = threading.Thread(target=stop.wait, daemon=True)  # started before the move: moves too
t.start()
fc = FrontCores()
a, b = sorted(os.sched_getaffinity(0))[:2]
out = [fc.learn("http://127.0.0.1:1", [b])]          # narrowed to the front's core
out.append(fc.learn("http://127.0.0.1:2", [b]))      # nothing new: no move
out.append(fc.learn("http://127.0.0.1:3", [a]))      # another front: the union
late = []
t2 = threading.Thread(target=lambda: late.append(os.sched_getaffinity(0)))  # inherits
t2.start(); t2.join()
tasks = {}
for x in os.listdir("/proc/self/task"):
    try:
        tasks[int(x)] = os.sched_getaffinity(int(x))
    except ProcessLookupError:  # t2, ended
        pass
assert t.native_id in tasks
stop.set(); t.join()
gone = [fc.forget("http://127.0.0.1:3")]             # its front left: back to {b}
gone.append(fc.forget("http://127.0.0.1:1"))         # the front of :2 is still on b: no move
gone.append(fc.forget("http://127.0.0.1:9"))         # never known: nothing
gone.append(fc.forget("http://127.0.0.1:2"))         # none left: the cores it started with
print(json.dumps([[sorted(o) if o else None for o in out],
                  sorted(sorted(s) for s in set(map(frozenset, tasks.values()))), sorted(late[0]),
                  [sorted(o) if o else None for o in gone], sorted(os.sched_getaffinity(0)),
                  sorted(fc.allowed), fc.bound]))
"""


@two_cores
def test_every_thread_moves_and_only_ever_within_its_cores():
    out = subprocess.run(
        [sys.executable, "-c", MOVES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert out.returncode == 0, out.stderr
    a, b = CORES[:2]
    moves, task_sets, late, gone, final, allowed, bound = json.loads(out.stdout)
    # moved to {b}; the second report changed nothing; the third widened to {a, b} (on a 2-core
    # host all it was given: back where it started), every thread with it, and later ones too
    assert moves == [[b], None, [a, b]]
    assert task_sets == [[a, b]] and late == [a, b]
    # workers removed: it follows the fronts left, then goes back to the cores it started with
    assert gone == [[b], None, None, allowed] and final == allowed and bound is None


@two_cores
def test_a_router_beside_a_colocated_node_runs_on_its_front_cores(tiny6, tmp_path):
    """`pdserve serve --pp 1` next to `pdserve router --worker`: the node's plan puts its rank on
    one core and its front on the I/O core; the router's threads end up on the front's cores."""
    nport, rport = free_port(), free_port()
    node = ["serve", "--model", str(tiny6), "--pp", "1", "--port", str(nport), *NODE_ARGS]
    with start(node, nport, tmp_path / "node.log") as (nurl, _):
        info = httpx.get(f"{nurl}/server_info", timeout=10).json()
        front = set(info["front_cpus"])
        assert front == os.sched_getaffinity(info["pid"]) and front < set(CORES)
        router = ["router", "--port", str(rport), "--worker", nurl, "--health-interval", "1"]
        with start(router, rport, tmp_path / "router.log") as (rurl, rp):
            got = wait_thread_cores(rp.pid, frozenset(front))
            assert got == {frozenset(front)}, (got, front)
            assert "router on cores" in (tmp_path / "router.log").read_text()
            r = httpx.post(
                f"{rurl}/v1/completions",
                json={"model": info["model"], "prompt": "hi", "max_tokens": 2},
                timeout=60,
            )
            assert r.status_code == 200, r.text
            # the worker removed: its front no longer holds the router, which goes back to the
            # cores it started with
            r = httpx.delete(f"{rurl}/workers", params={"url": nurl}, timeout=10)
            assert r.status_code == 200, r.text
            got = wait_thread_cores(rp.pid, frozenset(CORES))
            assert got == {frozenset(CORES)}, (got, CORES)
