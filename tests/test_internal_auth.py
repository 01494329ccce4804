"""The internal plane needs the cluster secret, on real nodes holding one (a colocated node at
PP 2, a prefill and a decode node at PP 1, started once for the whole file):
* the nodes' ZMQ control plane against a foreign peer (the first tests on the nodes: they count
  every dropped message exactly): the colocated node gets unsealed, wrongly sealed, malformed and
  oversized messages on every ZMQ port its front listens on (found the way an attacker on the host
  would: the process's listening sockets); each is dropped and counted, the readers keep reading,
  the node answers like transformers. The PD pair gets forged KV control messages for a room in
  flight; the room completes exactly. (The unit checks of the sealing:
  tests/test_control_plane_auth.py.)
* HTTP: every node kind's internal endpoints, the prefill node's bootstrap server, and a decode
  node contacts only bootstrap servers the router registered; a decode node or router refuses a
  network bind without a secret."""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import msgpack
import psutil
import pytest
import zmq
from cluster import NODE_ARGS, ROOT, ClusterAuth, free_port, start, wait_healthy
from metrics_scrape import scrape
from pd_cluster import FAST_TIMEOUTS, body
from reference import hf_greedy, load_hf

from pdserve.consensus.kvpoll import KVPoll
from pdserve.infra.channel_auth import OVERHEAD, Sealer
from pdserve.infra.request_signing import sign, signing_key
from pdserve.kv_transfer.layout import PoolDesc
from pdserve.kv_transfer.manager import CHANNEL as KV_CHANNEL
from pdserve.kv_transfer.messages import KVAbort, KVRegister, KVStatus, encode_message
from pdserve.runtime.front.metrics import FRONT_CHANNELS
from pdserve.runtime.front.process import EVT_CHANNEL, EVT_MAX_BYTES, STATS_CHANNEL, STATS_MAX_BYTES

SECRET = "test-cluster-secret"
AUTH = ClusterAuth(SECRET)  # requests signed with the secret, as the cluster's own processes do
# What each internal endpoint refuses: nothing, a wrong secret's signature, and the right secret
# itself in clear (no process of the cluster sends it; it never crosses the network).
REFUSED = (
    {},
    {"auth": ClusterAuth(SECRET + "x")},
    {"headers": {"Authorization": f"Bearer {SECRET}"}},
    {"headers": {"Authorization": SECRET}},
)
ENV = {**FAST_TIMEOUTS, "PDSERVE_INTERNAL_TOKEN": SECRET}
# Long KV timeouts on the PD pair: a decode request waits for its prefill half on purpose (the
# forged control messages come first), or forever (the pending cap: its KV never comes).
SLOW_KV = {"PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "120", "PDSERVE_KV_WAITING_TIMEOUT_S": "120"}
MAX_NEW = 8
# One client for the many short calls: a module-level httpx call builds a client (and its TLS
# context) of its own each time. No keep-alive: every call still opens its own connection.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module", autouse=True)
def _close_http():
    yield
    HTTP.close()


@pytest.fixture(scope="module", autouse=True)
def spawned(tiny6, tmp_path_factory):
    """A colocated node (PP 2), a prefill and a decode node (PP 1, the decode node holding at most
    2 requests), all holding the cluster secret, with the rank consensus checker on; started at
    once, with the module's first test (the bind refusals, which need no node, run while they
    load). Yields ({name: (url, Popen)}, bootstrap port, log folder)."""
    tmp = tmp_path_factory.mktemp("auth")
    cport, pport, bport, dport = free_port(), free_port(), free_port(), free_port()
    common = ["--model", str(tiny6), *NODE_ARGS]
    specs = {
        "colocated": (["serve", "--port", str(cport), "--pp", "2"], cport, ENV),
        "prefill": (
            ["prefill", "--port", str(pport), "--bootstrap-port", str(bport), "--pp", "1"],
            pport,
            {**ENV, **SLOW_KV},
        ),
        "decode": (
            ["decode", "--port", str(dport), "--max-pending", "2", "--pp", "1"],
            dport,
            {**ENV, **SLOW_KV},
        ),
    }
    with contextlib.ExitStack() as stack:
        procs = {
            name: stack.enter_context(
                start(cmd + common, port, tmp / f"{name}.log", env=env, wait=False)
            )
            for name, (cmd, port, env) in specs.items()
        }
        yield procs, bport, tmp


@pytest.fixture(scope="module")
def nodes(spawned, request):
    """The nodes once healthy: {name: url, "bport": ..., "colocated_proc": Popen}."""
    procs, bport, tmp = spawned
    request.getfixturevalue("reference")  # transformers' answers, computed while they load
    for name, (url, proc) in procs.items():
        wait_healthy(url, proc, 240, tmp / f"{name}.log")
    return {
        **{name: url for name, (url, _) in procs.items()},
        "bport": bport,
        "colocated_proc": procs["colocated"][1],
    }


@pytest.fixture(scope="module")
def hf(tiny6):
    return load_hf(tiny6)


@pytest.fixture(scope="module")
def prompts(mixed_prompts):
    return mixed_prompts[:6]


@pytest.fixture(scope="module")
def reference(hf, prompts):
    return hf_greedy(hf, prompts, MAX_NEW)


def _generate(url: str, ids: list[int]) -> list[int]:
    r = HTTP.post(
        f"{url}/generate",
        timeout=120,
        auth=AUTH,
        json={"input_ids": ids, "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True}},
    )
    r.raise_for_status()
    return r.json()["token_ids"]


def _info(url: str) -> dict:
    r = HTTP.get(f"{url}/server_info", timeout=10, auth=AUTH)
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


@pytest.mark.parametrize("cmd", [["decode", "--host", "0.0.0.0"], ["router", "--host", "0.0.0.0"]])
def test_refuses_a_network_bind_without_a_secret(cmd, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_INTERNAL_TOKEN")}
    r = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *cmd, "--port", str(free_port())],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "without a cluster secret" in r.stderr, r.stderr[-2000:]


def test_foreign_malformed_and_oversized_messages_do_not_stop_the_node(nodes, prompts, reference):
    url, proc = nodes["colocated"], nodes["colocated_proc"]
    port = int(url.rsplit(":", 1)[1])
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
    assert HTTP.get(f"{url}/health", timeout=10).status_code == 200


def _kv(url: str) -> dict:
    """Rank 0's KV counters and control port (None until its first stats arrived)."""
    rank0 = _info(url)["ranks"][0]
    return (rank0 or {}).get("kv") or {}


def _wait(pred, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def _register_bootstrap_server(durl: str, bport: int) -> None:
    """Tells the decode node the prefill node's bootstrap server, as the router does."""
    r = HTTP.put(
        f"{durl}/bootstrap_servers",
        json={"servers": [f"127.0.0.1:{bport}"]},
        timeout=10,
        auth=AUTH,
    )
    assert r.status_code == 200, r.text


def _forged_kv_register(room: int) -> bytes:
    """An encoded, made-up KVRegister for `room`: a forgery the prefill rank must drop."""
    pool = PoolDesc(4096, 64, 4, 0, 6, 128, "float32")
    return encode_message(
        KVRegister(
            room,
            0,
            ((0, 6, 0, 1),),
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


def _send_forged_kv_messages(durl: str, purl: str, room: int, n_ids: int) -> None:
    """Sends the decode rank forged statuses for `room` (unsigned and signed by a member that is
    not the room's peer) and a signed abort, and the prefill rank a forged registration (unsigned
    and signed)."""
    stranger = Sealer(KV_CHANNEL, "127.0.0.1:8/8", secret=SECRET)  # a member, not the room's peer
    fail = encode_message(KVStatus(room, 0, int(KVPoll.Failed), "forged", 0, 0, None))
    ok = encode_message(KVStatus(room, 0, int(KVPoll.Success), "", n_ids, 0, None))
    abort = encode_message(KVAbort(room, "prefill", 0, "forged"))
    reg = _forged_kv_register(room)
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


def _wait_kv_dropped(want: dict) -> None:
    """Waits until each node's rank 0 reports exactly the drop counters in `want`."""
    for url, w in want.items():  # stats arrive twice a second: wait for a fresh reading
        _wait(
            lambda url=url, w=w: _kv(url)["dropped"] == w,
            f"{url} to report {w} (has {_kv(url)['dropped']})",
            15,
        )


def test_forged_kv_control_messages_are_dropped_and_the_pd_request_completes_exactly(
    nodes, prompts, reference
):
    """A decode request is registered and waits for its KV; a foreign socket then tells the decode
    rank the room failed (or succeeded) and sends the prefill rank registrations for the room,
    unsigned and signed by a member that is not the room's peer. Then the prefill request runs. All
    forgeries are dropped and counted; the decode node answers exactly like transformers."""
    purl, durl, bport = nodes["prefill"], nodes["decode"], nodes["bport"]
    _wait(
        lambda: _kv(purl).get("ctrl_port") and _kv(durl).get("ctrl_port"),
        "both ranks' KV stats",
    )
    room, ids = 1234567, prompts[2]
    _register_bootstrap_server(durl, bport)
    with ThreadPoolExecutor(1) as ex:
        decode = ex.submit(
            httpx.post,
            f"{durl}/generate",
            json=body(ids, room, bport, MAX_NEW),
            timeout=120,
            auth=AUTH,
        )
        _wait(
            lambda: (_info(durl)["ranks"][0] or {}).get("held_pages", 0) > 0,
            "the decode rank to register the room",
        )
        _send_forged_kv_messages(durl, purl, room, len(ids))
        # Until the decode rank has read them all (or, were one taken for real, the room ended).
        _wait(
            lambda: sum(_kv(durl)["dropped"].values()) >= 5 or decode.done(),
            "the forgeries to be read",
        )
        p = HTTP.post(
            f"{purl}/generate",
            json=body(ids, room, bport, MAX_NEW),
            timeout=120,
            auth=AUTH,
        )
        d = decode.result(timeout=120)
    assert p.status_code == 200 and d.status_code == 200, (p.text, d.text)
    assert d.json()["token_ids"] == reference[2]
    _wait_kv_dropped(
        {
            durl: {"unauthenticated": 2, "foreign_peer": 3},
            purl: {"unauthenticated": 1, "foreign_peer": 1},
        }
    )


@pytest.mark.parametrize("kind", ["colocated", "prefill", "decode"])
def test_node_internal_endpoints_need_the_secret(nodes, kind):
    url = nodes[kind]
    gen = {
        "input_ids": [1, 2, 3],
        "bootstrap_room": 5,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": nodes["bport"],
        "sampling_params": {"max_tokens": 1},
    }
    for kw in REFUSED:
        r = HTTP.post(f"{url}/generate", json=gen, **kw, timeout=10)
        assert r.status_code == 401, (kind, kw, r.text)
        assert HTTP.post(f"{url}/abort", json={"rid": "x"}, **kw, timeout=10).status_code == 401
        assert HTTP.post(f"{url}/drain", json={}, **kw, timeout=10).status_code == 401
        assert HTTP.get(f"{url}/server_info", **kw, timeout=10).status_code == 401
        assert HTTP.get(f"{url}/debug/spans/x", **kw, timeout=10).status_code == 401
        for path, req in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert HTTP.post(f"{url}{path}", json=req, **kw, timeout=10).status_code == 401
    assert HTTP.get(f"{url}/server_info", auth=AUTH, timeout=10).json()["role"] == kind
    assert (
        HTTP.post(f"{url}/tokenize", json={"prompt": "a"}, auth=AUTH, timeout=10).json()["count"]
        >= 1
    )
    assert HTTP.post(f"{url}/abort", json={"rid": "x"}, auth=AUTH, timeout=10).status_code == 200
    bad = HTTP.post(f"{url}/drain", json={"grace_s": -1}, auth=AUTH, timeout=10)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grace_s", bad.text
    assert not HTTP.get(f"{url}/health", timeout=10).json()["draining"]  # a bad call drains nothing
    # open on purpose: load balancer probes and Prometheus scrapers
    assert HTTP.get(f"{url}/health", timeout=10).status_code == 200
    assert HTTP.get(f"{url}/metrics", timeout=10).status_code == 200


def test_bootstrap_server_needs_the_secret(nodes):
    base = f"http://127.0.0.1:{nodes['bport']}"
    fake = {
        "pp_rank": 0,
        "pp_size": 1,
        "layer_start": 0,
        "layer_end": 1,
        "host": "127.0.0.1",
        "ctrl_port": 9,
        "session_id": "evil:1",
        "page_size": 4,
        "token_bytes": 4,
        "dtype": "float32",
        "layout": "x",
    }
    for kw in REFUSED:
        assert HTTP.put(f"{base}/route", json=fake, **kw, timeout=10).status_code == 401
        assert (
            HTTP.get(
                f"{base}/route",
                params={"layer_start": 0, "layer_end": 1},
                **kw,
                timeout=10,
            ).status_code
            == 401
        )
        assert (
            HTTP.post(
                f"{base}/heartbeat",
                json={"session": "evil:1", "peers": []},
                **kw,
                timeout=10,
            ).status_code
            == 401
        )
    r = HTTP.get(f"{base}/route", params={"layer_start": 0, "layer_end": 1}, auth=AUTH, timeout=10)
    assert r.status_code == 200 and [x["session_id"] for x in r.json()["ranks"]] != ["evil:1"]
    assert HTTP.get(f"{base}/health", timeout=10).status_code == 200


def test_decode_allowlist_is_set_only_with_the_secret(nodes):
    url = nodes["decode"]
    for kw in REFUSED:
        r = HTTP.put(
            f"{url}/bootstrap_servers",
            json={"servers": ["10.0.0.1:1"]},
            **kw,
            timeout=10,
        )
        assert r.status_code == 401
    r = HTTP.put(f"{url}/bootstrap_servers", json={"servers": "x"}, auth=AUTH, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "servers"


def test_decode_contacts_no_foreign_bootstrap_address(nodes, hf):
    """Even with the secret, a /generate naming a bootstrap server the router did not register is
    refused, and nothing connects to that address; a registered one still works end to end."""
    prefill, decode, bport = nodes["prefill"], nodes["decode"], nodes["bport"]
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen(16)
        trap.setblocking(False)
        r = HTTP.put(
            f"{decode}/bootstrap_servers",
            json={"servers": [f"127.0.0.1:{bport}"]},
            auth=AUTH,
            timeout=10,
        )
        assert r.status_code == 200
        foreign = {**body([5, 6, 7, 8], 99, trap.getsockname()[1], 4), "rid": "foreign"}
        r = HTTP.post(f"{decode}/generate", json=foreign, auth=AUTH, timeout=30)
        assert r.status_code == 403 and r.json()["error"]["code"] == "unknown_bootstrap_server", (
            r.text
        )
        # A real request after it: the ranks have handled everything sent before it by the time it
        # ends.
        ids = [5, 6, 7, 8, 9, 10]
        want = hf_greedy(hf, [ids], 4)[0]
        b = body(ids, 1234, bport, 4)
        with httpx.Client(auth=AUTH, timeout=60) as c, ThreadPoolExecutor(2) as pool:
            fp = pool.submit(c.post, f"{prefill}/generate", json=b)
            fd = pool.submit(c.post, f"{decode}/generate", json=b)
            rp, rd = fp.result(), fd.result()
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200 and rd.json()["token_ids"] == want, rd.text
        with pytest.raises(BlockingIOError):
            trap.accept()


def test_oversized_body_is_refused_before_it_is_read(nodes):
    url = nodes["colocated"]
    with socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30) as s:
        signature = sign(signing_key(SECRET), "POST", b"/generate", "x", b"", time.time())
        s.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: "
            + signature.encode()
            + b"\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{"
        )
        answer = s.recv(4096)  # answered without the 100 MB ever being sent
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]

    def chunks():
        yield b'{"text": "'
        for _ in range(80):
            yield b"a" * 65536
        yield b'"}'

    r = HTTP.post(f"{url}/generate", content=chunks(), auth=AUTH, timeout=30)
    assert r.status_code == 413, r.text


def test_pending_cap_answers_503_with_retry_after(nodes):
    """Two decode requests whose KV never comes stay pending; the third is refused at once."""
    url, bport = nodes["decode"], nodes["bport"]
    r = HTTP.put(
        f"{url}/bootstrap_servers",
        json={"servers": [f"127.0.0.1:{bport}"]},
        auth=AUTH,
        timeout=10,
    )
    assert r.status_code == 200
    with ThreadPoolExecutor(2) as pool:
        held = [
            pool.submit(
                httpx.post,
                f"{url}/generate",
                json={**body([5, 6, 7], 500 + i, bport, 4), "rid": f"hold{i}"},
                auth=AUTH,
                timeout=120,
            )
            for i in range(2)
        ]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ranks = HTTP.get(f"{url}/server_info", auth=AUTH, timeout=10).json()["ranks"]
            if (
                ranks[0]
                and sum(ranks[0].get(q, 0) for q in ("prealloc", "transfer", "waiting")) == 2
            ):
                break
            time.sleep(0.2)
        r = HTTP.post(f"{url}/generate", json=body([5, 6, 7], 502, bport, 4), auth=AUTH, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "node_overloaded", r.text
        assert r.headers["retry-after"] == "1"
        for i in range(2):
            assert HTTP.post(
                f"{url}/abort", json={"rid": f"hold{i}"}, auth=AUTH, timeout=10
            ).json()["aborted"]
        assert all(f.result().status_code >= 400 for f in held)
