"""Pure parts of kv_transfer: layer mapping, descriptor grouping (checked by replaying the
descriptors on byte arrays), the control-message codec, the bootstrap state/app, protocol choice."""

from __future__ import annotations

import random
import time
from dataclasses import replace

import msgpack
import pytest
from starlette.testclient import TestClient

from pdserve.consensus.kvpoll import KVPoll, update_status
from pdserve.engine.model.config import split_layers
from pdserve.infra.request_signing import sign, signing_key
from pdserve.kv_transfer.bootstrap import (
    HEARTBEAT_TIMEOUT_S,
    BootstrapState,
    PrefillRankInfo,
    build_app,
)
from pdserve.kv_transfer.bootstrap_client import (
    MAX_HEARTBEAT_TIMEOUT_S,
    REQUEST_TIMEOUT_S,
    BootstrapClient,
)
from pdserve.kv_transfer.checksum import kv_checksum
from pdserve.kv_transfer.layout import (
    PoolDesc,
    build_descriptors,
    check_compatible,
    chunk_descriptors,
    coalesce,
    intersect,
    overlapping,
    pages_for,
    window_start,
)
from pdserve.kv_transfer.manager import TransferConfig
from pdserve.kv_transfer.messages import (
    KVAbort,
    KVRegister,
    KVStatus,
    MessageError,
    decode_message,
    encode_message,
)
from pdserve.kv_transfer.mooncake import resolve_protocol
from pdserve.kv_transfer.stats import kv_bytes

TB = 8


def pool(base, pages, ps, a, b):
    return PoolDesc(base, pages, ps, a, b, TB, "float32")


def test_split_and_overlap():
    assert split_layers(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert intersect((0, 10), (10, 20)) is None and intersect((0, 12), (10, 20)) == (10, 12)
    prefill = dict(enumerate(split_layers(30, 3)))  # [0,10) [10,20) [20,30)
    assert overlapping((6, 12), prefill) == [(0, 6, 10), (1, 10, 12)]
    assert overlapping((0, 30), prefill) == [(0, 0, 10), (1, 10, 20), (2, 20, 30)]
    for p_pp in range(1, 7):
        for d_pp in range(1, 7):
            d_slices = split_layers(30, d_pp)
            for a, b in split_layers(
                30, p_pp
            ):  # every prefill layer goes to exactly one decode rank
                covered = [
                    lo
                    for _, lo, hi in overlapping((a, b), dict(enumerate(d_slices)))
                    for lo in range(lo, hi)
                ]
                assert covered == list(range(a, b))


def _replay(src: PoolDesc, dst: PoolDesc, descs) -> tuple[bytearray, bytearray]:
    mem_src = bytearray(random.Random(1).randbytes(src.nbytes))
    mem_dst = bytearray(dst.nbytes)
    for s, d, n in descs:
        assert src.base_ptr <= s and s + n <= src.base_ptr + src.nbytes
        assert dst.base_ptr <= d and d + n <= dst.base_ptr + dst.nbytes
        mem_dst[d - dst.base_ptr : d - dst.base_ptr + n] = mem_src[
            s - src.base_ptr : s - src.base_ptr + n
        ]
    return mem_src, mem_dst


@pytest.mark.parametrize("p_ps,d_ps", [(4, 4), (4, 8), (8, 4), (3, 5)])
@pytest.mark.parametrize(
    "src_layers,dst_layers", [((0, 6), (0, 6)), ((0, 6), (2, 9)), ((3, 9), (0, 4))]
)
def test_descriptors_move_exactly_the_shared_tokens(p_ps, d_ps, src_layers, dst_layers):
    rng = random.Random(p_ps * 100 + d_ps)
    src, dst = pool(4096, 16, p_ps, *src_layers), pool(1 << 20, 16, d_ps, *dst_layers)
    n = 29
    sp = rng.sample(range(16), pages_for(n, p_ps))
    dp = rng.sample(range(16), pages_for(n, d_ps))
    descs = build_descriptors(src, dst, sp, dp, 0, 11) + build_descriptors(src, dst, sp, dp, 11, n)
    ms, md = _replay(src, dst, descs)
    lo, hi = intersect(src_layers, dst_layers)
    for layer in range(lo, hi):
        for kv in (0, 1):
            for t in range(n):
                s = src.addr(sp[t // p_ps], layer, kv, t % p_ps) - src.base_ptr
                d = dst.addr(dp[t // d_ps], layer, kv, t % d_ps) - dst.base_ptr
                assert md[d : d + TB] == ms[s : s + TB], (layer, kv, t)


def test_descriptor_grouping():
    src, dst = pool(0, 32, 4, 0, 6), pool(1 << 20, 32, 4, 0, 6)
    # same layers, both sides consecutive for pages 0-2, then a break on the decode side
    descs = build_descriptors(src, dst, [4, 5, 6, 7], [10, 11, 12, 20], 0, 16)
    assert [n for _, _, n in descs] == [3 * src.page_bytes, src.page_bytes]
    # a layer subset: one descriptor per page (other layers sit between pages)
    sub = pool(1 << 20, 32, 4, 0, 3)
    descs = build_descriptors(src, sub, [4, 5, 6, 7], [10, 11, 12, 13], 0, 16)
    assert len(descs) == 4 and all(n == 3 * src.layer_bytes for _, _, n in descs)
    # different page sizes: per (layer, k/v, token run)
    other = pool(1 << 20, 32, 8, 0, 6)
    descs = build_descriptors(src, other, [4, 5, 6, 7], [1, 3], 0, 16)
    assert len(descs) == 6 * 2 * 4 and all(n == 4 * TB for _, _, n in descs)
    # the chunk's page range is rounded out to whole pages on equal page sizes
    descs = build_descriptors(src, dst, [0, 2, 4, 6], [1, 3, 5, 7], 5, 9)
    assert len(descs) == 2
    assert coalesce([(0, 100, 4), (4, 104, 4), (9, 108, 1)]) == [(0, 100, 8), (9, 108, 1)]


@pytest.mark.parametrize("p_ps,d_ps", [(4, 4), (4, 8), (8, 4)])
def test_descriptors_after_a_held_prefix(p_ps, d_ps):
    """A decode table that starts after a cached prefix of 2 decode pages: exactly the tokens from
    there on move, into the table's pages, and nothing lands in the pages the prefix holds."""
    rng = random.Random(p_ps * 10 + d_ps)
    src, dst = pool(4096, 16, p_ps, 0, 6), pool(1 << 20, 16, d_ps, 2, 9)
    n, first = 29, 2
    sp = rng.sample(range(16), pages_for(n, p_ps))
    dp = rng.sample(range(16), pages_for(n, d_ps) - first)
    held = first * d_ps
    descs = build_descriptors(src, dst, sp, dp, held, n, first)
    ms, md = _replay(src, dst, descs)
    for layer in range(2, 6):
        for kv in (0, 1):
            for t in range(held, n):
                s = src.addr(sp[t // p_ps], layer, kv, t % p_ps) - src.base_ptr
                d = dst.addr(dp[t // d_ps - first], layer, kv, t % d_ps) - dst.base_ptr
                assert md[d : d + TB] == ms[s : s + TB], (layer, kv, t)
    at = [(d - dst.base_ptr, d - dst.base_ptr + n - 1) for _, d, n in descs]
    written = {p for lo, hi in at for p in range(lo // dst.page_bytes, hi // dst.page_bytes + 1)}
    assert written <= set(dp), written - set(dp)
    with pytest.raises(ValueError):  # a range reaching into the held prefix
        build_descriptors(src, dst, sp, dp, held - 1, n, first)
    with pytest.raises(ValueError):  # a table too short for the tokens after the prefix
        build_descriptors(src, dst, sp, dp[:-1], held, n, first)


@pytest.mark.parametrize("p_ps,d_ps", [(4, 4), (4, 8), (8, 4), (3, 5)])
def test_sliding_layers_move_only_the_window(p_ps, d_ps):
    """A window of 7 on layers 1, 2, 4 and 5 of [0, 6): the full layers move every token, the
    sliding ones exactly the tokens from window_start on (a decode page boundary) and nothing
    before, over chunks; the checksum of both sides covers the same tokens; kv_bytes counts the
    bytes moved and spared."""
    rng = random.Random(p_ps * 7 + d_ps)
    sliding = (1, 2, 4, 5)
    src = PoolDesc(4096, 16, p_ps, 0, 6, TB, "float32", window=7, sliding=sliding)
    dst = PoolDesc(1 << 20, 16, d_ps, 0, 6, TB, "float32", window=7, sliding=sliding)
    n = 29
    start = window_start(n, 7, d_ps)
    assert start == (29 - 7) // d_ps * d_ps and start > 0
    sp = rng.sample(range(16), pages_for(n, p_ps))
    dp = rng.sample(range(16), pages_for(n, d_ps))
    descs = chunk_descriptors(src, dst, sp, dp, (0, 11), 0, n)
    descs += chunk_descriptors(src, dst, sp, dp, (11, n), 0, n)
    ms, md = _replay(src, dst, descs)
    for layer in range(6):
        for kv in (0, 1):
            for t in range(n):
                s = src.addr(sp[t // p_ps], layer, kv, t % p_ps) - src.base_ptr
                d = dst.addr(dp[t // d_ps], layer, kv, t % d_ps) - dst.base_ptr
                if layer in sliding and t < start:
                    assert md[d : d + TB] == bytes(TB), (layer, kv, t)  # never written
                else:
                    assert md[d : d + TB] == ms[s : s + TB], (layer, kv, t)
    moved, spared = kv_bytes(dst, (0, 6), 0, n, start)
    assert spared == len(sliding) * start * 2 * TB
    assert moved + spared == 6 * n * 2 * TB
    with pytest.raises(ValueError, match="page boundary"):
        build_descriptors(src, dst, sp, dp, 0, n, 0, start + 1)
    with pytest.raises(ValueError, match="sliding windows differ"):
        check_compatible(src, PoolDesc(1 << 20, 16, d_ps, 0, 6, TB, "float32"))
    # a pool with only full layers on the shared run agrees with any sliding set outside it
    check_compatible(
        PoolDesc(0, 16, 4, 3, 4, TB, "float32", window=7),
        PoolDesc(0, 16, 4, 0, 6, TB, "float32", window=7, sliding=sliding),
    )


def test_sliding_layers_checksum_what_moved():
    """kv_checksum over the window's tokens of the sliding layers is the same on both sides
    after the transfer, whatever the bytes before the window on the decode side."""
    import ctypes

    sliding = (1, 2)
    n, ps = 29, 4
    buf_src = ctypes.create_string_buffer(random.Random(3).randbytes(16 * 3 * 2 * ps * TB))
    buf_dst = ctypes.create_string_buffer(random.Random(4).randbytes(16 * 3 * 2 * ps * TB))
    src = PoolDesc(ctypes.addressof(buf_src), 16, ps, 0, 3, TB, "float32", 7, sliding)
    dst = PoolDesc(ctypes.addressof(buf_dst), 16, ps, 0, 3, TB, "float32", 7, sliding)
    pages = list(range(pages_for(n, ps)))
    for s, d, length in chunk_descriptors(src, dst, pages, pages, (0, n), 0, n):
        ctypes.memmove(d, s, length)
    start = window_start(n, 7, ps)
    want = kv_checksum(src, pages, (0, 3), n, slide_from=start)
    assert kv_checksum(dst, pages, (0, 3), n, slide_from=start) == want
    assert kv_checksum(dst, pages, (0, 3), n) != kv_checksum(src, pages, (0, 3), n)


def test_descriptors_reject_bad_tables():
    src, dst = pool(0, 8, 4, 0, 2), pool(1 << 20, 8, 4, 0, 2)
    with pytest.raises(ValueError):
        build_descriptors(src, dst, [0], [0, 1], 0, 8)  # prefill table too short
    with pytest.raises(ValueError):
        build_descriptors(src, dst, [0, 9], [0, 1], 0, 8)  # page outside the pool
    with pytest.raises(ValueError):
        build_descriptors(src, PoolDesc(1 << 20, 8, 4, 0, 2, TB, "bfloat16"), [0, 1], [0, 1], 0, 8)
    assert build_descriptors(src, pool(1 << 20, 8, 4, 2, 4), [0, 1], [0, 1], 0, 8) == []


def _register():
    return KVRegister(
        1 << 62,
        1,
        ((0, 15, 0, 1), (15, 30, 0, 1)),  # (layers, KV heads) of each decode rank
        "127.0.0.1",
        5555,
        "127.0.0.1:1234",
        pool(1 << 30, 64, 16, 15, 30),
        (3, 9, 4),
        777,
        4096,
        0,
        8192,
    )


def test_codec_round_trip_and_strictness():
    for msg in (
        _register(),
        KVStatus(5, 2, int(KVPoll.Success), "", 100, 12, 0xDEAD),
        KVStatus(5, 2, int(KVPoll.Failed), "transfer_error", 0, 0, None),
        KVAbort(5, "decode", 0, "aborted"),
        replace(
            _register(),
            pool=PoolDesc(1 << 30, 64, 16, 15, 30, TB, "bfloat16", window=512, sliding=(15, 16)),
        ),
    ):
        assert decode_message(encode_message(msg)) == msg
    good = msgpack.unpackb(encode_message(_register()))
    sliding_pool = {**good["pool"], "window": 512, "sliding": [15, 16]}
    bad = [
        b"\xc1garbage",
        b"",
        msgpack.packb([1, 2]),
        msgpack.packb({"t": "nope"}),
        msgpack.packb({**good, "room": "1"}),
        msgpack.packb({**good, "room": -1}),
        msgpack.packb({**good, "room": 1 << 63}),
        msgpack.packb({**good, "page_ids": [1, "2"]}),
        msgpack.packb({**good, "page_ids": [True]}),
        msgpack.packb({**good, "extra": 1}),
        msgpack.packb({k: v for k, v in good.items() if k != "aux_ptr"}),
        msgpack.packb({**good, "dst_slices": [[5, 3]]}),
        msgpack.packb({**good, "dst_slices": [[0, 15]]}),  # no heads
        msgpack.packb({**good, "dst_slices": [[0, 15, 1, 1]]}),  # no head in the range
        msgpack.packb({**good, "pool": {"base_ptr": 1}}),
        msgpack.packb({**good, "pool": {**sliding_pool, "sliding": [16, 15]}}),  # out of order
        msgpack.packb({**good, "pool": {**sliding_pool, "sliding": [3]}}),  # outside the slice
        msgpack.packb({**good, "pool": {**sliding_pool, "sliding": ["15"]}}),
        msgpack.packb({**good, "pool": {**sliding_pool, "window": 0}}),  # sliding, no window
        msgpack.packb({**good, "ctrl_port": 0}),
        msgpack.packb({**good, "prefix_tokens": -4}),
        msgpack.packb({**good, "prefix_tokens": "8"}),
        msgpack.packb({**good, "prefix_tokens": 1 << 32}),
        msgpack.packb({k: v for k, v in good.items() if k != "prefix_tokens"}),
        msgpack.packb(
            {
                "t": "status",
                "room": 1,
                "src_rank": 0,
                "status": 2,
                "reason": "",
                "num_tokens": 0,
                "aux_bytes": 0,
                "checksum": None,
            }
        ),  # not a terminal status
        msgpack.packb({"t": "abort", "room": 1, "side": "router", "rank": 0, "reason": ""}),
    ]
    for data in bad:
        with pytest.raises(MessageError):
            decode_message(data)


def _info(rank, size, a, b):
    return PrefillRankInfo(
        rank, size, a, b, "127.0.0.1", 6000 + rank, f"127.0.0.1:{7000 + rank}", 16, 768, "float32"
    )


def test_bootstrap_state_route_and_liveness():
    now = [0.0]
    st = BootstrapState(heartbeat_timeout_s=2.0, clock=lambda: now[0])
    st.register(_info(0, 2, 0, 15))
    assert st.route(0, 30) is None and not st.ready()
    st.register(_info(1, 2, 15, 30))
    assert [r.pp_rank for r in st.route(10, 20, "dec:1")] == [0, 1]
    assert [r.pp_rank for r in st.route(15, 30)] == [1]
    now[0] = 1.0
    assert st.heartbeat("127.0.0.1:7000", ["dec:1", "never-seen"]) == []
    now[0] = 2.5
    assert st.heartbeat("127.0.0.1:7000", ["dec:1", "127.0.0.1:7001"]) == [
        "dec:1",
        "127.0.0.1:7001",
    ]


def signed(secret: str):
    """Signs a TestClient's request as SignedAuth does an httpx client's (starlette's TestClient
    runs on httpx2, which takes a function as its auth)."""
    key = signing_key(secret)

    def flow(request):
        target, host = request.url.raw_path, request.headers["host"]
        request.headers["Authorization"] = sign(
            key, request.method, target, host, request.read(), time.time()
        )
        return request

    return flow


def test_bootstrap_app_endpoints():
    client = TestClient(build_app(BootstrapState(), token="s3cret"))
    auth = signed("s3cret")
    assert client.get("/health").json()["status"] == "ok"
    assert client.put("/route", json=_info(0, 2, 0, 15).to_wire()).status_code == 401
    # the secret itself, sent in clear, is no credential: no process of the cluster sends it
    clear = {"authorization": "Bearer s3cret"}
    assert client.put("/route", json=_info(0, 2, 0, 15).to_wire(), headers=clear).status_code == 401
    wrong = signed("s3cret-not")
    assert client.put("/route", json=_info(0, 2, 0, 15).to_wire(), auth=wrong).status_code == 401
    assert (
        client.put(
            "/route", json={**_info(0, 2, 0, 15).to_wire(), "pp_rank": "0"}, auth=auth
        ).status_code
        == 400
    )
    assert client.put("/route", json=_info(0, 2, 0, 15).to_wire(), auth=auth).status_code == 200
    assert client.get("/route?layer_start=0&layer_end=30", auth=auth).status_code == 503
    assert client.put("/route", json=_info(1, 2, 15, 30).to_wire(), auth=auth).status_code == 200
    r = client.get("/route?layer_start=20&layer_end=30&session=d", auth=auth)
    assert r.status_code == 200 and [x["pp_rank"] for x in r.json()["ranks"]] == [1]
    sessions = sorted([_info(0, 2, 0, 15).session_id, _info(1, 2, 15, 30).session_id])
    assert client.post("/heartbeat", json={"session": "d", "peers": ["x"]}, auth=auth).json() == {
        "dead": [],
        "ranks": sessions,
        "timeout_s": HEARTBEAT_TIMEOUT_S,
    }
    assert client.post("/heartbeat", json={"session": 1}, auth=auth).status_code == 400


def test_bootstrap_app_refuses_oversized_bodies():
    """A declared or a streamed (chunked, no Content-Length) body over 64 KiB gets 413."""
    client = TestClient(build_app(BootstrapState(), token="s3cret"))
    big = {"session": "d", "peers": ["p" * 100] * 1000}
    assert client.post("/heartbeat", json=big, auth=signed("s3cret")).status_code == 413

    def chunks():
        yield b'{"session": "d", "peers": ['
        for _ in range(2000):
            yield b'"' + b"p" * 100 + b'",'
        yield b'"p"]}'

    whole = b"".join(chunks())
    key = signing_key("s3cret")
    for method, path in (("POST", "/heartbeat"), ("PUT", "/route")):
        # a valid signature over the whole body, the body streamed: refused once past the limit
        auth = {"authorization": sign(key, method, path.encode(), "testserver", whole, time.time())}
        r = client.request(method, path, content=chunks(), headers=auth)
        assert r.status_code == 413, r.text


def test_protocol_choice(monkeypatch):
    # the node's command line reads PDSERVE_TRANSFER_PROTOCOL / _DEVICE (--transfer-protocol,
    # --transfer-device): past it, only the config decides
    monkeypatch.setenv("PDSERVE_TRANSFER_PROTOCOL", "rdma")
    monkeypatch.setenv("PDSERVE_TRANSFER_DEVICE", "mlx5_9")
    assert resolve_protocol(None, None, found_devices=[]) == ("tcp", "")
    assert resolve_protocol("auto", None, found_devices=[]) == ("tcp", "")
    assert resolve_protocol(None, None, found_devices=["mlx5_0", "mlx5_1"]) == (
        "rdma",
        "mlx5_0,mlx5_1",
    )
    assert resolve_protocol("tcp", None, found_devices=["mlx5_0"]) == ("tcp", "")
    assert resolve_protocol("rdma", "mlx5_3", found_devices=[]) == ("rdma", "mlx5_3")
    with pytest.raises(ValueError, match="--transfer-device"):
        resolve_protocol("rdma", None, found_devices=[])
    with pytest.raises(ValueError):
        resolve_protocol("efa", None, found_devices=[])


def test_kvpoll_order():
    assert update_status(None, KVPoll.Bootstrapping) == KVPoll.Bootstrapping
    assert update_status(KVPoll.Transferring, KVPoll.WaitingForInput) == KVPoll.Transferring
    assert update_status(KVPoll.Failed, KVPoll.Success) == KVPoll.Failed
    assert min(KVPoll.Success, KVPoll.Failed) == KVPoll.Failed


def test_decode_ranks_naming_different_prefixes_fail_the_room():
    """Every decode rank of a room must hold the same cached prefix: a prefill rank that gets two
    registrations naming different ones fails the room (`prefix_mismatch`), and both decode ranks
    hear it (in-memory transfer: the same checks as the Mooncake sender)."""
    import ctypes

    from pdserve.kv_transfer.in_memory import InMemoryFabric

    bufs = [ctypes.create_string_buffer(8 * 64 * TB) for _ in range(3)]
    fabric = InMemoryFabric(1)
    fabric.prefill_manager(pool(ctypes.addressof(bufs[0]), 8, 4, 0, 4), 0)
    slices = [(0, 2), (2, 4)]
    decode = [
        fabric.decode_manager(pool(ctypes.addressof(bufs[1 + r]), 8, 4, *slices[r]), r, slices)
        for r in range(2)
    ]
    ends = [m.create_receiver(7, fabric.address) for m in decode]
    with pytest.raises(ValueError):
        ends[0].register([1, 2], 0, prefix_tokens=6)  # not page-aligned
    ends[0].register([1, 2], 0, prefix_tokens=8)
    ends[1].register([3, 4, 5], 0, prefix_tokens=4)
    sender = fabric.prefill[0].create_sender(7)
    assert sender.poll() == KVPoll.Failed and sender.reason == "prefix_mismatch"
    assert [e.poll() for e in ends] == [KVPoll.Failed, KVPoll.Failed]
    assert fabric.prefill[0].stats.snapshot()["failures"] == {"prefix_mismatch": 1}


def test_one_timed_out_heartbeat_does_not_make_a_rank_dead():
    """A rank beats every heartbeat_interval_s, and a beat can take up to the client's request
    timeout: one beat that timed out leaves a gap of interval + timeout + interval (4 s by default).
    The server must not call the rank dead for that (it did at 3 s, and the decode ranks then failed
    the rank's rooms as peer_dead). It allows heartbeat_misses beats, as the ranks allow their
    server: 3 x 1 s + 2 s; two timed-out beats in a row (7 s) are a dead rank."""
    cfg = TransferConfig()
    gap = cfg.heartbeat_interval_s + REQUEST_TIMEOUT_S + cfg.heartbeat_interval_s
    now = [0.0]
    st = BootstrapState(clock=lambda: now[0])  # the server's default, what prefill nodes run
    st.heartbeat("rank", [])
    now[0] = gap
    assert st.heartbeat("peer", ["rank"]) == []
    now[0] = 2 * gap - cfg.heartbeat_interval_s
    assert st.heartbeat("peer", ["rank"]) == ["rank"]
    assert (
        cfg.heartbeat_misses * cfg.heartbeat_interval_s + REQUEST_TIMEOUT_S
    ) == HEARTBEAT_TIMEOUT_S


def test_a_heartbeat_answer_is_checked_and_its_timeout_bounded():
    """The server's timeout in a heartbeat answer bounds how long a registration counts as proof
    of life on a prefill rank: read as a number in [0, MAX_HEARTBEAT_TIMEOUT_S] (a server that
    does not say: 0, no proof), and an answer of the wrong shape is a failed beat."""
    import httpx

    answers = []

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answers.pop(0))

    client = BootstrapClient("127.0.0.1:1")
    client._http = httpx.Client(
        base_url="http://127.0.0.1:1", transport=httpx.MockTransport(handler)
    )
    base = {"dead": ["d", 7], "ranks": ["p"]}
    for timeout, want in [(5, 5.0), (2.5, 2.5), (1e300, MAX_HEARTBEAT_TIMEOUT_S), (-3, 0.0)]:
        answers.append({**base, "timeout_s": timeout})
        assert client.heartbeat("s", ["d"]) == (["d"], {"p"}, want)
    answers.append(base)
    assert client.heartbeat("s", ["d"]).timeout_s == 0.0
    for bad in ({**base, "timeout_s": "5"}, {**base, "timeout_s": True}, {"ranks": []}):
        answers.append(bad)
        with pytest.raises(ValueError):
            client.heartbeat("s", ["d"])
