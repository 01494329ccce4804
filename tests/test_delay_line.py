"""bench/delay_line.py, the stand-in for netem's delay that bench/bench_links.py uses where the
kernel has no sch_netem: two hosts of network namespaces, each delaying what it receives from
the other through iptables NFQUEUE. The round trip must grow by at least the two one-way delays
(a lower bound: no timing is asserted beyond what the delay itself guarantees), a bulk stream must
get through whole, and once the delay line stops the link works undelayed (--queue-bypass)."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
from netns_hosts import Hosts, can_make_hosts

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from bench_links import ECHO_PORT, ECHO_SERVER, measured_rtt_ms  # noqa: E402

WHY_NOT = can_make_hosts() or ("" if shutil.which("iptables") else "no iptables")
pytestmark = [
    pytest.mark.hosts,
    pytest.mark.skipif(bool(WHY_NOT), reason=WHY_NOT or "hosts can be made"),
]
ONE_WAY_MS = 10.0
BULK = (
    "import socket, time\n"
    "for _ in range(100):\n"  # until the sink listens
    "    try: s = socket.create_connection(('{addr}', {port}), timeout=30); break\n"
    "    except ConnectionRefusedError: time.sleep(0.1)\n"
    "s.sendall(bytes(range(256)) * 40000); s.shutdown(socket.SHUT_WR)\n"
    "print(len(b''.join(iter(lambda: s.recv(1 << 16), b''))))\n"
)
SINK = (
    "import hashlib, socket\n"
    "s = socket.create_server(('{addr}', {port})); c, _ = s.accept()\n"
    "d = b''.join(iter(lambda: c.recv(1 << 16), b''))\n"
    "c.sendall(b'ok' if d == bytes(range(256)) * 40000 else b'bad'); c.close()\n"
)


def test_delay_line_delays_both_ways_and_passes_everything(tmp_path):
    env = dict(os.environ)
    with Hosts(2, net=9) as hosts:
        a, b = hosts.hosts
        b.popen([sys.executable, "-c", ECHO_SERVER.format(addr=b.addr, port=ECHO_PORT)],
                tmp_path / "echo.log", env)  # fmt: skip
        before = measured_rtt_ms(a, b)
        lines = []
        for h, peer in ((a, b), (b, a)):
            rule = ["iptables", "-A", "INPUT", "-s", peer.addr, "-j", "NFQUEUE"]
            assert h.run(*rule, "--queue-num", "0", "--queue-bypass").returncode == 0
            argv = [sys.executable, str(ROOT / "bench/delay_line.py"), "--queue", "0"]
            log = tmp_path / f"line-{h.addr}.log"
            lines.append(h.popen([*argv, "--delay-ms", str(ONE_WAY_MS)], log, env))
        for line, h in zip(lines, (a, b), strict=True):
            _wait_for_line(tmp_path / f"line-{h.addr}.log", line)
        delayed = measured_rtt_ms(a, b)
        assert delayed >= before + 2 * ONE_WAY_MS, (before, delayed)
        b.popen([sys.executable, "-c", SINK.format(addr=b.addr, port=6000)],
                tmp_path / "sink.log", env)  # fmt: skip
        got = a.run(sys.executable, "-c", BULK.format(addr=b.addr, port=6000), timeout=60)
        assert got.stdout.strip() == "2", (got.stdout, got.stderr)  # b'ok': 10 MB, unchanged
        for line in lines:
            line.terminate()
            line.wait(10)
        # --queue-bypass: with nothing listening the link still carries the ping-pong (without it
        # every packet would be dropped and the ping-pong's 10 s socket timeout would fail this)
        assert measured_rtt_ms(a, b) > 0
    assert hosts.leftovers() == []


def _wait_for_line(log: Path, proc) -> None:
    import time

    deadline = time.monotonic() + 30
    while "delay line:" not in (log.read_text() if log.exists() else ""):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, "the delay line did not bind its queue"
        time.sleep(0.1)
