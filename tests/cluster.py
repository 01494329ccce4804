"""Starting real pdserve processes from tests, and always stopping them (no orphans)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from infra.procs import free_port  # noqa: F401  (re-exported for the tests)

ROOT = Path(__file__).resolve().parents[1]


def kill_group(p: subprocess.Popen, grace: float = 8.0) -> None:
    """SIGTERM the process group (front + ranks), then SIGKILL whatever is left; reap the leader."""
    if p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, signal.SIGTERM)
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        p.wait(timeout=5)


def group_alive(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Processes of the group still running (zombies do not count), after waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        out = subprocess.run(
            ["ps", "-o", "pid=,stat=", "-g", str(pgid)], capture_output=True, text=True
        ).stdout
        alive = [
            int(pid)
            for pid, stat in (ln.split() for ln in out.splitlines() if ln.strip())
            if "Z" not in stat
        ]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def wait_healthy(
    url: str, proc: subprocess.Popen, timeout: float = 120.0, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"{url} exited with {proc.returncode} before it was healthy:\n"
                + (log.read_text()[-4000:] if log else "")
            )
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(
        f"{url} not healthy after {timeout:.0f} s:\n" + (log.read_text()[-4000:] if log else "")
    )


@contextlib.contextmanager
def start(
    cmd: list[str],
    port: int,
    log_path: Path,
    env: dict | None = None,
    timeout: float = 120.0,
    wait: bool = True,
):
    """Runs `pdserve <cmd>` in its own process group; yields (url, Popen); stops the whole group."""
    e = dict(os.environ, **(env or {}))
    e.setdefault("PDSERVE_LOG_LEVEL", "INFO")
    with open(log_path, "wb") as logf:
        p = subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *cmd],
            cwd=ROOT,
            env=e,
            stdout=logf,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, p, timeout, log_path)
        yield url, p
    finally:
        kill_group(p)


@contextlib.contextmanager
def up(model: Path, log_path: Path, args: list[str], timeout: float = 240.0):
    """`pdserve up --model MODEL --port P ARGS` in its own process group, logging to `log_path`;
    waits for its ready line, yields (url, Popen, the cluster secret's headers), stops the group."""
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve.cli", "up", "--model", str(model), "--port", str(port)]
    with open(log_path, "wb") as f:
        proc = subprocess.Popen(
            cmd + args, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + timeout
        while "[up] ready" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}", proc, secret_headers(log_path)
    finally:
        kill_group(proc, grace=20)


def secret_headers(log_path: Path) -> dict[str, str]:
    """`pdserve up` generated the cluster secret and printed the 0600 file it is in."""
    path = re.search(r"cluster secret .* in (\S+)", log_path.read_text()).group(1)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        return {"Authorization": f"Bearer {f.read().strip()}"}
