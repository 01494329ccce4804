"""Transfer counters of one KV manager (exported by the metrics issue through `snapshot()`)."""

from __future__ import annotations

import threading
from collections import Counter, deque

from pdserve.kv_transfer.layout import PoolDesc, intersect, window_start

# Why a room ended Failed on one rank: the fixed, snake_case set `add_failure` counts (a detail
# after ":" is dropped) and the `reason` label of pdserve_kv_transfer_failures_total. A prefill
# rank's senders and a decode rank's receivers each fail for their own subset.
SENDER_FAILURES = (
    "aborted",  # the request was aborted (the detail names its AbortReason)
    "aborted_by_decode",  # a decode rank of the room gave it up (KVAbort)
    "bad_chunk",  # a chunk the layout mapping refused
    "bad_registration",  # a decode rank's registration did not fit this rank's pool or slices
    "bootstrap_timeout",  # not every decode rank registered in time
    "peer_dead",  # a decode rank's session went silent (bootstrap heartbeats)
    "prefix_mismatch",  # the decode ranks of the room registered different cached prefixes
    "transfer_error",  # Mooncake failed a write
    "transfer_timeout",  # a write took longer than the transfer timeout
    "waiting_timeout",  # registered, but no chunk came in time
)
RECEIVER_FAILURES = (
    "aborted",
    "aborted_by_prefill",  # a prefill rank of the room gave it up (KVAbort)
    "aux_corrupt",  # the aux slot's frame (room, length, crc32) did not check out
    "aux_unexpected",  # aux data came for a room without an aux slot
    "bootstrap_error",  # the bootstrap server's answer was unusable
    "bootstrap_lost",  # the prefill node's bootstrap server stopped answering heartbeats
    "bootstrap_timeout",  # no route from the bootstrap server in time
    "checksum_mismatch",  # --kv-checksum (PDSERVE_KV_CHECKSUM=1) and the KV received differs
    "incompatible",  # the prefill ranks' KV format differs from this rank's
    "peer_dead",  # a prefill rank's session went silent
    "prefill_failed",  # a prefill rank reported Failed (its reason is the detail)
    "waiting_timeout",  # registered, but the transfer did not finish in time
)
FAILURE_REASONS = tuple(sorted(set(SENDER_FAILURES) | set(RECEIVER_FAILURES)))
# Why a KV manager dropped a control message: the `reason` of pdserve_control_messages_dropped_total
# on channel kv-control.
DROP_REASONS = (
    "unauthenticated",  # no valid seal of the cluster secret
    "replayed",  # a sequence number seen before
    "malformed",  # not a control message
    "handler_error",  # its handler raised (logged with the traceback)
    "send_failed",  # an outgoing message that could not be queued
    "unexpected",  # a kind this side never takes
    "unexpected_rank",  # a status from a prefill rank outside the room's route
    "unknown_room",  # a room this rank does not (or no longer) know
    "foreign_peer",  # a sender that is not a peer of the room
    "duplicate_register",  # a decode rank registered twice
    "bad_pages",  # a registration naming pages outside the decode pool (or not its split)
    "bad_aux",  # a registration naming an aux slot outside the aux buffer
    "pool_changed",  # a decode manager whose pool moved since its first registration
)


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
        self.room_bytes: deque[int] = deque(maxlen=keep_latencies)  # one per `latencies` entry
        # Rooms that succeeded on this rank, in prompt tokens: whose KV moved, and whose KV the
        # decode rank already held (its prefix cache) and so did not move; with the bytes of those.
        self.tokens = 0
        self.skipped_tokens = 0
        self.skipped_bytes = 0
        # KV a sliding window spared: sliding layers' tokens before the window, never moved
        self.window_skipped_bytes = 0

    def add_write(self, num_descriptors: int, num_bytes: int) -> None:
        with self._lock:
            self.descriptors += num_descriptors
            self.bytes_sent += num_bytes

    def add_received(self, num_bytes: int) -> None:
        with self._lock:
            self.bytes_received += num_bytes

    def add_success(self, room: int, latency_s: float, num_bytes: int = 0) -> None:
        """A room done: its latency and the KV bytes it moved on this rank."""
        with self._lock:
            self.rooms_succeeded += 1
            self.latency_sum_s += latency_s
            self.latency_count += 1
            self.latencies.append((room, latency_s))
            self.room_bytes.append(num_bytes)

    def add_room_tokens(
        self, moved: int, skipped: int, skipped_bytes: int, window_skipped_bytes: int = 0
    ) -> None:
        """A room that succeeded: prompt tokens whose KV moved, tokens (and the KV bytes of them)
        skipped because the decode rank held them already, and the sliding layers' KV bytes
        before the window, which moved for none of them."""
        with self._lock:
            self.tokens += moved
            self.skipped_tokens += skipped
            self.skipped_bytes += skipped_bytes
            self.window_skipped_bytes += window_skipped_bytes

    def add_failure(self, reason: str) -> None:
        """`reason`: one of FAILURE_REASONS, optionally followed by ":" and a detail."""
        with self._lock:
            self.failures[reason.partition(":")[0]] += 1

    def add_dropped(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received,
                "descriptors": self.descriptors,
                "tokens": self.tokens,
                "skipped_tokens": self.skipped_tokens,
                "skipped_bytes": self.skipped_bytes,
                "window_skipped_bytes": self.window_skipped_bytes,
                "rooms_succeeded": self.rooms_succeeded,
                "failures": dict(self.failures),
                "dropped": dict(self.dropped),
                "latency_sum_s": self.latency_sum_s,
                "latency_count": self.latency_count,
                "recent_latencies": list(self.latencies),
                "recent_room_bytes": list(self.room_bytes),
            }


def room_tokens(pool: PoolDesc, peers: list, num_tokens: int) -> tuple[int, int, int, int]:
    """(tokens moved, tokens skipped, bytes skipped, bytes a window spared) of a room of
    `num_tokens` prompt tokens on the prefill rank of `pool`, its decode `peers` (every one with
    the same `prefix_tokens`)."""
    skipped = min(peers[0].prefix_tokens, num_tokens) if peers else 0
    per_token = spared = 0
    for p in peers:
        layers = intersect(pool.layers, p.pool.layers)
        heads = intersect(pool.heads, p.pool.heads)
        assert layers and heads  # a room's decode peers are the ranks whose layers and heads meet
        lo, hi = layers
        per_token += (hi - lo) * 2 * (heads[1] - heads[0]) * pool.head_bytes
        slide_from = window_start(num_tokens, p.pool.window, p.pool.page_size)
        spared += kv_bytes(pool, layers, skipped, num_tokens, slide_from, heads)[1]
    return num_tokens - skipped, skipped, skipped * per_token, spared


def kv_bytes(
    pool: PoolDesc,
    layers: tuple[int, int],
    token_start: int,
    num_tokens: int,
    slide_from: int,
    heads: tuple[int, int] | None = None,
) -> tuple[int, int]:
    """(bytes moved, bytes a sliding window spared) for tokens [token_start, num_tokens) of
    `layers` and `heads` (None: all the pool's) of `pool`, counted by token (the whole pages a
    transfer writes are not)."""
    moved = spared = 0
    for layer in range(*layers):
        start = token_start
        if layer in pool.sliding:
            start = max(token_start, slide_from)
            spared += max(0, min(slide_from, num_tokens) - token_start)
        moved += max(0, num_tokens - start)
    per = pool.token_bytes if heads is None else (heads[1] - heads[0]) * pool.head_bytes
    return moved * 2 * per, spared * 2 * per
