"""The Mooncake transfer engine behind a small seam: protocol choice, memory registration, writes.

Mooncake is imported lazily (its wheel needs Debian's libibverbs1 even for TCP). Writes are split
into batches of at most `max_batch` descriptors so that no single call can be rejected for size
(Mooncake's TCP lane rejects a 7,680-descriptor batch outright).
"""
from __future__ import annotations

import logging
import os
import threading
import time
from typing import Sequence

from kv_transfer.layout import Desc, batches

logger = logging.getLogger(__name__)

PROTOCOLS = ("auto", "tcp", "rdma")
RDMA_SYSFS = "/sys/class/infiniband"


def rdma_devices(sysfs: str = RDMA_SYSFS) -> list[str]:
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def resolve_protocol(protocol: str | None, device: str | None,
                     found_devices: Sequence[str] | None = None) -> tuple[str, str]:
    """(protocol, device) from the flags, else PDSERVE_TRANSFER_PROTOCOL / _DEVICE, else auto:
    RDMA when an RDMA device is present, TCP otherwise."""
    protocol = (protocol or os.environ.get("PDSERVE_TRANSFER_PROTOCOL") or "auto").lower()
    device = device or os.environ.get("PDSERVE_TRANSFER_DEVICE") or ""
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown transfer protocol {protocol!r}; choose one of {', '.join(PROTOCOLS)}")
    found = list(rdma_devices() if found_devices is None else found_devices)
    if protocol == "auto":
        protocol = "rdma" if found else "tcp"
    if protocol == "rdma" and not device:
        if not found:
            raise ValueError("protocol rdma asked for, but no RDMA device found; use tcp or set "
                             "PDSERVE_TRANSFER_DEVICE")
        device = ",".join(found)
    if protocol == "tcp":
        device = ""
    return protocol, device


class TransferError(RuntimeError):
    """A failed write; `session_id` names the peer when the engine rejected it (None: stopped by us)."""

    def __init__(self, message: str, session_id: str | None = None):
        super().__init__(message)
        self.session_id = session_id


class MooncakeEngine:
    """One Mooncake TransferEngine per process (several KV managers may share it)."""

    def __init__(self, host: str, protocol: str | None = None, device: str | None = None):
        try:
            from mooncake.engine import TransferEngine
        except ImportError as e:
            raise ImportError(f"{e}: install mooncake-transfer-engine-non-cuda (CPU) or "
                              "mooncake-transfer-engine (CUDA), and Debian's libibverbs1") from e
        self.protocol, self.device = resolve_protocol(protocol, device)
        self._te = TransferEngine()
        rc = self._te.initialize(host, "P2PHANDSHAKE", self.protocol, self.device)
        if rc != 0:
            raise TransferError(f"Mooncake initialize({host}, {self.protocol}, {self.device!r}) returned {rc}")
        self.host = host
        self._first_contact = threading.Lock()   # the first write to a peer opens its segment: one at a time
        self._opened: set[str] = set()
        self.session_id = f"{host}:{self._te.get_rpc_port()}"
        logger.info("KV transfer engine: protocol %s%s, session %s", self.protocol,
                    f" on {self.device}" if self.device else "", self.session_id)

    def register(self, ptr: int, length: int) -> None:
        rc = self._te.register_memory(ptr, length)
        if rc != 0:
            raise TransferError(f"register_memory({ptr:#x}, {length}) returned {rc}")

    def unregister(self, ptr: int) -> None:
        self._te.unregister_memory(ptr)

    def write(self, session_id: str, descs: Sequence[Desc], max_batch: int,
              should_stop=lambda: False) -> int:
        """Writes all descriptors (blocking), batch by batch; returns the bytes moved.

        Raises TransferError on the first failed batch, or when `should_stop()` turns true between
        batches (an abort or a timeout on the caller's side)."""
        moved = 0
        for batch in batches(descs, max_batch):
            if should_stop():
                raise TransferError("stopped")
            src = [d[0] for d in batch]
            dst = [d[1] for d in batch]
            lens = [d[2] for d in batch]
            rc = self._write_once(session_id, src, dst, lens)
            if rc != 0 and not should_stop():    # one retry: writes are idempotent; a dead peer fails fast again
                time.sleep(0.05)
                rc = self._write_once(session_id, src, dst, lens)
            if rc != 0:
                raise TransferError(f"batch write of {len(batch)} descriptors to {session_id} returned {rc}",
                                    session_id)
            moved += sum(lens)
        return moved

    def _write_once(self, session_id: str, src: list[int], dst: list[int], lens: list[int]) -> int:
        if session_id in self._opened:
            return self._te.batch_transfer_sync_write(session_id, src, dst, lens)
        with self._first_contact:
            rc = self._te.batch_transfer_sync_write(session_id, src, dst, lens)
            if rc == 0:
                self._opened.add(session_id)
            return rc
