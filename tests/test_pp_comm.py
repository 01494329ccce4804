"""The real PP group (runtime/rank/pp_comm.PPComm, gloo over loopback) at start-up: a rank whose
peer is still loading its slice waits for it on the rendezvous store, longer than one receive's
timeout, before any PP message."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from pdserve.infra.procs import free_port

# One rank: join the group with a receive timeout of 2 s, "load" for `load_s`, wait for the peers
# (unless told not to) for at most `wait_s`, then rank 1 sends rank 0 one message.
RANK = textwrap.dedent(
    """
    import json, sys, time
    from pdserve.runtime.rank.pp_comm import Msg, PPComm
    rank, port, load_s, barrier, wait_s = json.loads(sys.argv[1])
    comm = PPComm(rank, 2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=2.0)
    time.sleep(load_s)
    try:
        if barrier:
            comm.wait_for_peers("loaded", wait_s)
        if rank == 1:
            comm.send_obj(0, "hello", Msg.META)
            comm.flush()
        else:
            print("got", comm.recv(1, Msg.META), flush=True)
    except Exception as e:
        print("error", type(e).__name__, e, flush=True)
        sys.exit(1)
    finally:
        comm.close()
    """
)


def run_pair(load_s: list[float], barrier: bool, wait_s: float = 30.0) -> list[tuple[int, str]]:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK, json.dumps([r, port, load_s[r], barrier, wait_s])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    out = []
    try:
        for p in procs:
            text, _ = p.communicate(timeout=60)
            out.append((p.returncode, text))
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=10)
    return out


@pytest.mark.parametrize("barrier", [True, False], ids=["waits-for-peers", "no-wait"])
def test_a_slow_loading_peer_is_waited_for_not_timed_out(barrier):
    """Rank 1 loads for 5 s, past rank 0's 2 s receive timeout. With the start-up wait rank 0 gets
    its message; without it (what ranks did before), rank 0's first receive times out."""
    (rc0, out0), _ = run_pair([0.0, 5.0], barrier)
    if barrier:
        assert rc0 == 0 and "got hello" in out0, out0
    else:
        assert rc0 == 1 and "error" in out0, out0


def test_the_start_up_wait_is_bounded_and_names_the_missing_rank():
    (rc0, out0), (rc1, out1) = run_pair([0.0, 8.0], True, wait_s=3.0)
    assert rc0 == 1 and "TimeoutError" in out0 and "ranks [1]" in out0, out0
