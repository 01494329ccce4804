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

from pdserve.infra.procs import free_port, reserve_port
from pdserve.infra.request_signing import SignedAuth

ROOT = Path(__file__).resolve().parents[1]


def held_port(holds: contextlib.ExitStack) -> int:
    """A port for a server that binds it later, held (reserve_port) until `holds` closes. The
    servers bind with SO_REUSEADDR (uvicorn, the bootstrap), so they still can, while no other
    process's free_port takes it in the minutes before they do, or between a node's restarts on
    it (seen: a router's port taken while its three nodes loaded, EADDRINUSE)."""
    return holds.enter_context(reserve_port()).getsockname()[1]


# The node flags the tests use (in this order): a small pool and small batches, so that chunked
# prefill, queueing and page reuse all happen with a few short prompts.
_NODE_FLAGS = {
    "page_size": 4,
    "chunk_size": 16,
    "max_batch_tokens": 64,
    "max_total_tokens": 8192,
    "max_running": 32,
    "threads": 1,
    # A node's first structured-output guide compiles on a low-priority thread (importing
    # xgrammar first); on a 2-core machine that the suite keeps busy, 10 s (the default) is not
    # always enough, and a guide past it is refused for good (runtime/front/guide_gate.py).
    "grammar_compile_timeout": 120,
}


def node_args(**overrides: int | None) -> list[str]:
    """The tests' node flags; a keyword sets one (`chunk_size=32`), None leaves it out (the node's
    default then applies)."""
    flags = {**_NODE_FLAGS, **overrides}
    return [
        a for k, v in flags.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))
    ]


NODE_ARGS = node_args()
NODE_ZYGOTE = None  # conftest.py node_zygote: forks the processes `start` runs


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


def group_members(pgid: int) -> list[tuple[int, str, str]]:
    """(pid, stat, comm) of the processes whose process group is `pgid`. Not `ps -g`: that
    selects by session, and the nodes the tests start are groups inside the test's session."""
    out = subprocess.run(
        ["ps", "-e", "-o", "pid=,pgid=,stat=,comm="], capture_output=True, text=True
    )
    rows = (ln.split(None, 3) for ln in out.stdout.splitlines() if ln.strip())
    return [(int(pid), stat, comm) for pid, pg, stat, comm in rows if int(pg) == pgid]


def group_alive(pgid: int, wait_s: float = 10.0) -> list[int]:
    """Processes of the group still running (zombies do not count), after waiting up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = [pid for pid, stat, _ in group_members(pgid) if "Z" not in stat]
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
            r = httpx.get(f"{url}/health", timeout=2)
        except httpx.HTTPError:
            r = None
        if r is not None and r.status_code == 200:
            return
        if r is not None and r.status_code == 503 and _dead(r):  # it will never be healthy
            raise RuntimeError(
                f"{url} is dead before it was healthy: {r.text}\n"
                + (log.read_text()[-4000:] if log else "")
            )
        time.sleep(0.3)
    raise TimeoutError(
        f"{url} not healthy after {timeout:.0f} s:\n" + (log.read_text()[-4000:] if log else "")
    )


def _dead(r: httpx.Response) -> bool:
    try:
        body = r.json()
    except ValueError:
        return False
    return isinstance(body, dict) and body.get("dead") is True


@contextlib.contextmanager
def start(
    cmd: list[str],
    port: int,
    log_path: Path,
    env: dict | None = None,
    timeout: float = 240.0,
    wait: bool = True,
):
    """Runs `pdserve <cmd>` in its own process group; yields (url, Popen); stops the whole group.
    `timeout` bounds the start, it checks no speed: a fresh-clone CI run on a busy 2-core machine
    once took more than 120 s to start a PP 2 node that starts in seconds alone.
    The group, not a session: the ranks that the test session's rank zygote (conftest.py) forks
    for the node join it, so stopping the group stops them too."""
    e = dict(os.environ, **(env or {}))
    e.setdefault("PDSERVE_LOG_LEVEL", "INFO")
    with open(log_path, "wb") as logf:
        if NODE_ZYGOTE is not None:  # forked, as `python -m pdserve.cli` would run (conftest.py)
            p = NODE_ZYGOTE.fork(
                "pdserve.cli",
                cmd,
                env=e,
                cwd=str(ROOT),
                output=(logf.fileno(), logf.fileno()),
                new_group=True,
            )
        else:
            p = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", *cmd],
                cwd=ROOT,
                env=e,
                stdout=logf,
                stderr=subprocess.STDOUT,
                process_group=0,
            )
    url = f"http://127.0.0.1:{port}"
    try:
        if wait:
            wait_healthy(url, p, timeout, log_path)
        yield url, p
    finally:
        kill_group(p)


class Launch:
    """One `pdserve up <args>` process in its own process group (its output in `log`), started
    without waiting for it, so that a test file can start two clusters (or a cluster and its
    transformers reference) at once and wait for each when a test needs it."""

    def __init__(self, args: list[str], log: Path, env: dict | None = None, preexec_fn=None):
        self.log = log
        with open(log, "wb") as logf:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve.cli", "up", *args],
                cwd=ROOT,
                env=env,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=preexec_fn,
            )

    def ready(self, timeout: float = 240.0) -> subprocess.Popen:
        """Waits until the log says `[up] ready` (within `timeout` seconds); returns the Popen."""
        deadline = time.monotonic() + timeout
        while "[up] ready" not in self.log.read_text():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, self.log.read_text()[-3000:]
            time.sleep(0.2)
        return self.proc

    def stop(self) -> None:
        kill_group(self.proc, grace=20)


@contextlib.contextmanager
def launched(args: list[str], log: Path, env: dict | None = None, preexec_fn=None):
    """A `Launch`, stopped (its whole process group) on the way out."""
    launch = Launch(args, log, env, preexec_fn)
    try:
        yield launch
    finally:
        launch.stop()


@contextlib.contextmanager
def pdserve_up(
    args: list[str], log_path: Path, timeout: float, env: dict | None = None, preexec_fn=None
):
    """Runs `pdserve up <args>` (`env`: its whole environment, default this one's); yields the
    Popen once it is ready, within `timeout` seconds, and always stops the whole group."""
    with launched(args, log_path, env, preexec_fn) as launch:
        yield launch.ready(timeout)


@contextlib.contextmanager
def up(model: Path, log_path: Path, args: list[str], timeout: float = 240.0):
    """`pdserve up --model MODEL --port P ARGS` (pdserve_up): yields (url, Popen, the cluster
    secret's signing auth)."""
    port = free_port()
    with pdserve_up(["--model", str(model), "--port", str(port), *args], log_path, timeout) as p:
        yield f"http://127.0.0.1:{port}", p, secret_auth(log_path)


def secret_of(log_path: Path) -> str:
    """`pdserve up` generated the cluster secret and printed the 0600 file it is in."""
    path = re.search(r"cluster secret .* in (\S+)", log_path.read_text()).group(1)
    assert os.stat(path).st_mode & 0o777 == 0o600
    with open(path) as f:
        return f.read().strip()


class ClusterAuth(httpx.Auth):
    """Signs a test's internal calls with the cluster secret (infra/request_signing.py), as the
    cluster's own processes do; `secret` may be set once the cluster is up."""

    requires_request_body = True

    def __init__(self, secret: str | None = None):
        self.secret = secret

    def auth_flow(self, request):
        assert self.secret, "the cluster secret is not known yet"
        yield from SignedAuth(self.secret).auth_flow(request)


def secret_auth(log_path: Path) -> ClusterAuth:
    return ClusterAuth(secret_of(log_path))


def _threads(pid: int):
    """(nice, cores) of each thread of process `pid`."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out.append((int(fields[16]), os.sched_getaffinity(int(tid))))
        except OSError:  # the thread ended meanwhile
            continue
    return out


def helper_threads(pid: int, cores) -> int:
    """How many threads of `pid` run at nice 19 on exactly `cores`: a rank's prefill helper
    (engine/kernels/spare_core.py)."""
    return sum(1 for nice, on in _threads(pid) if nice == 19 and on == set(cores))
