"""Logging (infra/logs.py): JSON lines with rid and trace_id, quiet third-party loggers below DEBUG,
Mooncake's start-up lines re-logged at their level (or DEBUG when known harmless), and a real
`pdserve router --log-format json` writing nothing but JSON objects, its request lines with a
rid."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from cluster import ROOT, free_port
from stub_node import StubNode

from pdserve.infra.logs import JsonFormatter, bind_request, native_log, setup_logging


def _record(msg: str, **extra) -> logging.LogRecord:
    rec = logging.LogRecord("pdserve.test", logging.WARNING, __file__, 1, msg, (), None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_the_request_in_scope():
    fmt = JsonFormatter("router")
    line = json.loads(fmt.format(_record("no request")))
    assert line["proc"] == "router" and line["level"] == "WARNING" and line["msg"] == "no request"
    assert line["rid"] is None and line["trace_id"] is None and line["ts"].endswith("Z")
    assert json.loads(fmt.format(_record("given", rid="r-1")))["rid"] == "r-1"

    async def in_task(rid: str) -> str:
        bind_request(rid)
        await asyncio.sleep(0)
        return fmt.format(_record("in a task"))

    async def both() -> list[str]:
        return await asyncio.gather(in_task("a"), in_task("b"))

    assert [json.loads(x)["rid"] for x in asyncio.run(both())] == ["a", "b"]
    assert json.loads(fmt.format(_record("outside")))["rid"] is None  # tasks kept their own
    try:
        raise ValueError("boom")
    except ValueError:
        rec = _record("failed")
        rec.exc_info = sys.exc_info()
    assert "ValueError: boom" in json.loads(fmt.format(rec))["exc"]


@pytest.fixture
def restore_logging():
    # setup_logging exports the level and format for its children: put the environment back, or
    # every process a later test starts would log at this test's level (DEBUG: probe lines).
    env = dict(os.environ)
    for var in ("PDSERVE_LOG_LEVEL", "PDSERVE_LOG_FORMAT", "MC_LOG_LEVEL", "GLOG_minloglevel"):
        os.environ.pop(var, None)
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    os.environ.clear()
    os.environ.update(env)
    root.handlers[:] = handlers
    root.setLevel(level)
    for name in ("httpx", "httpcore", "uvicorn.access", "uvicorn.error"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    logging.captureWarnings(False)


def test_setup_logging_quiets_probes_and_access_lines_unless_debug(restore_logging):
    setup_logging("[t]", "info", "json")
    assert os.environ["PDSERVE_LOG_LEVEL"] == "INFO" and os.environ["PDSERVE_LOG_FORMAT"] == "json"
    assert os.environ["MC_LOG_LEVEL"] == "WARNING"  # Mooncake reads it when it loads
    for name in ("httpx", "uvicorn.access", "uvicorn.error"):
        assert not logging.getLogger(name).isEnabledFor(logging.INFO), name
    setup_logging("[t]", "debug", "text")
    for name in ("httpx", "uvicorn.access"):
        assert logging.getLogger(name).isEnabledFor(logging.INFO), name
    with pytest.raises(ValueError, match="log format"):
        setup_logging("[t]", "info", "xml")


def test_native_log_relogs_glog_lines_at_their_level(caplog, capfd):
    logger = logging.getLogger("mooncake-test")
    quiet = ("Local segment descriptor not found",)
    with caplog.at_level(logging.DEBUG, logger="mooncake-test"), native_log(logger, quiet):
        os.write(2, b"WARNING: Logging before InitGoogleLogging() is written to STDERR\n")
        os.write(2, b"E1201 04:53:40.013348  1197 transfer_metadata.cpp:1098] Local segment ")
        os.write(2, b"descriptor not found\n")
        os.write(2, b"W1201 04:53:40.012912  1197 topology.cpp:201] No RDMA devices found\n")
        os.write(2, b"a line of some other kind\n")
    got = [(r.levelname, r.getMessage()) for r in caplog.records]
    assert got == [
        ("DEBUG", "WARNING: Logging before InitGoogleLogging() is written to STDERR"),
        ("DEBUG", "transfer_metadata.cpp:1098] Local segment descriptor not found"),
        ("WARNING", "topology.cpp:201] No RDMA devices found"),
    ]
    assert "a line of some other kind" in capfd.readouterr().err


def test_router_writes_only_json_lines_with_the_rid_of_each_request(tmp_path):
    prefill, decode = StubNode(role="prefill", bootstrap_port=8998), StubNode(role="decode")
    port, log = free_port(), tmp_path / "router.log"
    cmd = [sys.executable, "-m", "pdserve.cli", "router", "--port", str(port)]
    cmd += ["--prefill", prefill.url, "8998", "--decode", decode.url, "--health-interval", "0.5"]
    cmd += ["--log-format", "json", "--log-level", "debug"]
    # the short prompt below takes the PD pair
    cmd += ["--disagg-min-prompt-tokens", "0", "--disagg-local-prefill-cost", "0"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        body = {"model": "stub-model", "messages": [{"role": "user", "content": "a b"}]}
        r = httpx.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 2}, timeout=30)
        assert r.status_code == 200, r.text
        time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        prefill.stop()
        decode.stop()
    lines = [json.loads(ln) for ln in log.read_text().splitlines()]  # every line is one object
    assert all(ln["proc"] == "router" and "rid" in ln and "trace_id" in ln for ln in lines)
    assert any(ln["msg"].startswith("router ready") for ln in lines)
    posts = [ln for ln in lines if "POST" in ln["msg"] and "/generate" in ln["msg"]]
    assert len(posts) == 2 and posts[0]["rid"] and posts[0]["rid"] == posts[1]["rid"], posts
