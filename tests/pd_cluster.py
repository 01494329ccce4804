"""A prefill node and a decode node as real processes, and a client that plays the router's part."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from pathlib import Path

import httpx
from cluster import NODE_ARGS, held_port, start, wait_healthy

FAST_TIMEOUTS = {
    "PDSERVE_KV_BOOTSTRAP_TIMEOUT_S": "8",
    "PDSERVE_KV_WAITING_TIMEOUT_S": "8",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "8",
    "PDSERVE_KV_QUARANTINE_S": "10",
    "PDSERVE_RANK_CONSENSUS_CHECK": "1",
}


@contextlib.contextmanager
def pd_and_colocated(tmp: Path, pd_args: list[str], colocated_args: list[str]):
    """A PD pair (`pd_args`: model and engine flags of both), a colocated node and a router in
    front of the three, all processes; yields (router URL, {role: node URL})."""
    with contextlib.ExitStack() as holds, contextlib.ExitStack() as stack:
        pport, bport, dport, cport, rport = (held_port(holds) for _ in range(5))
        nodes = {
            "prefill": (["prefill", "--port", str(pport), "--bootstrap-port", str(bport)], pd_args),
            "decode": (["decode", "--port", str(dport)], pd_args),
            "colocated": (["serve", "--port", str(cport)], colocated_args),
        }
        ports = {"prefill": pport, "decode": dport, "colocated": cport}
        procs = {
            name: stack.enter_context(
                start(cmd + args, ports[name], tmp / f"{name}.log", env=FAST_TIMEOUTS, wait=False)
            )
            for name, (cmd, args) in nodes.items()
        }
        for name, (url, proc) in procs.items():
            wait_healthy(url, proc, 240, tmp / f"{name}.log")
        urls = {name: url for name, (url, _) in procs.items()}
        cmd = ["router", "--port", str(rport), "--prefill", urls["prefill"], str(bport)]
        cmd += ["--decode", urls["decode"], "--worker", urls["colocated"], "--health-interval", "1"]
        url, _ = stack.enter_context(start(cmd, rport, tmp / "router.log"))
        yield url, urls


def _prefill_cmd(model, pp: int, port: int, bport: int, extra=()) -> list[str]:
    return [
        "prefill",
        "--model",
        str(model),
        "--pp",
        str(pp),
        "--port",
        str(port),
        "--bootstrap-port",
        str(bport),
        *NODE_ARGS,
        *extra,
    ]


def _decode_cmd(model, pp: int, port: int, extra=()) -> list[str]:
    return [
        "decode",
        "--model",
        str(model),
        "--pp",
        str(pp),
        "--port",
        str(port),
        *NODE_ARGS,
        *extra,
    ]


@contextlib.contextmanager
def prefill_node(model, pp: int, tmp: Path, extra=(), env=None, name="prefill", wait=True):
    """A prefill node; yields (url, bootstrap port, Popen). `wait=False`: yields as soon as the
    process is started (then `wait_healthy(url, proc, ...)` before using it)."""
    with contextlib.ExitStack() as holds:
        port, bport = held_port(holds), held_port(holds)
        cmd = _prefill_cmd(model, pp, port, bport, extra)
        env = {**FAST_TIMEOUTS, **(env or {})}
        with start(cmd, port, tmp / f"{name}.log", env=env, wait=wait) as (url, proc):
            yield url, bport, proc


@contextlib.contextmanager
def decode_node(model, pp: int, tmp: Path, extra=(), env=None, name="decode", wait=True):
    """A decode node; yields (url, Popen). `wait`: as in `prefill_node`."""
    with contextlib.ExitStack() as holds:
        port = held_port(holds)
        cmd = _decode_cmd(model, pp, port, extra)
        env = {**FAST_TIMEOUTS, **(env or {})}
        with start(cmd, port, tmp / f"{name}.log", env=env, wait=wait) as (url, proc):
            yield url, proc


@contextlib.contextmanager
def pd_pair(model, ppp: int, dpp: int, tmp: Path, extra=(), env=None, names=("prefill", "decode")):
    """A prefill node (PP `ppp`) and a decode node (PP `dpp`) started at once rather than one after
    the other (what `prefill_node` and `decode_node` nested would do), both with `extra` flags and
    `env`; yields ((url, bootstrap port, Popen) of the prefill node, (url, Popen) of the decode
    node). Logs: tmp/<name>.log."""
    with contextlib.ExitStack() as stack:
        p = stack.enter_context(prefill_node(model, ppp, tmp, extra, env, names[0], wait=False))
        d = stack.enter_context(decode_node(model, dpp, tmp, extra, env, names[1], wait=False))
        wait_healthy(p[0], p[2], 240, tmp / f"{names[0]}.log")
        wait_healthy(d[0], d[1], 240, tmp / f"{names[1]}.log")
        yield p, d


def body(ids, room, bport, max_new, stream=False):
    return {
        "input_ids": ids,
        "bootstrap_room": room,
        "bootstrap_host": "127.0.0.1",
        "bootstrap_port": bport,
        "stream": stream,
        "sampling_params": {"max_tokens": max_new, "ignore_eos": True},
    }


def allow_bootstrap(durl: str, *bports: int) -> None:
    """What the router does when it registers prefill nodes: tell the decode node their bootstrap
    servers, the only ones it may contact."""
    r = httpx.put(
        f"{durl}/bootstrap_servers",
        json={"servers": [f"127.0.0.1:{b}" for b in bports]},
        timeout=10,
    )
    assert r.status_code == 200, r.text


async def pd_generate(
    client: httpx.AsyncClient,
    purl: str,
    durl: str,
    bport: int,
    ids,
    max_new: int,
    room: int | None = None,
    share: dict | None = None,
) -> tuple[dict, dict]:
    """What the router does: the same request to both nodes at once; returns
    (prefill, decode) JSON. `share`: its tenant fields (`tenant`, `tenant_weight`, `priority`)."""
    r = await client.put(f"{durl}/bootstrap_servers", json={"servers": [f"127.0.0.1:{bport}"]})
    assert r.status_code == 200, r.text
    room = room if room is not None else random.getrandbits(63)
    b = {**body(ids, room, bport, max_new), **(share or {})}
    p, d = await asyncio.gather(
        client.post(f"{purl}/generate", json=b), client.post(f"{durl}/generate", json=b)
    )
    return p.json(), d.json()


def pd_generate_all(purl, durl, bport, prompts, max_new, shares=()) -> list[list[int]]:
    """Every prompt at once; `shares`: tenant fields given to the prompts in turn."""

    async def run():
        async with httpx.AsyncClient(timeout=120) as c:
            res = await asyncio.gather(
                *(
                    pd_generate(
                        c,
                        purl,
                        durl,
                        bport,
                        ids,
                        max_new,
                        share=shares[i % len(shares)] if shares else None,
                    )
                    for i, ids in enumerate(prompts)
                )
            )
        for p, d in res:
            assert "error" not in p, p
            assert "error" not in d, d
        return [d["token_ids"] for _, d in res]

    return asyncio.run(run())


def held_pages(url: str) -> list[int]:
    return [s["held_pages"] for s in httpx.get(f"{url}/server_info", timeout=10).json()["ranks"]]


def wait_pages_free(*urls: str, timeout: float = 30.0) -> dict[str, list[int]]:
    """Polls until every rank of every node holds no pages; returns the last reading."""
    deadline = time.monotonic() + timeout
    while True:
        got = {u: held_pages(u) for u in urls}
        if all(not any(v) for v in got.values()) or time.monotonic() > deadline:
            return got
        time.sleep(0.5)


def sse_tokens(lines: list[str]) -> list[int]:
    out = []
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            out.extend(json.loads(line[6:]).get("token_ids", []))
    return out
