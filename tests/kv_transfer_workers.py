"""A rank process for the kv_transfer tests: hosts KV managers and obeys commands over a Pipe.

Started with multiprocessing's spawn context (`worker_main(conn)`). One Mooncake engine per process,
shared by all the managers it hosts, so several layouts and rooms reuse one process. Reference KV
bytes are a pure function of (room, global layer, k/v), so prefill fills and decode checks without
shipping data through the test.
"""

from __future__ import annotations

import ctypes
import logging
import os
import random
import time
import traceback


def ref_bytes(room: int, layer: int, kv: int, num_tokens: int, token_bytes: int) -> bytes:
    return random.Random(f"{room}/{layer}/{kv}").randbytes(num_tokens * token_bytes)


class Host:
    def __init__(self, protocol: str = "auto"):
        from pdserve.kv_transfer.tcp_transport import make_engine

        # TransferConfig.protocol, as a rank gets it: auto is pdserve's TCP transport without RDMA
        self.engine = make_engine("127.0.0.1", protocol, None)
        self.mgrs, self.buffers, self.rooms, self.heads = {}, {}, {}, {}

    def _pool(self, name, num_pages, page_size, layers, token_bytes, heads=(0, 1, 1)):
        """A pool of `layers` holding KV heads [heads[0], heads[1]) of heads[2] (a token of all of
        them is `token_bytes`)."""
        from pdserve.kv_transfer.layout import PoolDesc

        h0, h1, total = heads
        mine = token_bytes * (h1 - h0) // total
        nbytes = num_pages * (layers[1] - layers[0]) * 2 * page_size * mine
        buf = (ctypes.c_char * nbytes)()
        ctypes.memset(buf, 0xEE, nbytes)
        self.buffers[name] = buf
        self.heads[name] = (h0 * token_bytes // total, mine, token_bytes)
        return PoolDesc(
            ctypes.addressof(buf),
            num_pages,
            page_size,
            layers[0],
            layers[1],
            mine,
            "float32",
            head_start=h0 if total > 1 else 0,
            num_heads=h1 - h0,
        )

    def prefill(
        self,
        name,
        cfg,
        pp_rank,
        pp_size,
        layers,
        num_pages,
        page_size,
        token_bytes,
        bootstrap_addr,
        tp=(0, 1),
        heads=(0, 1, 1),
    ):
        from pdserve.kv_transfer import PrefillKVManager, TransferConfig

        pool = self._pool(name, num_pages, page_size, layers, token_bytes, heads)
        self.mgrs[name] = PrefillKVManager(
            TransferConfig(**cfg), pool, pp_rank, pp_size, bootstrap_addr, self.engine, tp=tp
        )
        return self.mgrs[name].ctrl_port

    def decode(
        self,
        name,
        cfg,
        pp_rank,
        dst_slices,
        num_pages,
        page_size,
        token_bytes,
        aux_slots=16,
        tp=(0, 1),
        heads=(0, 1, 1),
    ):
        from pdserve.kv_transfer import DecodeKVManager, TransferConfig

        rank = pp_rank * tp[1] + tp[0]
        layers = dst_slices[rank][:2]
        pool = self._pool(name, num_pages, page_size, layers, token_bytes, heads)
        self.mgrs[name] = DecodeKVManager(
            TransferConfig(**cfg), pool, pp_rank, dst_slices, aux_slots, self.engine, tp=tp
        )
        return self.mgrs[name].ctrl_port

    def wait_registered(self, name, timeout):
        return self.mgrs[name].registered.wait(timeout)

    def close(self, name):
        self.mgrs.pop(name).close()
        self.buffers.pop(name)
        self.heads.pop(name)
        self.rooms = {k: v for k, v in self.rooms.items() if k[0] != name}

    def _tokens(self, name, room, num_tokens):
        """(address, reference bytes) of each token's run of this pool's heads, per page run: the
        reference is a function of (room, layer, k/v) over tokens of all the heads."""
        pool = self.mgrs[name].pool
        at, width, whole = self.heads[name]
        for layer in range(*pool.layers):
            for kv in (0, 1):
                data = ref_bytes(room, layer, kv, num_tokens, whole)
                for t in range(num_tokens):
                    page, off = divmod(t, pool.page_size)
                    yield (page, layer, kv, off), data[t * whole + at : t * whole + at + width]

    def fill(self, name, room, page_ids, num_tokens):
        pool = self.mgrs[name].pool
        for (page, layer, kv, off), data in self._tokens(name, room, num_tokens):
            ctypes.memmove(pool.addr(page_ids[page], layer, kv, off), data, len(data))

    def check(self, name, room, page_ids, num_tokens):
        """Number of (layer, k/v, page) pieces that differ from the reference (0 = byte-exact)."""
        pool = self.mgrs[name].pool
        bad = set()
        for (page, layer, kv, off), data in self._tokens(name, room, num_tokens):
            if ctypes.string_at(pool.addr(page_ids[page], layer, kv, off), len(data)) != data:
                bad.add((layer, kv, page))
        return len(bad)

    def create_sender(self, name, room):
        self.rooms[(name, room)] = self.mgrs[name].create_sender(room)

    def create_receiver(self, name, room, addr):
        self.rooms[(name, room)] = self.mgrs[name].create_receiver(room, addr)

    def send_chunk(self, name, room, page_ids, start, end, last=False, aux=None):
        self.rooms[(name, room)].send_chunk(page_ids, start, end, last, aux)

    def register(self, name, room, page_ids, aux_slot=None):
        self.rooms[(name, room)].register(page_ids, aux_slot)

    def abort(self, name, room):
        self.rooms[(name, room)].abort()

    def poll(self, name, rooms):
        return {r: (int(self.rooms[(name, r)].poll()), self.rooms[(name, r)].reason) for r in rooms}

    def wait(self, name, rooms, statuses, timeout):
        """Waits until every room's status is in `statuses`;
        returns {room: (status, reason, seconds)}."""
        t0 = time.monotonic()
        while True:
            polled = self.poll(name, rooms)
            if all(s in statuses for s, _ in polled.values()) or time.monotonic() - t0 > timeout:
                return {r: (s, why, time.monotonic() - t0) for r, (s, why) in polled.items()}
            time.sleep(0.02)

    def wait_quiesced(self, name, room, timeout):
        """Waits until a decode room is quiesced without the grace (every prefill rank of its route
        sent its final word, or it never registered); returns whether it is."""
        t0 = time.monotonic()
        while not self.rooms[(name, room)].quiesced(float("inf")):
            if time.monotonic() - t0 > timeout:
                return False
            time.sleep(0.02)
        return True

    def read_aux(self, name, room):
        return self.rooms[(name, room)].read_aux()

    def stats(self, name):
        return self.mgrs[name].stats.snapshot()

    def identity(self, name):
        """(sender id on the control channel, pool as wire data, aux buffer address and size) of one
        manager."""
        m = self.mgrs[name]
        return m.sender_id, m.pool.to_wire(), m.aux_base, m.aux_slots * m.config.aux_slot_bytes


def worker_main(conn, protocol: str = "auto") -> None:
    os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake's glog INFO/WARNING lines
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    host = Host(protocol)
    conn.send(("ok", host.engine.session_id))
    while True:
        try:
            cmd, args, kwargs = conn.recv()
        except EOFError:
            return
        if cmd == "exit":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(Host, cmd)(host, *args, **kwargs)))
        except Exception:
            conn.send(("err", traceback.format_exc()))


class RankProcess:
    """The test's handle on one worker process: `call(cmd, *args)` runs `Host.cmd` there."""

    def __init__(self, ctx, name: str, start_timeout: float = 60.0, protocol: str = "auto"):
        self.name = name
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, protocol), name=name, daemon=True)
        self.proc.start()
        child.close()
        self.session_id = self._reply(start_timeout)

    def _reply(self, timeout: float):
        if not self.conn.poll(timeout):
            raise TimeoutError(f"{self.name}: no answer in {timeout}s")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"{self.name}: {value}")
        return value

    def call(self, cmd: str, *args, timeout: float = 30.0, **kwargs):
        self.conn.send((cmd, args, kwargs))
        return self._reply(timeout)

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit", timeout=5)
            except Exception:
                pass
        self.proc.join(timeout=5)
        self.kill()
