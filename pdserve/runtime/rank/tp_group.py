"""The TP group of one PP stage (docs/ARCHITECTURE.md section 15): the processes that hold the
same layers, each its share of the heads and the MLP (engine/model/tensor_parallel.py).

A stage's TP rank 0 (its lead) is the stage's member of the PP group, and does what a stage of one
process does: PP0's lead reads the front, every lead receives from its predecessor and sends to its
successor. The other TP ranks (followers) are replicas of the lead's scheduler: each receives
every message its lead received, in the order the lead received it, over the group's replay
channel, and sends nothing outside the group. So every rank of a node applies the same inputs in
the same order, and makes the same decisions, as the slot loop's ranks always have.

What a rank observes locally enters a decision only once the group agrees on it:
- the capacities: the MIN over the TP group, then over the PP group (its leads), then the lead's
  result to its followers;
- the last stage's tokens and its report of compiled guides (engine/guide_hold.py): the lead's,
  shared over the replay; only the lead samples and compiles (runtime/rank/slot_loop.py
  `_sample`);
- the consensus checker's digests: compared over the TP group as well as down the chain.

Two gloo groups per stage, on one rendezvous store for the node (its TCPStore, served by PP0's
lead on the address given, as the PP group's is): the forward's all-reduces and the agreements
on one, the replay's point-to-point stream on the other (a collective on a point-to-point group
can stall its stream). Every wait is bounded by the group's timeout; a peer that dies ends its
group's ranks with an error, and the node with them.
"""

from __future__ import annotations

import datetime
import logging
from collections import deque
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from pdserve.runtime.messages import decode, encode
from pdserve.runtime.rank.pp_comm import Msg, PPLink, rendezvous_store, use_interface_of

log = logging.getLogger(__name__)

_DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_HEADER = 8  # kind, dtype, ndim, dims[0..4]


class TPGroup:
    """This rank's end of its stage's TP group."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        stage: int,
        init_method: str,
        world: int,
        hosts_store: bool,
        timeout_s: float = 60.0,
        host: str = "127.0.0.1",
    ):
        if not 0 <= rank < size:
            raise ValueError(f"tp rank {rank} is outside a group of {size}")
        use_interface_of(host)
        self.rank, self.size, self.stage = rank, size, stage
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = rendezvous_store(init_method, 0 if hosts_store else 1, world, timeout)
        prefix = f"tp/stage{stage}/"
        # typed Any: torch's stubs do not list a backend's own collectives
        self._red: Any = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix + "reduce/", self._store), rank, size, timeout
        )
        self._rep: Any = dist.ProcessGroupGloo(
            dist.PrefixStore(prefix + "replay/", self._store), rank, size, timeout
        )
        self._keys = dist.PrefixStore(prefix + "keys/", self._store)
        self._sends: deque[tuple[list[Any], tuple[torch.Tensor, ...]]] = deque()  # in flight

    @property
    def is_lead(self) -> bool:
        return self.rank == 0

    # --- the forward ------------------------------------------------------------------------------
    def reduce_(self, t: torch.Tensor) -> None:
        """Sums `t` over the group, in place (a layer's partial output)."""
        self._red.allreduce([t]).wait()

    # --- the replay: what the lead received, to its followers, in order --------------------------
    def share(self, kind: Msg, value: Any) -> None:
        """The lead: `value` (a tensor, or what msgpack packs) to every follower."""
        if isinstance(value, torch.Tensor):
            payload = value.contiguous()
        else:
            raw = bytearray(msgpack.packb(value, use_bin_type=True))
            payload = torch.frombuffer(raw, dtype=torch.uint8)
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1], h[2] = int(kind), _DTYPES.index(payload.dtype), payload.dim()
        h[3 : 3 + payload.dim()] = torch.tensor(payload.shape, dtype=torch.int64)
        h[7] = int(isinstance(value, torch.Tensor))
        works = []
        for dst in range(1, self.size):
            works += [self._rep.send([h], dst, 0), self._rep.send([payload], dst, 0)]
        self._sends.append((works, (h, payload)))  # the buffers live until the sends completed

    def take(self, kind: Msg) -> Any:
        """A follower: the next value its lead shared, which must be of `kind`."""
        h = torch.empty(_HEADER, dtype=torch.int64)
        self._rep.recv([h], 0, 0).wait()
        got, dt, nd = int(h[0]), _DTYPES[int(h[1])], int(h[2])
        buf = torch.empty([int(x) for x in h[3 : 3 + nd]], dtype=dt)
        self._rep.recv([buf], 0, 0).wait()
        if got != int(kind):  # a follower that asks for something else has diverged: a bug
            raise RuntimeError(f"tp rank {self.rank}: expected {kind.name}, the lead sent {got}")
        if int(h[7]):
            return buf
        return msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=False)

    def commit(self) -> None:
        """The lead, once a turn: waits until its followers took what it shared."""
        while self._sends:
            works, _buffers = self._sends.popleft()
            for w in works:
                w.wait()

    def same(self, kind: Msg, value: Any) -> Any:
        """The lead's `value` on every rank of the group (what msgpack packs)."""
        if self.is_lead:
            self.share(kind, value)
            return value
        return self.take(kind)

    def same_meta(self, meta: list[Any]) -> list[Any]:
        """PP0's meta of this iteration, the lead's on every rank of the group."""
        if self.is_lead:
            self.share(Msg.META, [encode(m) for m in meta])
            return meta
        return [decode(m) for m in self.take(Msg.META)]

    # --- agreement --------------------------------------------------------------------------------
    def _reduce_ints(self, values: list[int], op: Any) -> list[int]:
        t = torch.tensor(values, dtype=torch.int64)
        self._red.allreduce([t], op).wait()
        return t.tolist()

    def min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        return (
            self._reduce_ints(values, dist.ReduceOp.MIN),
            self._reduce_ints(values, dist.ReduceOp.MAX),
        )

    def from_lead(self, values: list[int]) -> list[int]:
        """The lead's `values` on every rank of the group."""
        t = torch.tensor(values, dtype=torch.int64)
        self._red.broadcast(t, 0).wait()
        return t.tolist()

    def all_gather(self, values: list[int]) -> list[list[int]]:
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._red.allgather([out], [t]).wait()
        return [o.tolist() for o in out]

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        """Waits, at most `timeout_s`, until every rank of the group reached `label` (on the
        store: a load takes longer than one message's timeout)."""
        keys = [f"{label}/{r}" for r in range(self.size)]
        self._keys.set(keys[self.rank], "1")
        try:
            self._keys.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # a timeout, or the store's host gone
            raise TimeoutError(
                f"stage {self.stage} tp rank {self.rank}: the group did not reach {label!r} "
                f"within {timeout_s:g} s ({type(e).__name__})"
            ) from None


class TPLeadLink(PPLink):
    """A stage lead's PP link: its real one (`inner`; None for a node of one stage), whose every
    receive it shares with its followers, and agreements that take the TP group in."""

    def __init__(self, inner: PPLink | None, tp: TPGroup, pp_rank: int, pp_size: int):
        super().__init__(pp_rank, pp_size)
        self.inner, self.tp = inner, tp

    def _pp(self) -> PPLink:
        assert self.inner is not None, "a node of one stage has no PP link"
        return self.inner

    def send_obj(self, dst: int, obj: Any, kind: Msg = Msg.META, commit_after: int = 1) -> None:
        self._pp().send_obj(dst, obj, kind, commit_after)

    def send_tensor(self, dst: int, t: torch.Tensor, kind: Msg = Msg.HIDDEN) -> None:
        self._pp().send_tensor(dst, t, kind)

    def recv(self, src: int, kind: Msg) -> Any:
        value = self._pp().recv(src, kind)
        self.tp.share(kind, value)
        return value

    def commit(self) -> None:
        if self.inner is not None:
            self.inner.commit()
        self.tp.commit()

    def flush(self) -> None:
        self.tp.commit()
        if self.inner is not None:
            self.inner.flush()

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent if self.inner is not None else 0

    @bytes_sent.setter
    def bytes_sent(self, _value: int) -> None:  # PPLink.__init__ sets it; the inner link counts
        pass

    def all_min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        n = len(values)
        lo, hi = self.tp.min_max(values)
        if self.inner is not None:
            lo2, hi2 = self.inner.all_min_max(lo + hi)
            lo, hi = lo2[:n], hi2[n:]
        both = self.tp.from_lead(lo + hi)
        return both[:n], both[n:]

    def all_gather(self, values: list[int]) -> list[list[int]]:
        group = self.tp.all_gather(values)
        chain = self.inner.all_gather(values) if self.inner is not None else [values]
        return chain + group[1:]

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        self.tp.wait_for_peers(label, timeout_s)
        if self.inner is not None:
            self.inner.wait_for_peers(label, timeout_s)
        self.tp.wait_for_peers(label + "/chain", timeout_s)

    def close(self) -> None:
        if self.inner is not None:
            self.inner.close()


class TPFollowLink(PPLink):
    """A follower's link: what its lead received, replayed; it sends nothing."""

    def __init__(self, tp: TPGroup, pp_rank: int, pp_size: int):
        super().__init__(pp_rank, pp_size)
        self.tp = tp

    def send_obj(self, dst: int, obj: Any, kind: Msg = Msg.META, commit_after: int = 1) -> None:
        pass

    def send_tensor(self, dst: int, t: torch.Tensor, kind: Msg = Msg.HIDDEN) -> None:
        pass

    def recv(self, src: int, kind: Msg) -> Any:
        return self.tp.take(kind)

    def commit(self) -> None:
        pass

    def flush(self) -> None:
        pass

    def all_min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        n = len(values)
        lo, hi = self.tp.min_max(values)
        both = self.tp.from_lead(lo + hi)
        return both[:n], both[n:]

    def all_gather(self, values: list[int]) -> list[list[int]]:
        return self.tp.all_gather(values)

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        self.tp.wait_for_peers(label, timeout_s)
        self.tp.wait_for_peers(label + "/chain", timeout_s)

    def close(self) -> None:
        pass


class FollowerFront:
    """A PP0 follower's front: nothing of its own (its meta is its lead's, `TPGroup.same_meta`),
    and its events go nowhere (only PP0's lead answers)."""

    def __init__(self) -> None:
        self.dropped: dict[str, int] = {}

    def poll(self, timeout_ms: int) -> list[Any]:
        return []

    def report(self, events: list[Any]) -> None:
        pass
