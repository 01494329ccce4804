"""A warm parent for rank processes (a zygote): it imports the rank modules once (torch alone is
about 3 s of CPU per process on a small host), then forks one process per request. A node's N
ranks, or all the ranks `pdserve up` starts, then cost one import instead of N.

Server: `python -m infra.zygote --socket PATH MODULE...` listens on a Unix socket, in a 0700
directory, before it imports, so clients can queue requests while it loads. It accepts peers of
its own uid only (SO_PEERCRED), forks only into the modules it preloaded, and forks from one
thread (it starts none). A child takes the requester's environment, working directory, stdout,
stderr (passed as file descriptors), CPU affinity and process group (where the session allows
it), and runs `MODULE.main(argv)`. It dies with its requester (a pidfd watched by a thread) and
with the zygote (the rank's own parent-death signal).

Client: `Zygote.fork()` returns a `ZygoteChild`, the part of `subprocess.Popen` that
`infra.procs.stop_processes` and a watch loop use. The zygote reports the child's exit code on
the request's connection. PDSERVE_RANK_ZYGOTE names a shared zygote (one per `pdserve up`, one
per test worker); without it a node starts its own.

The wire is JSON, never pickle: {"module", "argv", "env", "cwd"} with fds [stdout, stderr], then
{"pid": n} and later {"exit": code}, or {"error": why}."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from infra.procs import PARENT_PID_ENV, die_with_parent

log = logging.getLogger(__name__)

ENV = "PDSERVE_RANK_ZYGOTE"
MAX_MESSAGE = 1 << 20  # a request: the environment plus a rank spec, a few KiB in practice
REQUEST_TIMEOUT_S = 10.0  # a queued request is complete when accepted; this bounds a slow peer
START_TIMEOUT_S = 300.0  # a client's wait for its pid: the zygote may still be importing


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def _send(sock: socket.socket, msg: dict) -> None:
    with contextlib.suppress(OSError):  # a requester that died: its child dies with it
        sock.send(json.dumps(msg).encode())


# --- the server ----------------------------------------------------------------------------------


class ZygoteServer:
    def __init__(self, path: str, modules: list[str]):
        self.modules = set(modules)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.listener.bind(path)
        self.listener.listen(64)
        self.path = path
        self.children: dict[int, socket.socket] = {}  # pid -> its requester's connection
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self.stopping = False

    def preload(self) -> None:
        # Forking a threaded process copies locks held by threads that do not exist in the child.
        # numpy's OpenBLAS starts a thread server at import unless it is told to use one thread
        # (the ranks compute with torch; OpenBLAS reads this once, here).
        os.environ["OPENBLAS_NUM_THREADS"] = "1"
        for m in sorted(self.modules):
            # ZYGOTE_PRELOAD: what the module imports lazily, later, in every child
            for extra in getattr(importlib.import_module(m), "ZYGOTE_PRELOAD", ()):
                importlib.import_module(extra)
        threads = len(os.listdir("/proc/self/task"))
        if threads != 1:
            log.warning("rank zygote: %d threads after its imports: unsafe to fork", threads)

    def run(self) -> None:
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes select through the wakeup fd
        signal.signal(signal.SIGTERM, self._on_term)
        # Ctrl-C reaches the whole group: the nodes stop their ranks, then whoever started this
        # zygote stops it (a zygote that died first would take the ranks with it, ungracefully)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        while not self.stopping:
            ready, _, _ = select.select([self.listener, self._wake_r], [], [], 5.0)
            if self._wake_r in ready:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 4096)
            if self.listener in ready and not self.stopping:
                conn, _ = self.listener.accept()
                self._serve(conn)
            self._reap()
        self._stop_children()

    def _on_term(self, *_) -> None:
        self.stopping = True

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            node_pid, uid = peer_pid_uid(conn)
            if uid != os.getuid():
                raise ValueError(f"peer uid {uid} is not this zygote's")
            msg, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 2)
            if flags & socket.MSG_TRUNC or len(fds) != 2:
                raise ValueError("request truncated, or without its stdout and stderr")
            req = json.loads(msg)
            if req.get("module") not in self.modules:
                raise ValueError(f"module {req.get('module')!r} is not preloaded here")
            pidfd = os.pidfd_open(node_pid)  # before the fork: the requester is alive now
            pgid = os.getpgid(node_pid)
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self._child(conn, req, fds, node_pid, pidfd)  # never returns
        # the child joins its requester's process group (stopping the group stops it) before the
        # requester learns its pid; a requester in another session keeps it in this one
        with contextlib.suppress(OSError):
            os.setpgid(pid, pgid)
        os.close(pidfd)
        for fd in fds:
            os.close(fd)
        self.children[pid] = conn
        _send(conn, {"pid": pid})

    def _child(self, conn, req: dict, fds: list[int], node_pid: int, pidfd: int) -> None:
        code = 1
        try:
            self._become_child(conn, req, fds, node_pid, pidfd)
            code = importlib.import_module(req["module"]).main(req["argv"])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
        finally:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)

    def _become_child(self, conn, req, fds, node_pid: int, pidfd: int) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s in (self.listener, conn, *self.children.values()):
            s.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, os.sched_getaffinity(node_pid))
        devnull = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(src, dst)
            os.close(src)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        os.environ[PARENT_PID_ENV] = str(os.getppid())  # the rank's die_with_parent: this zygote
        sys.argv = [req["module"], *req["argv"]]
        threading.Thread(
            target=_die_with, args=(pidfd,), name="requester-watch", daemon=True
        ).start()

    def _reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()

    def _stop_children(self) -> None:
        """SIGTERM, 5 s, SIGKILL: what a node does with its ranks, for any it did not stop."""
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        for _ in range(50):
            self._reap()
            if not self.children:
                break
            select.select([self._wake_r], [], [], 0.1)
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _die_with(pidfd: int) -> None:
    """A forked rank's requester (its node) exited: so does the rank, as a spawned one would."""
    select.select([pidfd], [], [])
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="fork rank processes from one warm parent")
    ap.add_argument("--socket", required=True, help="Unix socket path, in a 0700 directory")
    ap.add_argument("modules", nargs="+", help="the modules to preload and fork into")
    a = ap.parse_args(argv)
    die_with_parent()  # its starter (a node, `pdserve up`, a test session)
    server = ZygoteServer(a.socket, a.modules)
    server.preload()
    server.run()
    return 0


# --- the client ----------------------------------------------------------------------------------


class ZygoteChild:
    """A process forked for this one by a zygote; poll/wait/send_signal as on subprocess.Popen.
    Its exit code comes from the zygote; a zygote that dies first takes its children along (their
    parent-death signal), reported as -SIGKILL."""

    def __init__(self, conn: socket.socket, module: str):
        self.conn = conn
        self.args = module
        self.returncode: int | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None

    @property
    def pid(self) -> int:
        while self._pid is None and self.returncode is None:
            self._read(START_TIMEOUT_S)
            if self._pid is None and self.returncode is None:
                raise TimeoutError(f"no pid from the zygote within {START_TIMEOUT_S:.0f} s")
        return self._pid or 0

    def _read(self, timeout: float | None) -> None:
        """Takes one message from the zygote if one arrives within `timeout` (None: now)."""
        if self.returncode is not None:
            return
        if not select.select([self.conn], [], [], timeout or 0)[0]:
            return
        try:
            raw = self.conn.recv(4096)
        except OSError:
            raw = b""
        msg = json.loads(raw) if raw else {"exit": -signal.SIGKILL}  # zygote gone: see above
        if "error" in msg:
            log.error("the rank zygote refused %s: %s", self.args, msg["error"])
            msg = {"exit": 1}
        if "pid" in msg:
            self._pid = msg["pid"]
            with contextlib.suppress(ProcessLookupError):  # exited already: its code follows
                self._pidfd = os.pidfd_open(self._pid)
        if "exit" in msg:
            self.returncode = int(msg["exit"])
            self._close()

    def poll(self) -> int | None:
        while self.returncode is None and select.select([self.conn], [], [], 0)[0]:
            self._read(None)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read(left if left is not None else 1.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        self.pid  # noqa: B018  (waits for the fork, so a stop during start-up reaches the rank)
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _close(self) -> None:
        self.conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None


class Zygote:
    """The client side: the zygote PDSERVE_RANK_ZYGOTE names, or one started (and stopped) here."""

    def __init__(self, path: str, proc: subprocess.Popen | None = None, tmpdir: str | None = None):
        self.path = path
        self.proc = proc
        self._tmpdir = tmpdir

    @classmethod
    def start(cls, modules: list[str]) -> Zygote:
        tmpdir = tempfile.mkdtemp(prefix="pdserve-zygote-")  # 0700: only this uid can connect
        path = os.path.join(tmpdir, "sock")
        proc = subprocess.Popen(
            [sys.executable, "-m", "infra.zygote", "--socket", path, *modules],
            stdin=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
        )
        return cls(path, proc, tmpdir)

    @classmethod
    def shared_or_start(cls, modules: list[str]) -> Zygote:
        path = os.environ.get(ENV)
        return cls(path) if path else cls.start(modules)

    def fork(self, module: str, argv: list[str]) -> ZygoteChild:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # a zygote started a moment ago may not have bound its socket yet
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                conn.connect(self.path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                conn.close()
                if time.monotonic() > deadline or (self.proc and self.proc.poll() is not None):
                    raise RuntimeError(f"no rank zygote at {self.path}") from None
                time.sleep(0.05)
        _pid, uid = peer_pid_uid(conn)
        if uid != os.getuid():
            conn.close()
            raise RuntimeError(f"the rank zygote at {self.path} runs as uid {uid}, not ours")
        req = {"module": module, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
        socket.send_fds(conn, [json.dumps(req).encode()], [1, 2])
        return ZygoteChild(conn, module)

    def close(self) -> None:
        """Stops a zygote started here (its children were stopped first); a shared one stays."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=5)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
