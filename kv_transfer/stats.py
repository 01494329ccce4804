"""Transfer counters of one KV manager (exported by the metrics issue through `snapshot()`)."""

from __future__ import annotations

import threading
from collections import Counter, deque


class TransferStats:
    """Thread-safe counters: bytes, descriptors (one engine write each), rooms, failures by reason,
    dropped messages, and the latency of each finished room (seconds from the first chunk, or from
    registration on decode, to Success)."""

    def __init__(self, keep_latencies: int = 1024):
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0  # decode: bytes prefill reported sending to this rank
        self.descriptors = 0
        self.rooms_succeeded = 0
        self.failures: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.latency_sum_s = 0.0
        self.latency_count = 0
        self.latencies: deque[tuple[int, float]] = deque(maxlen=keep_latencies)

    def add_write(self, num_descriptors: int, num_bytes: int) -> None:
        with self._lock:
            self.descriptors += num_descriptors
            self.bytes_sent += num_bytes

    def add_received(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_received += num_bytes

    def add_success(self, room: int, latency_s: float) -> None:
        with self._lock:
            self.rooms_succeeded += 1
            self.latency_sum_s += latency_s
            self.latency_count += 1
            self.latencies.append((room, latency_s))

    def add_failure(self, reason: str) -> None:
        with self._lock:
            self.failures[reason] += 1

    def add_dropped(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "descriptors": self.descriptors,
                "rooms_succeeded": self.rooms_succeeded,
                "failures": dict(self.failures),
                "dropped": dict(self.dropped),
                "latency_sum_s": self.latency_sum_s,
                "latency_count": self.latency_count,
                "recent_latencies": list(self.latencies),
            }
