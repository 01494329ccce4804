"""Point-to-point messages between the PP ranks of one node (torch.distributed: gloo or NCCL).

Every message is a small int64 header on the CPU (gloo) group, then a payload:
plain objects (meta, votes, sampled outputs) as msgpack bytes on the CPU group, tensors (hidden
states) on the device group (the same gloo group on CPU, an NCCL group on GPU). Between two ranks
messages arrive in the order they were sent; each carries a type, and a receiver that finds a type
it did not ask for parks the message in an inbox until it is asked for (hidden states and outputs
share the link with different rhythms, docs/ARCHITECTURE.md section 3).

Sends are asynchronous: `send_*` returns at once and keeps the buffers alive; `commit()` waits for
the previous turn's sends. Receives block, with the group's timeout, so a dead or stuck peer ends in
an exception (the rank then exits), never in an endless wait.

On GPU with `comm_stream=True`, sends and receives run on their own CUDA stream: a forward waits
only on the event of the receive that produced its input. A send keeps its tensor alive until the
turn it is committed in, so no forward overwrites what a send still reads.
"""

from __future__ import annotations

import datetime
import enum
import fcntl
import logging
import os
import socket
import struct
from collections import defaultdict, deque
from typing import Any

import msgpack
import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

_DTYPES = [torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32]
_HEADER = 8  # kind, dtype, ndim, dims[0..4]


class Msg(enum.IntEnum):
    META = 1  # the replicated request stream of one iteration
    HIDDEN = 2  # a slice's output activations for the current slot
    OUTPUT = 3  # sampled tokens of the slot being harvested (the ring)
    VOTE = 4  # consensus traffic
    SYNC = 5  # start-up agreement (capacities, addresses)
    # a TP group's replay only (runtime/rank/tp_group.py), never on a PP link: the last stage
    # lead's tokens, and its report of compiled guides
    SAMPLE = 6
    GUIDES = 7


def interface_of(address: str) -> str | None:
    """The name of the network interface that holds IPv4 `address`, or None."""
    try:
        want = socket.inet_aton(socket.gethostbyname(address))
    except OSError:
        return None
    for _, name in socket.if_nameindex():
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:  # SIOCGIFADDR: the interface's IPv4 address
                req = struct.pack("256s", name.encode()[:15])
                got = fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]
            except OSError:
                continue
        if got == want:
            return name
    return None


def use_interface_of(host: str) -> None:
    """Gloo listens on one interface, by default the one the machine's hostname resolves to, which
    on a host with several (or in a network namespace) is not the rank's own: point it at the
    interface holding `host`, unless GLOO_SOCKET_IFNAME already names one."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    name = interface_of(host)
    if name is None:
        log.warning("no interface holds %s: gloo picks its own", host)
        return
    os.environ["GLOO_SOCKET_IFNAME"] = name


def rendezvous_store(
    init_method: str, rank: int, size: int, timeout: datetime.timedelta
) -> dist.TCPStore:
    """The PP group's rendezvous at `tcp://host:port`. Rank 0 serves it on a socket bound to that
    host only: torch's own TCPStore server listens on every interface."""
    if not init_method.startswith("tcp://"):
        raise ValueError(f"PP rendezvous {init_method!r}: expected tcp://host:port")
    host, _, port = init_method[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if rank != 0:
        return dist.TCPStore(host, int(port), size, False, timeout)
    fd = socket.create_server((host, int(port)), backlog=128).detach()
    try:
        return dist.TCPStore(host, int(port), size, True, timeout, master_listen_fd=fd)
    except BaseException:
        os.close(fd)
        raise


class PPLink:
    """What a PP rank's end of its links does above the wire, the same for the real group
    (`PPComm`) and the in-process one of the tests (runtime/rank/pp_comm_memory.py): the ring's
    neighbours, the inbox that parks a message of another kind until it is asked for, and the
    turns of `commit`. A subclass is only the wire: it sends (appending `(turn due, handle)` to
    `_sends`), receives one message (`_recv_one`), and waits until a send was received
    (`_wait_sent`)."""

    # the TP group of this rank's stage (runtime/rank/tp_group.py); None: a stage of one process
    tp: Any = None

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.turn = 0
        self.bytes_sent = 0
        self._sends: deque[tuple[int, Any]] = deque()  # (turn due, the wire's handle of a send)
        self._inbox: dict[tuple[int, int], deque] = defaultdict(deque)

    @property
    def prev(self) -> int:
        return (self.rank - 1) % self.size

    @property
    def next(self) -> int:
        return (self.rank + 1) % self.size

    # --- the wire ---------------------------------------------------------------------------------
    def send_obj(self, dst: int, obj: Any, kind: Msg = Msg.META, commit_after: int = 1) -> None:
        """`commit_after`: turns until the receiver surely took it (ring's last hop: pp_size)."""
        raise NotImplementedError

    def send_tensor(self, dst: int, t: torch.Tensor, kind: Msg = Msg.HIDDEN) -> None:
        raise NotImplementedError

    def _recv_one(self, src: int) -> tuple[int, Any]:
        """The next message from `src`, whatever its kind: (kind, value); blocks, bounded."""
        raise NotImplementedError

    def _wait_sent(self, handle: Any) -> None:
        """Returns once the send of `handle` was received (bounded)."""
        raise NotImplementedError

    def all_min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        raise NotImplementedError

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        """Says this rank reached `label` and waits, at most `timeout_s`, until every rank did.
        Raises TimeoutError naming the ranks that did not."""
        raise NotImplementedError

    def all_gather(self, values: list[int]) -> list[list[int]]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    # --- above the wire ---------------------------------------------------------------------------
    def commit(self) -> None:
        """Starts a turn: waits for the sends due by now, then releases their buffers.

        A gloo send completes when the peer receives it. Hidden states and meta are received in the
        same iteration, so they are due one turn later. PP0 receives the last rank's outputs up to
        pp_size - 1 turns after they were sent; waiting for them sooner would tie the last rank to
        PP0's progress and, with a collective in between (the consensus checker), deadlock.
        """
        self.turn += 1
        keep: deque[tuple[int, Any]] = deque()
        while self._sends:
            due, handle = self._sends.popleft()
            if due <= self.turn:
                self._wait_sent(handle)
            else:
                keep.append((due, handle))
        self._sends = keep

    def flush(self) -> None:
        """Waits for every send so far (shutdown)."""
        while self._sends:
            _, handle = self._sends.popleft()
            self._wait_sent(handle)

    def recv(self, src: int, kind: Msg) -> Any:
        """Blocks until a message of `kind` from `src` is there; parks other kinds in the inbox."""
        box = self._inbox[(src, int(kind))]
        if box:
            return box.popleft()
        while True:
            k, val = self._recv_one(src)
            if k == kind:
                return val
            self._inbox[(src, k)].append(val)


class PPComm(PPLink):
    """The PP group of a node's rank processes (module docstring)."""

    def __init__(
        self,
        rank: int,
        size: int,
        *,
        init_method: str,
        backend: str = "gloo",
        timeout_s: float = 60.0,
        device: str = "cpu",
        comm_stream: bool = False,
        host: str = "127.0.0.1",
    ):
        super().__init__(rank, size)
        use_interface_of(host)
        self.device = torch.device(device)
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = rendezvous_store(init_method, rank, size, timeout)
        dist.init_process_group(
            backend,
            store=self._store,
            rank=rank,
            world_size=size,
            timeout=timeout,
        )
        # Objects and headers always go over gloo; on NCCL, tensors get their own group.
        self.cpu_group = dist.new_group(backend="gloo") if backend != "gloo" else dist.group.WORLD
        self.dev_group = dist.group.WORLD
        # Collectives (start-up agreement, consensus checker) get a group of their own: on a shared
        # gloo group they can interleave with the point-to-point stream and stall it.
        self.coll_group = dist.new_group(backend="gloo")
        # a send's handle in `_sends`: its two works (header, payload) and the buffers they read
        self.stream = None
        if comm_stream and self.device.type == "cuda":
            self.stream = torch.cuda.Stream(device=self.device)

    # --- sending ----------------------------------------------------------------------------------
    def _header(self, kind: Msg, t: torch.Tensor) -> torch.Tensor:
        if t.dim() > _HEADER - 3:
            raise ValueError(f"tensor of {t.dim()} dims is too many for a PP message")
        h = torch.zeros(_HEADER, dtype=torch.int64)
        h[0], h[1], h[2] = int(kind), _DTYPES.index(t.dtype), t.dim()
        h[3 : 3 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
        return h

    def send_obj(self, dst: int, obj: Any, kind: Msg = Msg.META, commit_after: int = 1) -> None:
        payload = torch.frombuffer(
            bytearray(msgpack.packb(obj, use_bin_type=True)), dtype=torch.uint8
        )
        h = self._header(kind, payload)
        self._sends.append(
            (
                self.turn + commit_after,
                (
                    dist.isend(h, dst, group=self.cpu_group),
                    dist.isend(payload, dst, group=self.cpu_group),
                    h,
                    payload,
                ),
            )
        )
        self.bytes_sent += payload.numel()

    def send_tensor(self, dst: int, t: torch.Tensor, kind: Msg = Msg.HIDDEN) -> None:
        t = t.contiguous()
        h = self._header(kind, t)
        hw = dist.isend(h, dst, group=self.cpu_group)
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                tw = dist.isend(t, dst, group=self.dev_group)
        else:
            tw = dist.isend(t, dst, group=self.dev_group)
        self._sends.append((self.turn + 1, (hw, tw, h, t)))
        self.bytes_sent += t.numel() * t.element_size()

    def _wait_sent(self, handle: tuple[Any, ...]) -> None:
        for w in handle[:2]:
            if w is not None:
                w.wait()

    # --- receiving --------------------------------------------------------------------------------
    def _recv_one(self, src: int) -> tuple[int, Any]:
        h = torch.empty(_HEADER, dtype=torch.int64)
        dist.recv(h, src, group=self.cpu_group)
        kind, dt, nd = int(h[0]), _DTYPES[int(h[1])], int(h[2])
        shape = [int(x) for x in h[3 : 3 + nd]]
        if kind in (Msg.HIDDEN,):
            buf = torch.empty(shape, dtype=dt, device=self.device)
            if self.stream is not None:
                with torch.cuda.stream(self.stream):
                    dist.recv(buf, src, group=self.dev_group)
                torch.cuda.current_stream(self.device).wait_stream(self.stream)
            else:
                dist.recv(buf, src, group=self.dev_group)
            return kind, buf
        buf = torch.empty(shape, dtype=dt)
        dist.recv(buf, src, group=self.cpu_group)
        return kind, msgpack.unpackb(buf.numpy().tobytes(), raw=False, strict_map_key=False)

    # --- collectives (start-up agreement and the consensus checker) -------------------------------
    def all_min_max(self, values: list[int]) -> tuple[list[int], list[int]]:
        t = torch.tensor(values, dtype=torch.int64)
        lo, hi = t.clone(), t.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.coll_group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.coll_group)
        return lo.tolist(), hi.tolist()

    def all_gather(self, values: list[int]) -> list[list[int]]:
        t = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(out, t, group=self.coll_group)
        return [o.tolist() for o in out]

    def wait_for_peers(self, label: str, timeout_s: float) -> None:
        # on the rendezvous store, not the group: a gloo collective waits only the group's
        # timeout, and this wait is for work (a slice's load) far longer than one message
        keys = [f"{label}/{r}" for r in range(self.size)]
        self._store.set(keys[self.rank], "1")
        try:
            self._store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as e:  # torch's DistStoreError (a timeout), or the store's host gone
            missing = [r for r, k in enumerate(keys) if not self._safe_check(k)]
            raise TimeoutError(
                f"pp_rank {self.rank}: ranks {missing} did not reach {label!r} within "
                f"{timeout_s:g} s ({type(e).__name__})"
            ) from None

    def _safe_check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:  # the store is gone: nothing can be said of that rank
            return False

    def close(self) -> None:
        try:
            dist.destroy_process_group()
        except Exception as e:  # the peers may already be gone; nothing is left to release then
            log.debug("destroy_process_group: %s", e)
