"""Hosts for multi-host tests: Linux network namespaces on one bridge (root only).

Each host is a network namespace with its own loopback and one interface, `eth0`, whose veth peer
sits on a bridge in this (the test's) namespace. Addresses come from the RFC 2544 benchmarking
range only (198.18.0.0/15): the hosts get 198.18.<net>.<i>/24, the test's namespace 198.18.<net>.254
on the bridge, so the test can reach every host as one more host would. No host has a route beyond
that /24, and nothing is forwarded: no packet leaves the bridge.

Everything is torn down on exit, after a failure too: every process in each namespace is killed,
then the namespaces, the veth pairs and the bridge are deleted. A stale set from a killed run
(same names) is removed before a new one is made.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

NET_PREFIX = "198.18"


def can_make_hosts() -> str:
    """ "" when this process can make network namespaces, else why not (the skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"pdprobe{os.getpid() % 100000}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot make a network namespace here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r


@dataclass
class Host:
    name: str  # the namespace
    addr: str  # its address on the bridge
    veth: str  # the bridge side of its interface
    procs: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        """A process in this host (its own process group), output to `log`."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                ["ip", "netns", "exec", self.name, *argv],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )
        self.procs.append(p)
        return p

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(
            ["ip", "netns", "exec", self.name, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def pids(self) -> list[int]:
        r = _ip("netns", "pids", self.name, check=False)
        return [int(p) for p in r.stdout.split()]

    def netem(self, spec: str) -> None:
        """Link conditions on this host's side of the link (`tc qdisc ... netem SPEC`), e.g.
        "delay 1ms rate 1gbit"; "" removes them."""
        _ip("link", "show", "eth0", ns=self.name)
        subprocess.run(
            ["ip", "netns", "exec", self.name, "tc", "qdisc", "del", "dev", "eth0", "root"],
            capture_output=True,
        )
        if spec:
            r = self.run("tc", "qdisc", "add", "dev", "eth0", "root", "netem", *spec.split())
            if r.returncode != 0:
                raise RuntimeError(f"tc netem {spec}: {r.stderr.strip()}")

    def cut_link_to(self, peer: str) -> None:
        """Silently drops every packet this host sends to `peer`: an htb class whose queue holds
        nothing (pfifo limit 0), chosen by a u32 filter on that address; every other host stays
        reachable. (This kernel has no netem, prio or drop action; htb, pfifo and u32 it has.)"""
        dev, fast = ["dev", "eth0"], ["htb", "rate", "100gbit"]
        for argv in (
            ["tc", "qdisc", "add", *dev, "root", "handle", "1:", "htb", "default", "1"],
            ["tc", "class", "add", *dev, "parent", "1:", "classid", "1:1", *fast],
            ["tc", "class", "add", *dev, "parent", "1:", "classid", "1:2", *fast],
            ["tc", "qdisc", "add", *dev, "parent", "1:2", "handle", "20:", "pfifo", "limit", "0"],
            ["tc", "filter", "add", *dev, "parent", "1:", "protocol", "ip", "prio", "1", "u32"]
            + ["match", "ip", "dst", f"{peer}/32", "flowid", "1:2"],
        ):
            r = self.run(*argv)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(argv)}: {r.stderr.strip()}")

    def heal(self) -> None:
        """Removes every link condition of this host."""
        self.run("tc", "qdisc", "del", "dev", "eth0", "root")


def _exit_on_sigterm(signum, frame):
    raise SystemExit(128 + signum)


class Hosts:
    """`count` hosts on one bridge; a context manager that always tears them down."""

    def __init__(self, count: int, tag: str | None = None, net: int = 0):
        self.tag = tag or f"{os.getpid() % 100000:05d}"
        self.bridge = f"pdbr{self.tag}"
        self.net = f"{NET_PREFIX}.{net}"
        self.test_addr = f"{self.net}.254"  # this namespace, on the bridge
        self.hosts = [
            Host(f"pdh{self.tag}-{i}", f"{self.net}.{i}", f"pdv{self.tag}{i}")
            for i in range(1, count + 1)
        ]

    def __enter__(self) -> Hosts:
        self._teardown()  # a stale set of the same names
        if threading.current_thread() is threading.main_thread():
            # SIGTERM ends a process without unwinding: raise instead, so __exit__ tears down
            signal.signal(signal.SIGTERM, _exit_on_sigterm)
        try:
            self._make()
        except BaseException:
            self._teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._teardown()

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def _make(self) -> None:
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.test_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        for h in self.hosts:
            _ip("netns", "add", h.name)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", "eth0", "netns", h.name)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            _ip("addr", "add", f"{h.addr}/24", "dev", "eth0", ns=h.name)
            _ip("link", "set", "eth0", "up", ns=h.name)
            _ip("link", "set", "lo", "up", ns=h.name)

    def _teardown(self) -> None:
        for h in self.hosts:
            for p in h.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGTERM)
            deadline = time.monotonic() + 15
            for p in h.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=max(0.1, deadline - time.monotonic()))
            for pid in h.pids():  # whatever is still in the namespace (grandchildren too)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            for p in h.procs:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            _ip("netns", "del", h.name, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", self.bridge, check=False)

    def leftovers(self) -> list[str]:
        """Names of this set that still exist (a check that teardown was whole)."""
        netns = _ip("netns", "list", check=False).stdout
        links = _ip("-o", "link", "show", check=False).stdout
        names = [h.name for h in self.hosts] + [h.veth for h in self.hosts] + [self.bridge]
        return [n for n in names if n in netns or f" {n}:" in links or f" {n}@" in links]
