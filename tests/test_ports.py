"""Port picking for servers the launchers start: a port held with reserve_port is skipped by
free_port in any process, yet the server it was picked for can still bind it. A port the user
names (`pdserve up --port`) is held from the start with hold_port: taken by another server, it is
an error at once; held, the router still binds it."""

from __future__ import annotations

import datetime
import random
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

from pdserve.infra.procs import free_port, hold_port, reserve_port


@pytest.fixture
def picks_first(monkeypatch):
    """free_port's random pick returns `port` first (then anything): the collision that happened
    once in the suite, when two node starts picked the same port, made certain."""

    def arrange(port: int) -> None:
        real = random.SystemRandom.randrange
        first = [port]
        monkeypatch.setattr(
            random.SystemRandom,
            "randrange",
            lambda self, a, b: first.pop() if first else real(self, a, b),
        )

    return arrange


def test_free_port_skips_a_reserved_port(picks_first):
    hold = reserve_port()
    port = hold.getsockname()[1]
    try:
        picks_first(port)
        assert free_port() != port
    finally:
        hold.close()
    # control: released, the same first pick is handed out (what happened before the hold)
    picks_first(port)
    assert free_port() == port


def test_two_reservations_never_share_a_port(picks_first):
    """Two nodes starting at the same moment, both drawing the same port: the second reservation
    skips it (a hold bound with SO_REUSEADDR already set would have shared it)."""
    first = reserve_port()
    port = first.getsockname()[1]
    try:
        picks_first(port)
        second = reserve_port()
        assert second.getsockname()[1] != port
        second.close()
    finally:
        first.close()


def test_the_pp_rendezvous_binds_through_the_hold():
    """pp_rank 0's TCPStore (the PP group's rendezvous) takes the port the node's front holds."""
    hold = reserve_port()
    port = hold.getsockname()[1]
    try:
        timeout = datetime.timedelta(seconds=30)
        server = dist.TCPStore("127.0.0.1", port, 2, True, timeout, wait_for_workers=False)
        client = dist.TCPStore("127.0.0.1", port, 2, False, timeout)
        client.set("who", "pp_rank 1")
        assert server.get("who") == b"pp_rank 1"
        with socket.socket() as probe, pytest.raises(OSError):
            probe.bind(("127.0.0.1", port))  # still taken for everyone else
        del client, server
    finally:
        hold.close()


def test_a_held_port_is_refused_to_others_but_not_to_its_server(picks_first):
    hold = hold_port("127.0.0.1", free_port())
    port = hold.getsockname()[1]
    try:
        picks_first(port)
        assert free_port() != port
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))
        with socket.socket() as server:  # as uvicorn binds: SO_REUSEADDR, then listen
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind(("127.0.0.1", port))
            server.listen()
            with pytest.raises(OSError):  # a second hold fails while a server listens there
                hold_port("127.0.0.1", port)
    finally:
        hold.close()


def test_up_refuses_a_port_in_use_before_it_starts_anything():
    """Another server listens on --port: `pdserve up` says so within seconds and exits 1, where it
    used to start every node and fail at the router's bind minutes later."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = subprocess.run(
            [sys.executable, "-m", "pdserve.cli", "up", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"--port {port} on 127.0.0.1" in r.stdout + r.stderr
    assert "in use" in (r.stdout + r.stderr).lower()
