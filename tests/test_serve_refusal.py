"""A node refuses to listen beyond loopback without the cluster secret (runtime/serve.py
`refuse_unprotected`): also on the hosts that run only ranks (--node-rank > 0), and when only the
KV control sockets (the advertised host) would be reachable from the network."""

from __future__ import annotations

import argparse

import pytest

from pdserve.decode_node.serve import add_decode_args
from pdserve.pd_common.node_config import PDNodeConfig
from pdserve.runtime.node_config import NodeConfig, node_config
from pdserve.runtime.serve import refuse_unprotected


def args(host: str, insecure: bool = False) -> NodeConfig:
    """The config `pdserve decode --host HOST [--insecure]` starts with, PDSERVE_ADVERTISE_HOST
    read from the environment as the command line's edge reads it."""
    argv = ["--host", host] + (["--insecure"] if insecure else [])
    return node_config(PDNodeConfig, add_decode_args(argparse.ArgumentParser()).parse_args(argv))


@pytest.fixture(autouse=True)
def no_secret(monkeypatch):
    for k in ("PDSERVE_INTERNAL_TOKEN", "PDSERVE_INTERNAL_TOKEN_FILE", "PDSERVE_ADVERTISE_HOST"):
        monkeypatch.delenv(k, raising=False)


def test_advertised_host_beyond_loopback_needs_the_secret(monkeypatch):
    monkeypatch.setenv("PDSERVE_ADVERTISE_HOST", "10.1.2.3")  # KV control binds there
    for role in ("prefill", "decode"):
        with pytest.raises(SystemExit, match="without a cluster secret"):
            refuse_unprotected(args("127.0.0.1"), role, ranks_listen=True)
        assert refuse_unprotected(args("127.0.0.1", insecure=True), role, ranks_listen=True) is None
    assert refuse_unprotected(args("127.0.0.1"), "colocated", ranks_listen=False) is None
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "s")
    assert refuse_unprotected(args("127.0.0.1"), "decode", ranks_listen=True) == "s"


def test_network_host_needs_the_secret():
    with pytest.raises(SystemExit, match="without a cluster secret"):
        refuse_unprotected(args("0.0.0.0"), "colocated", ranks_listen=False)
    assert refuse_unprotected(args("127.0.0.1"), "decode", ranks_listen=True) is None
