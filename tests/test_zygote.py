"""The rank zygote (infra/zygote.py): the test session's one (conftest.py rank_zygote) forks real
rank processes for this test process. What a child takes from its requester, how its exit comes
back, and what the zygote refuses while it keeps serving."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import socket
import time
from pathlib import Path

from pdserve.infra.zygote_client import EXIT_UNKNOWN, Zygote
from pdserve.runtime.rank_spec import RankSpec


def _idle_rank(model, tmp_path) -> str:
    """A rank spec whose front links nobody serves: the rank loads, then waits for requests."""
    spec = RankSpec(
        model=str(model),
        engine={},
        pp_size=1,
        pp_rank=0,
        dist_init="",
        req_addr=f"ipc://{tmp_path}/req",
        evt_addr=f"ipc://{tmp_path}/evt",
    )
    return spec.to_json()


def test_a_child_reports_its_exit_code_and_writes_to_the_requesters_stderr(rank_zygote, capfd):
    child = rank_zygote.fork("pdserve.runtime.rank.process", ["--spec", "{not json"])
    assert child.wait(timeout=60) == 2  # argparse's error exit, from the child's own main
    assert child.pid > 0 and child.poll() == 2
    assert "--spec" in capfd.readouterr().err


def test_a_rank_takes_the_requesters_cwd_and_stops_on_sigterm(
    rank_zygote, tiny6, tmp_path, monkeypatch, capfd
):
    monkeypatch.chdir(tmp_path)
    child = rank_zygote.fork(
        "pdserve.runtime.rank.process", ["--spec", _idle_rank(tiny6, tmp_path)]
    )
    try:
        pid = child.pid
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}/comm").read_text().strip() != "colocated-pp0":  # in its main
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        assert os.readlink(f"/proc/{pid}/cwd") == str(tmp_path)
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == rank_zygote.proc.pid  # its parent
        assert child.poll() is None
        child.terminate()
        assert child.wait(timeout=60) == 0  # the rank's SIGTERM handler: a clean exit
        # and it says who stopped it: this process signalled it (through its pidfd)
        assert f"pp_rank 0 stops: SIGTERM from pid {os.getpid()}" in capfd.readouterr().err
    finally:
        if child.poll() is None:
            child.kill()
            child.wait(timeout=10)


def test_sigkill_is_reported_as_on_popen(rank_zygote, tiny6, tmp_path):
    child = rank_zygote.fork(
        "pdserve.runtime.rank.process", ["--spec", _idle_rank(tiny6, tmp_path)]
    )
    child.kill()
    assert child.wait(timeout=60) == -signal.SIGKILL


def test_a_rank_outlives_the_zygote_that_forked_it(tiny6, tmp_path):
    """A zygote that dies (SIGKILL) leaves its running children alone: the child goes on, the
    requester still signals it through its pidfd and sees it end (its code unknown: only its
    parent, gone, could read it)."""
    zygote = Zygote.start(["pdserve.runtime.rank.process"])
    child = None
    try:
        child = zygote.fork("pdserve.runtime.rank.process", ["--spec", _idle_rank(tiny6, tmp_path)])
        pid = child.pid
        deadline = time.monotonic() + 60
        while Path(f"/proc/{pid}/comm").read_text().strip() != "colocated-pp0":  # in its main
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.05)
        zygote.proc.kill()
        zygote.proc.wait(timeout=10)
        time.sleep(1.0)  # a parent-death signal would have killed it by now
        assert child.poll() is None and child.orphaned
        assert "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        child.terminate()
        assert child.wait(timeout=60) == EXIT_UNKNOWN
        stat = Path(f"/proc/{pid}/stat")
        with contextlib.suppress(FileNotFoundError):  # gone, or a zombie until init reaps it
            assert stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        zygote.close()


def test_a_module_it_did_not_preload_is_refused(rank_zygote, caplog):
    with caplog.at_level(logging.ERROR, logger="pdserve.infra.zygote"):
        child = rank_zygote.fork("json.tool", [])
        assert child.wait(timeout=30) == 1
    assert "not preloaded" in caplog.text


def _raw(zygote: Zygote, payload: bytes, with_fds: bool = True) -> dict:
    me = os.pidfd_open(os.getpid())
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
            s.settimeout(60)
            s.connect(zygote.path)
            socket.send_fds(s, [payload], [1, 2, me] if with_fds else [])
            return json.loads(s.recv(4096))
    finally:
        os.close(me)


GOOD = {"module": "pdserve.runtime.rank.process", "argv": ["--spec", "{"], "env": {}, "cwd": "/"}


def test_malformed_requests_get_an_error_and_the_zygote_keeps_serving(rank_zygote):
    bad = [
        b"{",  # not JSON
        b"[]",  # not an object
        json.dumps({**GOOD, "module": []}).encode(),  # unhashable
        json.dumps({**GOOD, "module": "os"}).encode(),  # not preloaded
        json.dumps({**GOOD, "argv": "--spec"}).encode(),
        json.dumps({**GOOD, "env": {"A": 1}}).encode(),
    ]
    for payload in bad:
        assert "error" in _raw(rank_zygote, payload), payload
    assert "error" in _raw(rank_zygote, json.dumps(GOOD).encode(), with_fds=False)
    child = rank_zygote.fork("pdserve.runtime.rank.process", ["--spec", "{"])
    assert child.wait(timeout=60) == 2
