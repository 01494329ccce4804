"""Elastic nodes as real processes: `pdserve up --elastic` (a prefill node at PP 2 and a decode
node, both elastic) serves a steady load while the router turns the prefill node into a decode
node and back (POST /workers/role). No request fails, every answer is the same greedy text for
the same prompt, and the node's ranks flip together with the rank consensus checker on."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from cluster import NODE_ARGS, up
from metrics_scrape import counter

pytestmark = pytest.mark.elastic  # `make test-elastic`, a CI step of its own

PROMPTS = [f"Count to {n}:" for n in range(3, 9)]


def _complete(url: str, model: str, prompt: str) -> tuple[int, str]:
    r = httpx.post(
        f"{url}/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0},
        timeout=120,
    )
    return r.status_code, r.json()["choices"][0]["text"] if r.status_code == 200 else r.text


def test_elastic_prefill_node_becomes_decode_and_back_under_load(tiny_model, tmp_path):
    log = tmp_path / "up.log"
    # elastic nodes, the controller off: this test moves the node itself
    args = ["--elastic", "--prefill-pp", "2", "--router-args", "--elastic false"]
    args += ["--node-args", " ".join(NODE_ARGS)]
    with up(tiny_model, log, args, timeout=420) as (url, _proc, auth):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results: list[tuple[str, int, str]] = []
        stop = threading.Event()

        def load(i: int) -> None:
            k = i
            while not stop.is_set():
                prompt = PROMPTS[k % len(PROMPTS)]
                results.append((prompt, *_complete(url, model, prompt)))
                k += 1

        workers = httpx.get(f"{url}/workers", auth=auth).json()["workers"]
        prefill = next(w for w in workers if w["role"] == "prefill")
        decode = next(w for w in workers if w["role"] == "decode")
        assert prefill["elastic"] and decode["elastic"], workers
        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        try:
            time.sleep(2)
            flips = []
            for role in ("decode", "prefill"):
                r = httpx.post(
                    f"{url}/workers/role",
                    json={"url": prefill["url"], "role": role, "timeout_s": 300},
                    auth=auth,
                    timeout=320,
                )
                assert r.status_code == 200, r.text
                assert r.json()["worker"]["role"] == role
                flips.append(len(results))
                time.sleep(2)
            # the last decode node may not leave its role
            r = httpx.post(
                f"{url}/workers/role",
                json={"url": decode["url"], "role": "prefill"},
                auth=auth,
                timeout=30,
            )
            assert r.status_code == 409, r.text
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=150)
        failed = [x for x in results if x[1] != 200]
        assert not failed, failed[:5]
        # each flipped rank moved its threads to the cores `pdserve up` planned for its new role
        assert log.read_text().count("thread(s) moved to cores") >= 4, log.read_text()[-3000:]
        assert flips[0] > 0 and len(results) > flips[1], (flips, len(results))
        answers: dict[str, set[str]] = {}
        for prompt, _, text in results:
            answers.setdefault(prompt, set()).add(text)
        assert all(len(texts) == 1 for texts in answers.values()), answers
        info = httpx.get(f"{prefill['url']}/server_info", auth=auth).json()
        assert info["role"] == "prefill" and info["changing_to"] is None


def test_the_controller_moves_a_decode_node_to_prefill_when_prompts_queue(tiny_model, tmp_path):
    """`pdserve up --elastic` with 1 prefill and 2 decode nodes, and a prefill-wait target any
    queued prompt passes: the router's controller moves the least busy decode node to prefill,
    says so in GET /workers, the status page and its metrics, and no request fails. The last
    decode node stays."""
    log = tmp_path / "up.log"
    router = "--elastic-ttft-target-ms 1 --elastic-itl-target-ms 100000 "
    router += "--elastic-sustain 0.5 --elastic-dwell 1"
    args = ["--elastic", "--decode-nodes", "2", "--router-args", router]
    args += ["--node-args", " ".join(NODE_ARGS)]
    with up(tiny_model, log, args, timeout=420) as (url, _proc, auth):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        results: list[tuple[int, str]] = []
        stop = threading.Event()

        def load(i: int) -> None:
            k = i
            while not stop.is_set():
                results.append(_complete(url, model, PROMPTS[k % len(PROMPTS)] * 60))
                k += 1

        threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(6)]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 120
            while True:
                got = httpx.get(f"{url}/workers", auth=auth).json()
                moves = got["elastic"]["moves"]
                if moves or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            time.sleep(2)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=150)
        assert moves, got
        assert moves[0]["to"] == "prefill" and moves[0]["reason"] == "prefill_short", moves
        assert moves[0]["outcome"] == "done", moves
        assert len(moves) == 1, "the last decode node moved too"
        roles = sorted(w["role"] for w in httpx.get(f"{url}/workers", auth=auth).json()["workers"])
        assert roles == ["decode", "prefill", "prefill"], roles
        failed = [r for r in results if r[0] != 200]
        assert not failed and results, failed[:5]
        state = httpx.get(f"{url}/dashboard/state", auth=auth, timeout=30).json()
        assert state["router"]["elastic"]["moves"] == moves  # the status page shows it
        metrics = httpx.get(f"{url}/metrics").text
        labels = 'outcome="done",reason="prefill_short",to="prefill"'
        assert f"pdserve_router_role_flips_total{{{labels}}} 1.0" in metrics


def _stream(
    url: str, model: str, prompt: str, max_tokens: int, text: list[str] | None = None
) -> tuple[int, str]:
    """A greedy streamed completion that runs to `max_tokens`: (status, the text streamed).
    `text`, where given, receives each chunk as it arrives."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    text = [] if text is None else text
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                if "error" in event:
                    return 599, json.dumps(event["error"])
                text.append(event["choices"][0]["text"])
    return 200, "".join(text)


def test_a_decode_node_leaving_its_role_moves_its_streams_on(tiny_model, tmp_path):
    """1 prefill + 2 decode elastic nodes, the controller off. Long greedy streams run on both
    decode nodes when one of them is asked to become a prefill node with a grace of 0.5 s: past it,
    the streams it still holds move to the other decode node mid-stream (the router's migration,
    cause `node_draining`), so the flip does not wait for them to end, and every stream still ends
    200 with the text the same prompt gets undisturbed."""
    log = tmp_path / "up.log"
    args = ["--elastic", "--decode-nodes", "2", "--router-args", "--elastic false"]
    args += ["--node-args", " ".join(NODE_ARGS)]
    prompts = [f"Story {i}: once upon a time" for i in range(6)]
    with up(tiny_model, log, args, timeout=420) as (url, _proc, auth):
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        alone = {p: _stream(url, model, p, 1200) for p in prompts}
        assert all(status == 200 for status, _ in alone.values()), alone
        results: dict[str, tuple[int, str]] = {}
        streamed: dict[str, list[str]] = {p: [] for p in prompts}

        def run(p: str) -> None:
            results[p] = _stream(url, model, p, 1200, streamed[p])

        threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in prompts]
        for t in threads:
            t.start()
        try:
            deadline = time.monotonic() + 60
            while True:  # both decode nodes hold streams, and every stream has begun
                # a stream aborted before its first token is retried from the start, not moved:
                # only one past it shows the migration
                workers = httpx.get(f"{url}/workers", auth=auth).json()["workers"]
                decodes = [w for w in workers if w["role"] == "decode"]
                begun = all(len(chunks) >= 8 for chunks in streamed.values())
                if (begun and all(w["in_flight"] for w in decodes)) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            leaving = max(decodes, key=lambda w: (w["in_flight"], w["url"]))
            assert leaving["in_flight"] and begun, (
                workers,
                {p: len(c) for p, c in streamed.items()},
            )
            r = httpx.post(
                f"{url}/workers/role",
                json={"url": leaving["url"], "role": "prefill", "grace_s": 0.5, "timeout_s": 300},
                auth=auth,
                timeout=320,
            )
            assert r.status_code == 200 and r.json()["worker"]["role"] == "prefill", r.text
            unfinished = sum(t.is_alive() for t in threads)
        finally:
            for t in threads:
                t.join(timeout=300)
        assert unfinished, "every stream ended before the flip: nothing was moved"
        assert {p: got[0] for p, got in results.items()} == dict.fromkeys(prompts, 200), results
        assert all(results[p][1] == alone[p][1] for p in prompts), "a moved stream's text differs"
        moved = counter(url, "pdserve_router_migrations_total", cause="node_draining")
        assert moved >= 1, moved
