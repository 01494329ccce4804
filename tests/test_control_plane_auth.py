"""The node's ZMQ control plane against a foreign peer: a real colocated PP node holding a cluster
secret gets unsealed, wrongly sealed, malformed and oversized messages on every ZMQ port its front
listens on (found the way an attacker on the host would: the process's listening sockets). Each is
dropped and counted, the readers keep reading, and the node still answers exactly like transformers.
Unit checks of the sealing itself (engine/channel_auth.py) come first."""
from __future__ import annotations

import time

import httpx
import msgpack
import psutil
import pytest
import zmq

from cluster import free_port, start
from engine.channel_auth import OVERHEAD, AuthError, Opener, Sealer
from engine.node_front import EVT_CHANNEL, EVT_MAX_BYTES, STATS_CHANNEL, STATS_MAX_BYTES
from reference import hf_greedy, load_hf

SECRET = "control-plane-test-secret"
MAX_NEW = 8
NODE_ARGS = ["--page-size", "4", "--chunk-size", "16", "--max-batch-tokens", "64", "--max-total-tokens", "8192",
             "--max-running", "32", "--threads", "1"]


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
        opener.open(frame)                          # the same frame again
    assert e.value.reason == "replayed"
    older, newer = seal(b"a"), seal(b"b")
    assert opener.open(newer)[1] == b"b"
    with pytest.raises(AuthError):
        opener.open(older)                          # overtaken by a later frame of the same sender


# ---- a real node ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[:6]


@pytest.fixture(scope="module")
def reference(tiny6, prompts):
    return hf_greedy(load_hf(tiny6), prompts, MAX_NEW)


def _generate(url: str, ids: list[int]) -> list[int]:
    r = httpx.post(f"{url}/generate", timeout=120, headers={"Authorization": f"Bearer {SECRET}"},
                   json={"input_ids": ids, "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True}})
    r.raise_for_status()
    return r.json()["token_ids"]


def _info(url: str) -> dict:
    r = httpx.get(f"{url}/server_info", timeout=10, headers={"Authorization": f"Bearer {SECRET}"})
    r.raise_for_status()
    return r.json()


def _listening_ports(pid: int, skip: int) -> list[int]:
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return sorted({c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.port != skip})


def _send(ctx: zmq.Context, port: int, frames: list[bytes]) -> None:
    s = ctx.socket(zmq.PUSH)
    s.setsockopt(zmq.LINGER, 3000)
    s.connect(f"tcp://127.0.0.1:{port}")
    for f in frames:
        s.send(f)
    s.close()


def _wait_dropped(url: str, want: dict, timeout: float = 30.0) -> dict:
    """The node's dropped-message counters once they reach `want` (or the last reading at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        got = _info(url)["dropped_messages"]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_foreign_malformed_and_oversized_messages_do_not_stop_the_node(tiny6, prompts, reference, tmp_path):
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", "2", "--port", str(port), *NODE_ARGS]
    env = {"PDSERVE_RANK_CONSENSUS_CHECK": "1", "PDSERVE_INTERNAL_TOKEN": SECRET}
    with start(cmd, port, tmp_path / "node.log", env=env) as (url, proc):
        assert _generate(url, prompts[0]) == reference[0]
        ports = _listening_ports(proc.pid, skip=port)
        assert len(ports) == 3, ports                # requests (PUSH), events and stats (PULL)
        evt, stats = Sealer(EVT_CHANNEL, "intruder", secret=SECRET), Sealer(STATS_CHANNEL, "pp9", secret=SECRET)
        ctx = zmq.Context()
        try:
            for p in ports:
                _send(ctx, p, [msgpack.packb([[]]),                     # the event that killed the reader
                               evt.seal(msgpack.packb([[]])),           # the same, sealed as an event batch
                               evt.seal(msgpack.packb(5)),              # sealed, not a batch
                               stats.seal(msgpack.packb({"pp_rank": 9})),   # sealed stats of no rank
                               Sealer(EVT_CHANNEL, "x", secret="wrong").seal(msgpack.packb([]))])
                _send(ctx, p, [b"\0" * (max(EVT_MAX_BYTES, STATS_MAX_BYTES) + OVERHEAD + 1)])   # > MAXMSGSIZE
        finally:
            ctx.term()
        want = {"events:unauthenticated": 3, "events:bad_event": 1, "events:malformed": 1,
                "stats:unauthenticated": 4, "stats:malformed": 1}
        assert _wait_dropped(url, want) == want      # the oversized ones never reached a reader
        got = [_generate(url, ids) for ids in prompts]
        for i, (g, r) in enumerate(zip(got, reference)):
            assert g == r, f"prompt {i} differs from transformers after the foreign messages"
        assert httpx.get(f"{url}/health", timeout=10).status_code == 200
