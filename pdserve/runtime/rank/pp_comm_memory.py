"""The PP group of one node with its ranks as threads of one process (tests only; no production
path imports this, tests/test_layering.py checks it).

`MemoryPPGroup(size).comm(rank)` is a `PPLink` (runtime/rank/pp_comm.py), as `PPComm` is: the inbox,
the turns of `commit` and the ring are that class's own code, and this module is only the wire,
with the real one's semantics:

* objects are msgpack-packed on send and unpacked on receive, so what could not cross the wire
  cannot cross here; tensors are copied on send;
* per link (src -> dst), messages arrive in the order they were sent, each with its kind; `recv`
  returns the next message of the kind asked for and parks the others in an inbox;
* a send returns at once and completes when the receiver took the message off the link (the
  gloo rule PPComm's `commit` relies on): `commit()` starts a turn and waits for the sends due by
  then, `flush()` for all of them;
* `all_min_max` and `all_gather` block until every rank called them (the n-th call of each rank
  meets the n-th call of the others);
* every wait is bounded by `timeout_s` and raises `TimeoutError` (as a gloo timeout raises), and
  `MemoryPPGroup.close()` ends every wait at once with `CommClosed` (a test stopping its ranks).

Not modelled: torch.distributed itself (rendezvous, gloo/NCCL, CUDA streams), message sizes, and
the real group's transport errors; those stay with the real-process tests.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

import msgpack
import torch

from pdserve.runtime.rank.pp_comm import Msg, PPLink


class CommClosed(RuntimeError):
    """The group was closed while a rank waited on it (its test is stopping the ranks)."""


@dataclass
class _Item:
    kind: int
    payload: Any  # msgpack bytes, or a tensor
    taken: threading.Event = field(default_factory=threading.Event)


_CLOSED = _Item(-1, None)


class MemoryPPGroup:
    """The links and collectives of `size` ranks; `comm(rank)` is one rank's end."""

    def __init__(self, size: int, timeout_s: float = 30.0):
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size, self.timeout_s = size, timeout_s
        self._links: dict[tuple[int, int], queue.SimpleQueue[_Item]] = {
            (s, d): queue.SimpleQueue() for s in range(size) for d in range(size) if s != d
        }
        self.closed = threading.Event()
        self._cond = threading.Condition()
        self._rounds: dict[int, list[bytes | None]] = {}  # collective n -> each rank's value
        self._read: dict[int, int] = defaultdict(int)  # collective n -> ranks that took the result

    def comm(self, rank: int) -> MemoryPPComm:
        return MemoryPPComm(self, rank)

    def close(self) -> None:
        """Ends every wait of every rank (now and later) with CommClosed."""
        self.closed.set()
        for q in self._links.values():
            q.put(_CLOSED)
        with self._cond:
            self._cond.notify_all()

    def _exchange(
        self, rank: int, n: int, value: bytes, timeout_s: float | None = None
    ) -> list[bytes]:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        with self._cond:
            got = self._rounds.setdefault(n, [None] * self.size)
            got[rank] = value
            self._cond.notify_all()
            while any(v is None for v in got):
                if self.closed.is_set():
                    raise CommClosed(f"pp_rank {rank}: group closed in collective {n}")
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [r for r, v in enumerate(got) if v is None]
                    raise TimeoutError(
                        f"pp_rank {rank}: collective {n} waited {timeout_s:g} s for {missing}"
                    )
                self._cond.wait(left)
            self._read[n] += 1
            if self._read[n] == self.size:
                del self._rounds[n], self._read[n]
            return cast(list[bytes], list(got))  # the wait above ended with every value in


class MemoryPPComm(PPLink):
    """One rank's end of a MemoryPPGroup (see the module docstring)."""

    def __init__(self, group: MemoryPPGroup, rank: int):
        if not 0 <= rank < group.size:
            raise ValueError(f"rank {rank} outside [0, {group.size})")
        super().__init__(rank, group.size)
        self.group = group
        self.device = torch.device("cpu")
        self._collectives = 0

    # --- sending ----------------------------------------------------------------------------------
    def _put(self, dst: int, item: _Item, due: int) -> None:
        if self.group.closed.is_set():
            raise CommClosed(f"pp_rank {self.rank}: group closed")
        self.group._links[(self.rank, dst)].put(item)
        self._sends.append((due, (dst, item)))

    def send_obj(self, dst: int, obj: Any, kind: Msg = Msg.META, commit_after: int = 1) -> None:
        data = msgpack.packb(obj, use_bin_type=True)
        self._put(dst, _Item(int(kind), data), self.turn + commit_after)
        self.bytes_sent += len(data)

    def send_tensor(self, dst: int, t: torch.Tensor, kind: Msg = Msg.HIDDEN) -> None:
        t = t.detach().contiguous().clone()
        self._put(dst, _Item(int(kind), t), self.turn + 1)
        self.bytes_sent += t.numel() * t.element_size()

    def _wait_sent(self, handle: tuple[int, _Item]) -> None:
        dst, item = handle
        deadline = time.monotonic() + self.group.timeout_s
        while not item.taken.wait(0.05):
            if self.group.closed.is_set():
                raise CommClosed(f"pp_rank {self.rank}: group closed")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pp_rank {self.rank}: a {Msg(item.kind).name} send to {dst} was not "
                    f"received within {self.group.timeout_s:g} s"
                )

    # --- receiving --------------------------------------------------------------------------------
    def _recv_one(self, src: int) -> tuple[int, Any]:
        link = self.group._links[(src, self.rank)]
        try:
            item = link.get(timeout=self.group.timeout_s)
        except queue.Empty:
            raise TimeoutError(
                f"pp_rank {self.rank}: nothing from {src} within {self.group.timeout_s:g} s"
            ) from None
        if item is _CLOSED:
            link.put(_CLOSED)  # for the next wait on this link
            raise CommClosed(f"pp_rank {self.rank}: group closed")
        item.taken.set()
        if isinstance(item.payload, torch.Tensor):
            return item.kind, item.payload
        return item.kind, msgpack.unpackb(item.payload, raw=False, strict_map_key=False)

    # --- collectives ------------------------------------------------------------------------------
    def _collective(self, values: list[int], timeout_s: float | None = None) -> list[list[int]]:
        n, self._collectives = self._collectives, self._collectives + 1
        data = msgpack.packb([int(v) for v in values])
        return [msgpack.unpackb(v) for v in self.group._exchange(self.rank, n, data, timeout_s)]

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        self._collective([], timeout_s)

    def all_min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        every = self._collective(values)
        return [min(col) for col in zip(*every, strict=True)], [
            max(col) for col in zip(*every, strict=True)
        ]

    def all_gather(self, values: list[int]) -> list[list[int]]:
        return self._collective(values)

    def close(self) -> None:
        """Nothing to release; `MemoryPPGroup.close` ends the group."""
