"""The nodes' ZMQ control plane against a foreign peer, on real nodes holding a cluster secret:
* a colocated PP node gets unsealed, wrongly sealed, malformed and oversized messages on every ZMQ
  port its front listens on (found the way an attacker on the host would: the process's listening
  sockets); each is dropped and counted, the readers keep reading,
  the node answers like transformers;
* a PD pair gets forged KV control messages for a room in flight; the room completes exactly.
Unit checks of the sealing itself (infra/channel_auth.py) come first."""

from __future__ import annotations

import os
import stat
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import psutil
import pytest
import zmq
from cluster import NODE_ARGS, free_port, start
from metrics_scrape import scrape
from pd_cluster import body as pd_body
from pd_cluster import decode_node, prefill_node
from reference import hf_greedy, load_hf

from consensus.kvpoll import KVPoll
from infra.channel_auth import OVERHEAD, AuthError, Opener, Sealer
from kv_transfer.layout import PoolDesc
from kv_transfer.manager import CHANNEL as KV_CHANNEL
from kv_transfer.messages import KVAbort, KVRegister, KVStatus, encode_message
from runtime.front import EVT_CHANNEL, EVT_MAX_BYTES, STATS_CHANNEL, STATS_MAX_BYTES
from runtime.metrics import FRONT_CHANNELS

SECRET = "control-plane-test-secret"
# The decode request waits for its prefill half on purpose:
# long KV timeouts, not pd_cluster's fast ones.
QUEUE_TIMEOUTS = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "60", "PDSERVE_KV_WAITING_TIMEOUT_S": "60"}
MAX_NEW = 8


# ---- sealing -------------------------------------------------------------------------------------
def test_a_frame_opens_only_with_its_secret_and_channel_once_and_intact():
    seal = Sealer("kv-control", "decode/1", secret=SECRET).seal
    frame = seal(b"payload")
    opener = Opener("kv-control", secret=SECRET)
    assert opener.open(frame) == ("decode/1", b"payload")
    rejected = {
        "another secret": (Opener("kv-control", secret="other"), seal(b"x")),
        "another channel": (Opener("front-evt", secret=SECRET), seal(b"x")),
        "no secret": (Opener("kv-control", secret=""), seal(b"x")),
        "flipped payload bit": (opener, (lambda f: f[:-1] + bytes([f[-1] ^ 1]))(seal(b"x"))),
        "renamed sender": (opener, seal(b"x").replace(b"decode/1", b"decode/2")),
        "truncated": (opener, seal(b"x")[:20]),
        "unsealed": (opener, msgpack.packb({"t": "status"})),
        "empty": (opener, b""),
    }
    for what, (o, f) in rejected.items():
        with pytest.raises(AuthError) as e:
            o.open(f)
        assert e.value.reason == "unauthenticated", what
    with pytest.raises(AuthError) as e:
        opener.open(frame)  # the same frame again
    assert e.value.reason == "replayed"
    older, newer = seal(b"a"), seal(b"b")
    assert opener.open(newer)[1] == b"b"
    with pytest.raises(AuthError):
        opener.open(older)  # overtaken by a later frame of the same sender


# ---- a real node ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[:6]


@pytest.fixture(scope="module")
def reference(tiny6, prompts):
    return hf_greedy(load_hf(tiny6), prompts, MAX_NEW)


def _generate(url: str, ids: list[int]) -> list[int]:
    r = httpx.post(
        f"{url}/generate",
        timeout=120,
        headers={"Authorization": f"Bearer {SECRET}"},
        json={"input_ids": ids, "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True}},
    )
    r.raise_for_status()
    return r.json()["token_ids"]


def _info(url: str) -> dict:
    r = httpx.get(f"{url}/server_info", timeout=10, headers={"Authorization": f"Bearer {SECRET}"})
    r.raise_for_status()
    return r.json()


def _listening_ports(pid: int, skip: int) -> list[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted(
        {c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port != skip}
    )


def _front_unix_sockets(pid: int) -> list[str]:
    """The front's unix sockets (requests, events): in a directory only its user may enter."""
    conns = psutil.Process(pid).net_connections(kind="unix")
    return sorted({c.laddr for c in conns if c.laddr and "pdserve-front-" in c.laddr})


def _send(ctx: zmq.Context, port: int | str, frames: list[bytes]) -> None:
    """Queues `frames` to `port` and gives them half a second to go out. Never blocks longer: a
    peer of the wrong type (the front's PUSH request socket) or one that drops an oversized frame
    never takes them, and a lingering socket would then hold `ctx.term()` forever."""
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.SNDTIMEO, 1000)
    s.connect(port if isinstance(port, str) else f"tcp://127.0.0.1:{port}")
    for f in frames:
        try:
            s.send(f)
        except zmq.Again:
            break
    time.sleep(0.5)
    s.close(linger=0)


def _wait_dropped(url: str, want: dict, timeout: float = 30.0) -> dict:
    """The node's dropped-message counters once they reach `want`
    (or the last reading at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _info(url)["dropped_messages"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_foreign_malformed_and_oversized_messages_do_not_stop_the_node(
    tiny6, prompts, reference, tmp_path
):
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", "2", "--port", str(port), *NODE_ARGS]
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1", "PDSERVE_INTERNAL_TOKEN": SECRET}
    with start(cmd, port, tmp_path / "node.log", env=env) as (url, proc):
        assert _generate(url, prompts[0]) == reference[0]
        ports = _listening_ports(proc.pid, skip=port)
        assert len(ports) == 1, ports  # stats (PULL); requests and events are unix sockets
        unix = _front_unix_sockets(proc.pid)
        assert [os.path.basename(u) for u in unix] == ["evt", "req"], unix
        assert stat.S_IMODE(os.stat(os.path.dirname(unix[0])).st_mode) == 0o700
        ports = [*ports, *(f"ipc://{u}" for u in unix)]
        evt, stats = (
            Sealer(EVT_CHANNEL, "intruder", secret=SECRET),
            Sealer(STATS_CHANNEL, "pp9", secret=SECRET),
        )
        ctx = zmq.Context()
        try:
            for p in ports:
                _send(
                    ctx,
                    p,
                    [
                        msgpack.packb([[]]),  # the event that killed the reader
                        evt.seal(msgpack.packb([[]])),  # the same, sealed as an event batch
                        evt.seal(msgpack.packb(5)),  # sealed, not a batch
                        stats.seal(msgpack.packb({"pp_rank": 9})),  # sealed stats of no rank
                        Sealer(EVT_CHANNEL, "x", secret="wrong").seal(msgpack.packb([])),
                    ],
                )
                _send(
                    ctx, p, [b"\0" * (max(EVT_MAX_BYTES, STATS_MAX_BYTES) + OVERHEAD + 1)]
                )  # > MAXMSGSIZE
        finally:
            ctx.destroy(linger=0)
        want = {
            "events:unauthenticated": 3,
            "events:bad_event": 1,
            "events:malformed": 1,
            "stats:unauthenticated": 4,
            "stats:malformed": 1,
        }
        assert _wait_dropped(url, want) == want  # the oversized ones never reached a reader
        dropped = scrape(url).get("pdserve_control_messages_dropped_total", [])
        # every known reason is there, at 0 until a drop
        counted = {(lab["channel"], lab["reason"]): v for lab, v in dropped if v}
        assert counted == {
            (FRONT_CHANNELS[k.split(":")[0]], k.split(":")[1]): float(v) for k, v in want.items()
        }
        got = [_generate(url, ids) for ids in prompts]
        for i, (g, r) in enumerate(zip(got, reference, strict=True)):
            assert g == r, f"prompt {i} differs from transformers after the foreign messages"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200


def _kv(url: str) -> dict:
    """Rank 0's KV counters and control port (None until its first stats arrived)."""
    rank0 = _info(url)["ranks"][0]
    return (rank0 or {}).get("kv") or {}


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_forged_kv_control_messages_are_dropped_and_the_pd_request_completes_exactly(
    tiny6, prompts, reference, tmp_path
):
    """A decode request is registered and waits for its KV; a foreign socket then tells the decode
    rank the room failed (or succeeded) and sends the prefill rank registrations for the room,
    unsigned and signed by a member that is not the room's peer. Then the prefill request runs. All
    forgeries are dropped and counted; the decode node answers exactly like transformers."""
    env = {**QUEUE_TIMEOUTS, "PDSERVE_INTERNAL_TOKEN": SECRET}
    with (
        prefill_node(tiny6, 1, tmp_path, env=env) as (purl, bport, _),
        decode_node(tiny6, 1, tmp_path, env=env) as (durl, _),
    ):
        _wait(
            lambda: _kv(purl).get("ctrl_port") and _kv(durl).get("ctrl_port"),
            "both ranks' KV stats",
        )
        room, ids = 1234567, prompts[2]
        r = httpx.put(
            f"{durl}/bootstrap_servers",
            json={"servers": [f"127.0.0.1:{bport}"]},
            timeout=10,
            headers={"Authorization": f"Bearer {SECRET}"},
        )  # what the router does
        assert r.status_code == 200, r.text
        with ThreadPoolExecutor(1) as ex:
            decode = ex.submit(
                httpx.post,
                f"{durl}/generate",
                json=pd_body(ids, room, bport, MAX_NEW),
                timeout=120,
                headers={"Authorization": f"Bearer {SECRET}"},
            )
            _wait(
                lambda: (_info(durl)["ranks"][0] or {}).get("held_pages", 0) > 0,
                "the decode rank to register the room",
            )
            stranger = Sealer(
                KV_CHANNEL, "127.0.0.1:8/8", secret=SECRET
            )  # a member, not the room's peer
            fail = encode_message(KVStatus(room, 0, int(KVPoll.Failed), "forged", 0, 0, None))
            ok = encode_message(KVStatus(room, 0, int(KVPoll.Success), "", len(ids), 0, None))
            abort = encode_message(KVAbort(room, "prefill", 0, "forged"))
            pool = PoolDesc(4096, 64, 4, 0, 6, 128, "float32")
            reg = encode_message(
                KVRegister(
                    room,
                    0,
                    ((0, 6),),
                    "127.0.0.1",
                    9,
                    "127.0.0.1:9",
                    pool,
                    (0, 1, 2),
                    4096,
                    512,
                    4096,
                    512,
                )
            )
            ctx = zmq.Context()
            try:
                _send(
                    ctx,
                    _kv(durl)["ctrl_port"],
                    [fail, ok, stranger.seal(fail), stranger.seal(ok), stranger.seal(abort)],
                )
                _send(ctx, _kv(purl)["ctrl_port"], [reg, stranger.seal(reg)])
            finally:
                ctx.term()
            # Until the decode rank has read them all (or, were one taken for real, the room ended).
            _wait(
                lambda: sum(_kv(durl)["dropped"].values()) >= 5 or decode.done(),
                "the forgeries to be read",
            )
            p = httpx.post(
                f"{purl}/generate",
                json=pd_body(ids, room, bport, MAX_NEW),
                timeout=120,
                headers={"Authorization": f"Bearer {SECRET}"},
            )
            d = decode.result(timeout=120)
        assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
        assert d.json()["token_ids"] == reference[2]
        want = {
            durl: {"unauthenticated": 2, "foreign_peer": 3},
            purl: {"unauthenticated": 1, "foreign_peer": 1},
        }
        for url, w in want.items():  # stats arrive twice a second: wait for a fresh reading
            _wait(
                lambda url=url, w=w: _kv(url)["dropped"] == w,
                f"{url} to report {w} (has {_kv(url)['dropped']})",
                15,
            )
