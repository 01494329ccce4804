"""A one-way delay for packets that iptables sends to an NFQUEUE: a stand-in for netem's `delay`
where the kernel has no sch_netem (this machine's). Used by bench/bench_links.py, in a host's
network namespace (root).

Each queued packet gets its verdict (accept) `--delay-ms` after it arrived. The delay is the same
for every packet, so packets leave in the order they came, and one batch verdict (every id up to
the last one due) releases all that are due at once. Only the packet's metadata is copied to this
process, never its bytes (NFQNL_COPY_META), and GSO packets stay whole, so the rate it sustains
is per packet, not per byte.

Why raw netlink and not a library: the NetfilterQueue package needs libnetfilter-queue headers and
a compiler, and copies every payload; the four messages used here are a few struct.packs.

    ip netns exec HOST python bench/delay_line.py --queue 0 --delay-ms 1.0
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import socket
import struct
import sys
import threading
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1
NFQA_CFG_F_GSO = 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SOL_NETLINK, NETLINK_NO_ENOBUFS, SO_RCVBUFFORCE = 270, 5, 33


def _attr(kind: int, payload: bytes) -> bytes:
    head = struct.pack("=HH", 4 + len(payload), kind)
    return head + payload + b"\0" * (-len(payload) % 4)


def _message(msg: int, queue: int, attrs: bytes, seq: int, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return (
        struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, seq, 0) + body
    )


def _config(sock: socket.socket, queue: int, attrs: bytes, seq: int) -> None:
    """One config message, and its acknowledgement (an error code names what the kernel refused)."""
    sock.send(_message(NFQNL_MSG_CONFIG, queue, attrs, seq, NLM_F_REQUEST | NLM_F_ACK))
    data = sock.recv(65536)
    _, kind, _, _, _ = struct.unpack_from("=IHHII", data)
    if kind == NLMSG_ERROR and (err := struct.unpack_from("=i", data, 16)[0]):
        raise OSError(-err, f"NFQUEUE config of queue {queue}: {os.strerror(-err)}")


def open_queue(queue: int) -> socket.socket:
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 64 << 20)  # root: past rmem_max
    # a full receive buffer loses queue messages; their packets still get the next batch verdict
    sock.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    sock.bind((0, 0))
    _config(sock, queue, _attr(NFQA_CFG_CMD, struct.pack("!BxH", NFQNL_CFG_CMD_BIND, 0)), 1)
    _config(sock, queue, _attr(NFQA_CFG_PARAMS, struct.pack("!IBxxx", 0, NFQNL_COPY_META)), 2)
    _config(sock, queue, _attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack("!I", 65536)), 3)
    gso = struct.pack("!I", NFQA_CFG_F_GSO)
    _config(sock, queue, _attr(NFQA_CFG_FLAGS, gso) + _attr(NFQA_CFG_MASK, gso), 4)
    return sock


def packet_ids(data: bytes):
    """The packet id of each NFQNL_MSG_PACKET in one netlink read."""
    off = 0
    while off + 16 <= len(data):
        length, kind = struct.unpack_from("=IH", data, off)
        if length < 16:
            return
        if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
            a, end = off + 20, off + length  # past nlmsghdr (16) and nfgenmsg (4)
            while a + 4 <= end:
                alen, akind = struct.unpack_from("=HH", data, a)
                if alen < 4:
                    break
                if akind & 0x7FFF == NFQA_PACKET_HDR:
                    yield struct.unpack_from("!I", data, a + 4)[0]
                    break
                a += (alen + 3) & ~3
        off += (length + 3) & ~3


class DelayLine:
    def __init__(self, queue: int, delay_s: float):
        self.queue, self.delay_s = queue, delay_s
        self.sock = open_queue(queue)
        self.due: collections.deque[tuple[float, int]] = collections.deque()
        self.ready = threading.Condition()
        self.seq = 10

    def receive(self) -> None:
        while True:
            data = self.sock.recv(1 << 20)
            now = time.monotonic()
            ids = list(packet_ids(data))
            if ids:
                with self.ready:
                    self.due.extend((now + self.delay_s, i) for i in ids)
                    self.ready.notify()

    def release(self) -> None:
        """Accepts every packet whose time has come, the oldest first, by one batch verdict."""
        while True:
            with self.ready:
                if not self.due:
                    self.ready.wait(0.5)
                    continue
                wait = self.due[0][0] - time.monotonic()
                if wait > 0:
                    self.ready.wait(min(wait, 0.5))
                    continue
                last, now = None, time.monotonic()
                while self.due and self.due[0][0] <= now:
                    last = self.due.popleft()[1]
            self.seq += 1
            verdict = _attr(NFQA_VERDICT_HDR, struct.pack("!II", NF_ACCEPT, last))
            self.sock.send(_message(NFQNL_MSG_VERDICT_BATCH, self.queue, verdict, self.seq))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--queue", type=int, required=True)
    ap.add_argument("--delay-ms", type=float, required=True)
    args = ap.parse_args()
    line = DelayLine(args.queue, args.delay_ms / 1e3)
    threading.Thread(target=line.receive, daemon=True).start()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"delay line: queue {args.queue}, {args.delay_ms} ms", flush=True)
    line.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
