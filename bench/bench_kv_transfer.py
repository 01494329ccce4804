"""KV transfer benchmark: kv_transfer vs one raw write of its engine, on this machine, in one run.

The KV of a 2,048-token SmolLM2-135M prompt (fp32: 30 layers x 2 x 2,048 tokens x 768 B = 94.4 MB,
pages of 16 tokens = 128 pages, scattered page tables on both sides) moves from the prefill ranks to
the decode ranks of a layout, each rank sending exactly its layer slice. Two processes (one per
node; the ranks of a node share that process's transfer engine) on loopback: `--protocol tcp`,
pdserve's authenticated TCP transport (the default), or `mooncake-tcp`, Mooncake's TCP transport.

Reported: effective GB/s of one room (send_chunk on prefill -> Success on every decode rank, aux
included) vs a single raw write of the same total bytes between the same two engines (one
descriptor: `write` of pdserve's engine, Mooncake's `batch_transfer_sync_write`), their ratio
(target >= 0.8), and per-room latency with 1, 8 and 32 rooms in flight.

    .venv/bin/python bench/bench_kv_transfer.py [--layouts 1x1,2x3,3x2] [--protocol tcp]
        [--out bench/results/kv_transfer_tcp.md]
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import os
import random
import statistics
import time

NUM_LAYERS, TOKEN_BYTES, PAGE_SIZE, PROMPT = 30, 3 * 64 * 4, 16, 2048
ROOM_PAGES = PROMPT // PAGE_SIZE  # 128
SRC_PAGES, DST_BLOCKS = 2 * ROOM_PAGES, 8  # rooms beyond 8 in flight reuse decode page blocks
KV_BYTES = NUM_LAYERS * 2 * PROMPT * TOKEN_BYTES
CFG = dict(
    bootstrap_timeout_s=30,
    waiting_timeout_s=60,
    transfer_timeout_s=60,
    heartbeat_interval_s=1.0,
    transfer_threads=1,
)  # the ranks of a node share this process and its 2 cores


class Node:
    """All ranks of one node in this process, one shared Mooncake engine."""

    def __init__(self):
        from pdserve.kv_transfer.tcp_transport import make_engine

        self.engine = make_engine("127.0.0.1", os.environ["BENCH_PROTOCOL"], None)
        self.mgrs, self.bufs, self.rooms, self.raw = [], [], {}, []

    def _pool(self, num_pages, layers):
        from pdserve.kv_transfer.layout import PoolDesc

        nbytes = num_pages * (layers[1] - layers[0]) * 2 * PAGE_SIZE * TOKEN_BYTES
        buf = (ctypes.c_char * nbytes)()
        ctypes.memset(buf, 0x5A, nbytes)  # fault the pages in
        self.bufs.append(buf)
        return PoolDesc(
            ctypes.addressof(buf),
            num_pages,
            PAGE_SIZE,
            layers[0],
            layers[1],
            TOKEN_BYTES,
            "float32",
        )

    def setup(self, side, pp, bootstrap_addr):
        from pdserve.engine.model.config import split_layers
        from pdserve.kv_transfer import DecodeKVManager, PrefillKVManager, TransferConfig

        slices = split_layers(NUM_LAYERS, pp)
        for rank, layers in enumerate(slices):
            if side == "prefill":
                m = PrefillKVManager(
                    TransferConfig(**CFG),
                    self._pool(SRC_PAGES, layers),
                    rank,
                    pp,
                    bootstrap_addr,
                    self.engine,
                )
                m.registered.wait(10)
            else:
                m = DecodeKVManager(
                    TransferConfig(**CFG),
                    self._pool(DST_BLOCKS * ROOM_PAGES, layers),
                    rank,
                    slices,
                    64,
                    self.engine,
                )
            self.mgrs.append(m)

    def teardown(self):
        for m in self.mgrs:
            m.close()
        self.mgrs, self.bufs, self.rooms = [], [], {}

    def raw_buffer(self, nbytes):
        buf = (ctypes.c_char * nbytes)()
        ctypes.memset(buf, 0x33, nbytes)
        self.raw.append(buf)
        self.engine.register(ctypes.addressof(buf), nbytes)
        return self.engine.session_id, ctypes.addressof(buf)

    def raw_write(self, src_ptr, session, dst_ptr, nbytes):
        t = time.perf_counter()
        if self.engine.protocol == "tcp":
            self.engine.write(session, [(src_ptr, dst_ptr, nbytes)], 1)
        else:
            rc = self.engine._te.batch_transfer_sync_write(
                session, [src_ptr], [dst_ptr], [nbytes]
            )  # plain Mooncake
            assert rc == 0, f"raw write returned {rc}"
        return time.perf_counter() - t

    def open_rooms(self, side, rooms, bootstrap_addr):
        rng = random.Random(len(rooms))
        src = rng.sample(range(SRC_PAGES), ROOM_PAGES)
        for i, room in enumerate(rooms):
            block = i % DST_BLOCKS
            dst = rng.sample(range(block * ROOM_PAGES, (block + 1) * ROOM_PAGES), ROOM_PAGES)
            for m in self.mgrs:
                if side == "prefill":
                    self.rooms[(m.pp_rank, room)] = (m.create_sender(room), src)
                else:
                    r = self.rooms[(m.pp_rank, room)] = (
                        m.create_receiver(room, bootstrap_addr),
                        dst,
                    )
                    r[0].register(dst, aux_slot=i % 64)

    def wait(self, want, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            states = [int(o.poll()) for o, _ in self.rooms.values()]
            if all(s in (want, 0) for s in states):
                return all(s == want for s in states)
            time.sleep(0.001)
        return False

    def send_all(self):
        t0 = time.monotonic()
        for s, src in self.rooms.values():
            s.send_chunk(src, 0, PROMPT, last=True, aux=b"first-token" * 4)
        return t0

    def finish_times(self):
        """Per room: when the last decode rank saw Success
        (monotonic clock, shared by processes)."""
        out = {}
        for (_, room), (r, _) in self.rooms.items():
            out[room] = max(out.get(room, 0.0), r.finished_at or float("inf"))
        self.rooms = {}
        return out


def node_main(conn):
    os.environ.setdefault("GLOG_minloglevel", "2")
    node = Node()
    conn.send(None)
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            return
        conn.send(getattr(node, cmd)(*args))


class Proc:
    def __init__(self, ctx):
        self.conn, child = ctx.Pipe()
        self.p = ctx.Process(target=node_main, args=(child,), daemon=True)
        self.p.start()
        self.conn.recv()

    def __call__(self, cmd, *args):
        self.conn.send((cmd, args))
        if not self.conn.poll(120):
            raise TimeoutError(cmd)
        return self.conn.recv()


def run_layout(pre, dec, p_pp, d_pp, repeats, raw):
    from pdserve.kv_transfer import BootstrapServer

    server = BootstrapServer().start()
    try:
        pre("setup", "prefill", p_pp, server.addr)
        dec("setup", "decode", d_pp, server.addr)
        results, rng = {}, random.Random(p_pp * 10 + d_pp)
        for inflight in [1] * repeats + [8, 32]:
            if inflight == 1:  # interleaved, so both see the same machine load
                results.setdefault("raw", []).append(raw())
            rooms = [rng.getrandbits(63) for _ in range(inflight)]
            dec("open_rooms", "decode", rooms, server.addr)
            pre("open_rooms", "prefill", rooms, server.addr)
            assert pre("wait", 2), "senders did not reach WaitingForInput"
            t0 = pre("send_all")
            ok = dec("wait", 4)
            assert ok and pre("wait", 4), "a room failed"
            lat = sorted(t - t0 for t in dec("finish_times").values())
            pre("finish_times")
            results.setdefault(inflight, []).append(lat)
        return results
    finally:
        pre("teardown")
        dec("teardown")
        server.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layouts", default="1x1,2x3,3x2")
    ap.add_argument("--protocol", default="tcp", choices=("tcp", "mooncake-tcp"))
    ap.add_argument(
        "--repeats", type=int, default=9
    )  # the raw write alone swings 0.8-1.9 GB/s here
    ap.add_argument(
        "--out",
        default=os.path.join(os.path.dirname(__file__), "results", "kv_transfer.md"),
    )
    args = ap.parse_args()
    os.environ["BENCH_PROTOCOL"] = args.protocol  # the spawned node processes read it
    ctx = mp.get_context("spawn")
    pre, dec = Proc(ctx), Proc(ctx)
    try:
        src = pre("raw_buffer", KV_BYTES)[1]
        session, dst = dec("raw_buffer", KV_BYTES)
        raw = lambda: pre("raw_write", src, session, dst, KV_BYTES)  # noqa: E731
        lines = [
            "# kv_transfer benchmark",
            "",
            f"KV of a {PROMPT}-token SmolLM2-135M prompt, fp32, {NUM_LAYERS} layers, "
            f"pages of {PAGE_SIZE}: {KV_BYTES / 1e6:.1f} MB per room, scattered page tables; "
            f"transfer protocol `{args.protocol}` on loopback, {os.cpu_count()} cores shared with "
            f"other jobs. Raw = one write of the same {KV_BYTES / 1e6:.1f} MB (one "
            "descriptor) between the same two engines, measured interleaved with the 1-room runs; "
            f"medians of {args.repeats}.",
            "",
            "| layout (prefill PP x decode PP) | raw GB/s | kv_transfer 1 room GB/s | ratio | "
            "latency/room, 1 in flight (ms) | 8 in flight: median / max (ms) | 32 in flight: "
            "median / max (ms) | aggregate GB/s at 32 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for layout in args.layouts.split(","):
            p_pp, d_pp = map(int, layout.split("x"))
            res = run_layout(pre, dec, p_pp, d_pp, args.repeats, raw)
            one = statistics.median(r[0] for r in res[1])
            gbs = KV_BYTES / one / 1e9
            raw_gbs = KV_BYTES / statistics.median(res["raw"]) / 1e9
            l8, l32 = res[8][0], res[32][0]
            agg = 32 * KV_BYTES / l32[-1] / 1e9
            lines.append(
                f"| {p_pp} x {d_pp} | {raw_gbs:.2f} | {gbs:.2f} | {gbs / raw_gbs:.2f} | "
                f"{one * 1e3:.1f} | {statistics.median(l8) * 1e3:.0f} / {l8[-1] * 1e3:.0f} | "
                f"{statistics.median(l32) * 1e3:.0f} / {l32[-1] * 1e3:.0f} | {agg:.2f} |"
            )
            print(lines[-1], flush=True)
        text = "\n".join(lines) + "\n"
        print(text)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    finally:
        for p in (pre, dec):
            try:
                p.conn.send(("exit", ()))
            except OSError:
                pass
            p.p.join(timeout=10)
            if p.p.is_alive():
                p.p.kill()


if __name__ == "__main__":
    main()
