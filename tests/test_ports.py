"""Port picking for servers the launchers start: a port held with reserve_port is skipped by
free_port in any process, yet the server it was picked for can still bind it."""

from __future__ import annotations

import datetime
import random
import socket

import pytest
import torch.distributed as dist

from pdserve.infra.procs import free_port, reserve_port


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
