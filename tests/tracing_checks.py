"""What the tracing tests share: the client's trace context, the prompt, and how a cluster's
exporter socket is found (tests/test_tracing.py with tracing on; tests/test_conditional_disagg.py,
whose cluster runs with tracing off, checks that there is none)."""

from __future__ import annotations

import subprocess

import psutil

TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
PROMPT = " ".join(f"word{i}" for i in range(40))  # several prefill chunks of 16 tokens


def cluster_procs(up_proc: subprocess.Popen) -> list[psutil.Process]:
    return [psutil.Process(up_proc.pid), *psutil.Process(up_proc.pid).children(recursive=True)]


def outside_connections(procs: list[psutil.Process]) -> list[tuple[str, tuple]]:
    """Established TCP connections of the cluster's processes with neither end on a port that one
    of them listens on: what an exporter's socket to a collector would be."""
    conns = {p.pid: p.net_connections(kind="tcp") for p in procs}
    listening = {c.laddr.port for cs in conns.values() for c in cs if c.status == "LISTEN"}
    return [
        (psutil.Process(pid).cmdline()[-1][:60], c.raddr)
        for pid, cs in conns.items()
        for c in cs
        if c.status == "ESTABLISHED"
        and c.laddr.port not in listening
        and c.raddr
        and c.raddr.port not in listening
    ]
