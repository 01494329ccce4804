"""Every frame on one network interface, read with an AF_PACKET socket (root only): the tests that
check what crosses the wire. Each TCP payload is searched for forbidden byte strings as it arrives
(across segment boundaries, with a tail kept per direction), and the payloads of chosen ports are
kept, in order, for a test to take requests out of."""

from __future__ import annotations

import base64
import os
import socket
import struct
import threading
from collections import defaultdict

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # the copy of a sent frame; on loopback the same frame also comes in
SOL_PACKET, PACKET_ADD_MEMBERSHIP, PACKET_MR_PROMISC = 263, 1, 1
MAX_KEPT_BYTES = 64 << 20  # payload kept per run for the chosen ports


def can_capture() -> bool:
    return hasattr(socket, "AF_PACKET") and os.geteuid() == 0


def encodings(secret: str) -> list[bytes]:
    """The forms a secret would take on the wire: as is, hex, base64 (standard and URL-safe)."""
    raw = secret.encode()
    b64 = [base64.b64encode(raw), base64.urlsafe_b64encode(raw)]
    return [raw, raw.hex().encode(), *b64, *(b.rstrip(b"=") for b in b64)]


class Capture:
    """Started as a context manager; `found` lists (ports, needle) of every forbidden match."""

    def __init__(self, interface: str, forbidden: list[bytes], keep_ports: set[int] = frozenset()):
        self.interface, self.forbidden, self.keep_ports = interface, forbidden, set(keep_ports)
        self.found: list[tuple[tuple[int, int], bytes]] = []
        self.frames = self.tcp_bytes = 0
        self.kept: dict[tuple[int, int], list[tuple[int, bytes]]] = defaultdict(list)
        self._kept_bytes = 0
        self._tails: dict[tuple, bytes] = {}
        self._longest = max(len(f) for f in forbidden)
        self._stop = threading.Event()
        self._sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
        self._sock.bind((interface, 0))
        # promiscuous: a bridge device sees the frames it forwards between its ports only so
        mreq = struct.pack("iHH8s", socket.if_nametoindex(interface), PACKET_MR_PROMISC, 0, b"")
        self._sock.setsockopt(SOL_PACKET, PACKET_ADD_MEMBERSHIP, mreq)
        self._sock.settimeout(0.2)
        self._thread = threading.Thread(target=self._run, name="capture", daemon=True)

    def __enter__(self) -> Capture:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                frame, addr = self._sock.recvfrom(1 << 16)
            except TimeoutError:
                continue
            except OSError:
                return
            if addr[2] == PACKET_OUTGOING:
                continue
            self.frames += 1
            self._tcp(frame[14:])  # after the Ethernet header (zeros on loopback)

    def _tcp(self, ip: bytes) -> None:
        if len(ip) < 20 or ip[0] >> 4 != 4 or ip[9] != socket.IPPROTO_TCP:
            if len(ip) >= 40 and ip[0] >> 4 == 6 and ip[6] == socket.IPPROTO_TCP:
                self._segment(ip[8:24], ip[24:40], ip[40:])
            return
        ihl = (ip[0] & 0x0F) * 4
        total = struct.unpack("!H", ip[2:4])[0]
        self._segment(ip[12:16], ip[16:20], ip[ihl:total])

    def _segment(self, src: bytes, dst: bytes, tcp: bytes) -> None:
        if len(tcp) < 20:
            return
        sport, dport, seq = struct.unpack("!HHI", tcp[:8])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if not payload:
            return
        self.tcp_bytes += len(payload)
        key = (src, sport, dst, dport)
        window = self._tails.get(key, b"") + payload
        for needle in self.forbidden:
            if needle in window:
                self.found.append(((sport, dport), needle))
        self._tails[key] = window[-(self._longest - 1) :] if self._longest > 1 else b""
        if dport in self.keep_ports and self._kept_bytes < MAX_KEPT_BYTES:
            self.kept[(sport, dport)].append((seq, payload))
            self._kept_bytes += len(payload)

    def streams_to(self, port: int) -> list[bytes]:
        """The bytes each kept connection sent to `port`, in sequence order."""
        out = []
        for (_, dport), segments in self.kept.items():
            if dport == port:
                by_seq = dict(segments)  # a retransmission replaces its first copy
                out.append(b"".join(by_seq[s] for s in sorted(by_seq)))
        return out


def first_request(stream: bytes, start: bytes) -> bytes | None:
    """The first whole HTTP/1.1 request in `stream` whose request line starts with `start`."""
    i = stream.find(start)
    if i < 0:
        return None
    end = stream.find(b"\r\n\r\n", i)
    if end < 0:
        return None
    head = stream[i : end + 4]
    length = 0
    for line in head.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value.strip())
    request = stream[i : end + 4 + length]
    return request if len(request) == len(head) + length else None


def send_raw(addr: str, port: int, raw: bytes, read: bool = True) -> bytes:
    """`raw` (say, a captured request) on a fresh connection; the whole answer, or b"" unread."""
    with socket.create_connection((addr, port), timeout=30) as s:
        s.sendall(raw)
        if not read:
            return b""
        s.shutdown(socket.SHUT_WR)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:  # a reset after the answer
            pass
        return answer
