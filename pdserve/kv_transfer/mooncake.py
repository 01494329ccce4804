"""The Mooncake transfer engine behind a small seam: protocol choice, memory registration, writes.

Mooncake is imported lazily (its wheel needs Debian's libibverbs1 even for TCP).

Writes: every descriptor is its own Mooncake transfer (`transfer_submit_write`), at most
`max_inflight` outstanding per call, and the caller polls them with `transfer_check_status`,
sleeping between polls. Not `batch_transfer_sync_write`: its wait spins in C++ without yielding,
one full core per waiting thread, and on a small CPU those spinners starve the engine's own I/O
threads (measured: layouts with 2-3 prefill ranks per process moved KV at 0.57-0.80 of one raw
write, see bench/results/kv_transfer.md). The window also keeps every peer's queue far under the
engine's limit (Mooncake's TCP lane rejects a 7,680-descriptor batch outright).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Sequence

from pdserve.infra.logs import native_log
from pdserve.kv_transfer.config import PROTOCOLS
from pdserve.kv_transfer.layout import Desc

logger = logging.getLogger(__name__)

POLL_MIN_S, POLL_MAX_S = 50e-6, 1e-3  # sleep between status polls: doubles while nothing completes
DRAIN_TIMEOUT_S = 30.0  # after a failure or stop: how long outstanding writes may take to end
WRITE_TIMEOUT_S = 30.0  # a whole write: this plus 1 s per GB (Mooncake's own sync bound)
RDMA_SYSFS = "/sys/class/infiniband"
# What Mooncake's initialize() prints on every healthy start, logged at DEBUG (infra/logs.py
# native_log): the P2P-handshake metadata looks the local segment up while installing the
# transport, before the engine has published it (an ERROR line, harmless: the segment is published
# right after); the TCP transport's allocator and the topology probe's note are not problems either.
BENIGN_START_LINES = (
    "Local segment descriptor not found",
    "Using default malloc/free for protocol: tcp",
    "No RDMA devices found",
)


def rdma_devices(sysfs: str = RDMA_SYSFS) -> list[str]:
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def resolve_protocol(
    protocol: str | None, device: str | None, found_devices: Sequence[str] | None = None
) -> tuple[str, str]:
    """(protocol, device) from the node's settings (TransferConfig: --transfer-protocol,
    --transfer-device); auto (or None): RDMA when an RDMA device is present, TCP otherwise."""
    protocol = (protocol or "auto").lower()
    device = device or ""
    if protocol not in PROTOCOLS:
        raise ValueError(
            f"unknown transfer protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}"
        )
    found = list(rdma_devices() if found_devices is None else found_devices)
    if protocol == "auto":
        protocol = "rdma" if found else "tcp"
    if protocol == "rdma" and not device:
        if not found:
            raise ValueError(
                "protocol rdma asked for, but no RDMA device found; use tcp or name one with "
                "--transfer-device (PDSERVE_TRANSFER_DEVICE)"
            )
        device = ",".join(found)
    if protocol in ("tcp", "mooncake-tcp"):
        device = ""
    return protocol, device


def write_bounds(descs: Sequence[Desc], max_inflight: int) -> tuple[int, float]:
    """(bytes, monotonic deadline) of one engine write: WRITE_TIMEOUT_S plus 1 s per GB."""
    if max_inflight < 1:
        raise ValueError("max_inflight must be >= 1")
    total = sum(d[2] for d in descs)
    return total, time.monotonic() + WRITE_TIMEOUT_S + total / 1e9


class TransferError(RuntimeError):
    """A failed write; `session_id` names the peer the engine rejected (None: we stopped it)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id


class MooncakeEngine:
    """One Mooncake TransferEngine per process (several KV managers may share it)."""

    def __init__(self, host: str, protocol: str | None = None, device: str | None = None):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(
                f"{e}: install mooncake-transfer-engine-non-cuda (CPU) or "
                "mooncake-transfer-engine (CUDA), and Debian's libibverbs1"
            ) from e
        self.protocol, self.device = resolve_protocol(protocol, device)
        native = "tcp" if self.protocol in ("tcp", "mooncake-tcp") else self.protocol
        if native == "tcp":
            logger.warning(
                "Mooncake's TCP transport listens on every interface and authenticates no peer "
                "(docs/SECURITY.md); pdserve's own is --transfer-protocol tcp"
            )
        self._te = TransferEngine()
        quiet = BENIGN_START_LINES if native == "tcp" else BENIGN_START_LINES[:1]
        with native_log(logging.getLogger("mooncake"), quiet):
            rc = self._te.initialize(host, "P2PHANDSHAKE", native, self.device)
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize({host}, {self.protocol}, {self.device!r}) returned {rc}"
            )
        self.host = host
        self._first_contact = (
            threading.Lock()
        )  # the first write to a peer opens its segment: one at a time
        self._opened: set[str] = set()
        self._registered: dict[int, int] = {}  # registered start -> managers that registered it
        self._reg_lock = threading.Lock()
        self.session_id = f"{host}:{self._te.get_rpc_port()}"
        logger.debug(
            "KV transfer engine: protocol %s%s, session %s",
            self.protocol,
            f" on {self.device}" if self.device else "",
            self.session_id,
        )

    def register(self, ptr: int, length: int) -> None:
        # KV managers sharing the engine may register one pool (an elastic rank's two roles):
        # Mooncake sees it once, and it stays until the last of them unregisters it
        with self._reg_lock:
            if ptr in self._registered:
                self._registered[ptr] += 1
                return
            rc = self._te.register_memory(ptr, length)
            if rc != 0:
                raise TransferError(f"register_memory({ptr:#x}, {length}) returned {rc}")
            self._registered[ptr] = 1

    def unregister(self, ptr: int) -> None:
        with self._reg_lock:
            left = self._registered.get(ptr, 0) - 1
            if left > 0:
                self._registered[ptr] = left
                return
            self._registered.pop(ptr, None)
        self._te.unregister_memory(ptr)

    def write(
        self, session_id: str, descs: Sequence[Desc], max_inflight: int, should_stop=lambda: False
    ) -> int:
        """Writes all descriptors (blocking) and returns the bytes moved.

        Raises TransferError when a descriptor failed twice (writes are idempotent, so one failure
        is retried), when `should_stop()` turns true (an abort or a timeout on the caller's side),
        or after WRITE_TIMEOUT_S. It returns or raises only once none of its writes is still on
        the wire, so after it the destination pages are never written by this call again."""
        total, deadline = write_bounds(descs, max_inflight)
        if not descs:
            return 0
        todo = [(d, 1) for d in reversed(descs)]  # (descriptor, try); popped from the end: in order
        if session_id not in self._opened:
            with self._first_contact:  # the first write to a peer opens its segment
                if session_id not in self._opened:
                    self._run(session_id, [todo.pop()], 1, should_stop, deadline)
                    self._opened.add(session_id)
        self._run(session_id, todo, max_inflight, should_stop, deadline)
        return total

    def _run(
        self,
        session_id: str,
        todo: list[tuple[Desc, int]],
        max_inflight: int,
        should_stop,
        deadline: float,
    ) -> None:
        inflight: deque[tuple[int, Desc, int]] = deque()  # (batch id, descriptor, tries)
        error: TransferError | None = None
        nap = POLL_MIN_S
        while todo or inflight:
            if error is None:
                if should_stop():
                    error = TransferError("stopped")
                elif time.monotonic() > deadline:
                    error = TransferError(f"write to {session_id} timed out", session_id)
            while error is None and todo and len(inflight) < max_inflight:
                d, tries = todo.pop()
                bid = self._te.transfer_submit_write(session_id, d[0], d[1], d[2])
                if not 0 < bid < 1 << 63:  # the binding returns -1 as an unsigned batch id
                    error = TransferError(f"submitting a write to {session_id} failed", session_id)
                else:
                    inflight.append((bid, d, tries))
            if error is not None:
                todo.clear()
                if inflight:
                    self._drain(session_id, inflight)
                raise error
            progressed = False
            while inflight:
                bid, d, tries = inflight[0]
                rc = self._te.transfer_check_status(bid)
                if rc == 0:
                    break
                inflight.popleft()
                progressed = True
                if rc == 1:
                    continue
                if tries < 2 and not should_stop():
                    todo.append((d, tries + 1))  # retried next round, before the untried ones
                    continue
                error = TransferError(
                    f"write of {d[2]} bytes to {session_id} failed (status {rc})", session_id
                )
                break
            if progressed:
                nap = POLL_MIN_S
            elif inflight:
                time.sleep(nap)
                nap = min(nap * 2, POLL_MAX_S)
        if error is not None:
            raise error

    def _drain(self, session_id: str, inflight: deque) -> None:
        """Waits (bounded) until every outstanding write ended, whatever its outcome."""
        end = time.monotonic() + DRAIN_TIMEOUT_S
        while inflight and time.monotonic() < end:
            if self._te.transfer_check_status(inflight[0][0]) != 0:
                inflight.popleft()
            else:
                time.sleep(POLL_MAX_S)
        if inflight:
            logger.warning(
                "%d writes to %s still unfinished %.0f s after their transfer was stopped",
                len(inflight),
                session_id,
                DRAIN_TIMEOUT_S,
            )
