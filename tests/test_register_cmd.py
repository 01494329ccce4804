"""`pdserve register join|leave` (pdserve/register_cmd.py) against a real HTTP server on 127.0.0.1
that plays a router's worker list and a node's front, and checks each request's signature with the
cluster secret as the router and the nodes do (infra/request_signing.py `Verifier`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import pytest

from pdserve import register_cmd
from pdserve.cli import main
from pdserve.infra.request_signing import Verifier

SECRET = "test-secret-for-register"
WORKER = "http://prefill-3.pd-pdserve-prefill:30000"


class Fake:
    """One server on 127.0.0.1: the router's /workers and a node's /health and /drain. Refuses
    a request whose signature does not hold (401), as the real ones do."""

    def __init__(self, *, fail_first: int = 0, stop_on_drain: bool = True):
        self.workers: dict[str, dict] = {}
        self.calls: list[tuple[str, str]] = []  # (method, path), in arrival order
        self.draining = False
        self.fail_first = fail_first  # answer this many /workers requests 503 first
        self.stop_on_drain = stop_on_drain
        self.verifier = Verifier(SECRET)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _serve(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                why = fake.verifier.check(
                    self.headers.get("Authorization"),
                    self.command,
                    self.path.encode(),
                    self.headers.get("Host", ""),
                    body,
                )
                path = urlsplit(self.path).path
                fake.calls.append((self.command, path))
                if why:
                    return self._answer(401, {"error": {"message": why}})
                if path == "/workers" and fake.fail_first > 0:
                    fake.fail_first -= 1
                    return self._answer(503, {"error": {"message": "starting"}})
                self._route(path, json.loads(body) if body else {})

            def _route(self, path: str, body: dict) -> None:
                if (self.command, path) == ("GET", "/health"):
                    return self._answer(200, {"status": "ok", "draining": fake.draining})
                if (self.command, path) == ("POST", "/drain"):
                    fake.draining = True
                    if fake.stop_on_drain:  # the drain is over at once: the front stops
                        threading.Timer(0.2, fake.close).start()
                    return self._answer(200, {"draining": True, "pending": 0})
                if (self.command, path) == ("GET", "/workers"):
                    return self._answer(200, {"workers": list(fake.workers.values())})
                if (self.command, path) == ("POST", "/workers"):
                    if body["url"] in fake.workers:
                        return self._answer(409, {"error": {"message": "already registered"}})
                    fake.workers[body["url"]] = body
                    return self._answer(200, {"worker": body})
                if (self.command, path) == ("DELETE", "/workers"):
                    url = parse_qs(urlsplit(self.path).query)["url"][0]
                    if fake.workers.pop(url, None) is None:
                        return self._answer(404, {"error": {"message": "no such worker"}})
                    return self._answer(200, {"removed": {"url": url}})
                self._answer(404, {"error": {"message": "no route"}})

            do_GET = do_POST = do_DELETE = _serve

        return Handler


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", SECRET)
    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN_FILE", raising=False)
    monkeypatch.setenv(register_cmd.URL_ENV, WORKER)
    monkeypatch.delenv(register_cmd.REPLICA_ENV, raising=False)
    monkeypatch.setattr(register_cmd, "BACKOFF_S", 0.01)
    monkeypatch.setattr(register_cmd, "POLL_S", 0.05)
    f = Fake()
    yield f
    f.close()


def join(fake, *more: str) -> int:
    argv = ["register", "join", "--router", fake.url, "--node", fake.url, "--role", "prefill"]
    return main([*argv, "--bootstrap-port", "8998", "--wait", "5", "--timeout", "5", *more])


def test_join_registers_the_node_once_it_serves(fake):
    assert join(fake) == 0
    assert fake.workers == {WORKER: {"url": WORKER, "role": "prefill", "bootstrap_port": 8998}}
    assert fake.calls == [("GET", "/health"), ("GET", "/workers"), ("POST", "/workers")]
    fake.calls.clear()
    assert join(fake) == 0  # already on the list: looked at, not posted again
    assert fake.calls == [("GET", "/health"), ("GET", "/workers")]


def test_join_sends_the_nodes_ordinal_and_refuses_a_bad_one(fake, monkeypatch, capsys):
    """The chart sets $PDSERVE_REPLICA to the pod's ordinal; the router keeps a flipped node's
    ordinal inside its role's replica count (test_elastic_controller.py)."""
    monkeypatch.setenv(register_cmd.REPLICA_ENV, "2")
    assert join(fake) == 0
    assert fake.workers[WORKER] == {
        "url": WORKER,
        "role": "prefill",
        "bootstrap_port": 8998,
        "replica": 2,
    }
    fake.workers.clear()
    fake.calls.clear()
    for bad in ("-1", "²", "100000"):
        monkeypatch.setenv(register_cmd.REPLICA_ENV, bad)
        assert join(fake) == 2 and "PDSERVE_REPLICA" in capsys.readouterr().err
    assert fake.calls == [] and not fake.workers


def test_join_retries_a_router_that_is_not_up_yet(fake):
    fake.fail_first = 2
    assert join(fake) == 0 and WORKER in fake.workers
    assert fake.calls.count(("GET", "/workers")) == 3


def test_join_gives_up_on_a_router_that_never_answers(fake):
    fake.fail_first = 99
    assert join(fake) == 1 and not fake.workers
    assert fake.calls.count(("GET", "/workers")) == register_cmd.ATTEMPTS


def test_join_waits_for_a_draining_node_no_longer_than_told(fake):
    fake.draining = True
    assert join(fake, "--wait", "0.3") == 1
    assert not fake.workers and ("GET", "/workers") not in fake.calls


def test_a_wrong_secret_is_refused_and_not_retried(fake, monkeypatch):
    monkeypatch.setenv("PDSERVE_INTERNAL_TOKEN", "another-secret")
    assert join(fake, "--wait", "0.3") == 1  # /health is signed too: refused, never serving
    fake.verifier = Verifier("another-secret")  # the node takes it; the router does not
    router = Fake()
    try:
        argv = ["register", "join", "--router", router.url, "--node", fake.url, "--role", "decode"]
        assert main([*argv, "--wait", "2"]) == 1
        assert router.calls == [("GET", "/workers")] and not router.workers
    finally:
        router.close()


def test_leave_removes_the_node_before_it_drains(fake):
    fake.workers[WORKER] = {"url": WORKER, "role": "decode"}
    argv = ["register", "leave", "--router", fake.url, "--node", fake.url, "--deadline", "10"]
    assert main(argv) == 0
    assert not fake.workers and fake.draining
    assert fake.calls[:2] == [("DELETE", "/workers"), ("POST", "/drain")]


def test_leave_holds_until_the_deadline_while_the_node_drains(fake):
    fake.stop_on_drain = False
    argv = ["register", "leave", "--router", fake.url, "--node", fake.url, "--deadline", "0.5"]
    assert main(argv) == 0  # not on the list (404) is fine; the node still drains at the end
    assert fake.calls[:2] == [("DELETE", "/workers"), ("POST", "/drain")]
    assert fake.calls.count(("GET", "/health")) >= 2


def test_the_url_is_required(fake, monkeypatch, capsys):
    monkeypatch.delenv(register_cmd.URL_ENV)
    argv = ["register", "leave", "--router", fake.url, "--node", fake.url]
    assert main(argv) == 2 and "PDSERVE_WORKER_URL" in capsys.readouterr().err
    assert fake.calls == []


def test_every_address_of_the_router_host_is_one_router():
    urls = register_cmd.router_urls("http://localhost:8000/")
    assert urls and all(u.endswith(":8000") for u in urls)
    assert {u.split("//")[1].rsplit(":", 1)[0] for u in urls} <= {"127.0.0.1", "[::1]"}
    assert register_cmd.router_urls("http://10.1.2.3:8000") == ["http://10.1.2.3:8000"]
    assert register_cmd.router_urls("https://router:8443") == ["https://router:8443"]


def test_join_keeps_every_router_listing_the_node_until_sigterm(fake):
    """The chart's sidecar: a router that lost the node (restarted) gets it back at the next look;
    SIGTERM ends it at once although it is its container's PID 1 (which ignores a SIGTERM it has
    no handler for)."""
    argv = [sys.executable, "-m", "pdserve.cli", "register", "join", "--router", fake.url]
    argv += ["--node", fake.url, "--role", "decode", "--wait", "20", "--every", "0.2"]
    proc = subprocess.Popen(argv, env=os.environ, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while WORKER not in fake.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert WORKER in fake.workers
        del fake.workers[WORKER]  # the router restarted: its list is empty
        while WORKER not in fake.workers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert WORKER in fake.workers and fake.calls.count(("POST", "/workers")) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
