"""A warm parent for rank processes (a zygote): it imports the rank modules once (torch alone is
about 3 s of CPU per process on a small host), then forks one process per request. A node's N
ranks, or all the ranks `pdserve up` starts, then cost one import instead of N. (The tests fork
their node and router processes from one too: tests/conftest.py.)

Server: `python -m pdserve.infra.zygote --socket PATH MODULE...` listens on a Unix socket, in a 0700
directory, before it imports, so clients can queue requests while it loads. It accepts peers of
its own uid only (SO_PEERCRED), forks only into the modules it preloaded (and their
`ZYGOTE_PRELOAD`), and forks from one thread (it starts none, and checks). A child takes the
requester's environment, working directory, stdout, stderr (passed as file descriptors), CPU
affinity and process group (or a group of its own), and runs `MODULE.main(argv)`. It dies with its
requester (a pidfd watched by a thread), and outlives the zygote: a zygote killed or crashed costs
no running rank (the requester then learns a child's end from its pidfd, without the exit code).

The client is infra/zygote_client.py. PDSERVE_RANK_ZYGOTE names a shared zygote (one per `pdserve
up`, one per test worker); without it a node starts its own.

The wire is JSON, never pickle: {"module", "argv", "env", "cwd", "new_group"} with fds [stdout,
stderr, the requester's own pidfd], then {"pid": n} with the child's pidfd, and later
{"exit": code}; or {"error": why}. One request at a time: a silent peer (same uid) holds the
others up to 10 s."""

from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import select
import signal
import socket
import struct
import sys
import tempfile
import threading
import time
import traceback
from typing import NoReturn

from pdserve.infra.procs import PARENT_PID_ENV, die_with_parent, forked_by_zygote

log = logging.getLogger(__name__)

ENV = "PDSERVE_RANK_ZYGOTE"
MAX_MESSAGE = 1 << 20  # a request: the environment plus a rank spec, a few KiB in practice
REQUEST_TIMEOUT_S = 10.0  # a queued request is complete when accepted; this bounds a slow peer
START_TIMEOUT_S = 300.0  # a client's wait for its pid: the zygote may still be importing
# blocked from the fork until the child has started its requester watch: that thread keeps them
# blocked, so a rank's stop signals reach its own sigwaitinfo (procs.exit_on_stop_signals)
_CHILD_BLOCKED = {signal.SIGTERM, signal.SIGHUP}


def peer_pid_uid(sock: socket.socket) -> tuple[int, int]:
    pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return pid, uid


def readable(fd: int, timeout_s: float | None) -> bool:
    """poll(2), not select(2): a node's descriptors can pass FD_SETSIZE (1024)."""
    p = select.poll()
    p.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(p.poll(None if timeout_s is None else max(0, int(timeout_s * 1000))))


def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    with contextlib.suppress(OSError):  # a requester that died: its child dies with it
        socket.send_fds(sock, [json.dumps(msg).encode()], fds or [])


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
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.stopping = False
        self._startup_sigterm = signal.getsignal(signal.SIGTERM)

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
        # a child gets the SIGTERM handler this process started with (see _fork): the default,
        # or the one coverage.py installs to save its data (`make coverage`; its `sigterm` setting)
        self._startup_sigterm = signal.signal(signal.SIGTERM, self._on_term)
        # Ctrl-C reaches the whole group: the nodes stop their ranks, then whoever started this
        # zygote stops it (a zygote that died first would take the ranks with it, ungracefully)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        zygote = os.getpid()
        try:
            while not self.stopping:
                watched: list[socket.socket | int] = [self.listener, self._wake_r]
                ready, _, _ = select.select(watched, [], [], 5.0)
                self._drain_wakeups()
                if self.listener in ready and not self.stopping:
                    self._accept()
                self._reap()
        finally:
            if os.getpid() != zygote:  # a child here is a bug: it must not stop its siblings
                os._exit(1)
            self._stop_children()

    def _on_term(self, *_) -> None:
        self.stopping = True

    def _drain_wakeups(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError as e:  # EMFILE and the like: this request fails, the others go on
            log.error("rank zygote: accept failed: %s", e)
            return
        try:
            self._serve(conn)
        except Exception as e:  # a bad request or a failed fork never stops the zygote
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        fds: list[int] = []
        try:
            req, fds, node_pid = self._read_request(conn)
            node_pidfd = fds[2]
            pgid = 0 if req.get("new_group") else os.getpgid(node_pid)  # 0: a group of its own
            # the pidfd the requester sent is its own: alive now, so node_pid is still its pid
            if readable(node_pidfd, 0):
                raise ValueError("the requester exited")
            if readable(conn.fileno(), 0):  # it sends nothing more: this is its end closing
                raise ValueError("the requester withdrew its request")
            sys.stdout.flush()
            sys.stderr.flush()
            pid = self._fork(lambda: self._child(conn, req, fds, node_pid, pgid))
        finally:
            for fd in fds:
                os.close(fd)
        # the child joins its requester's process group (stopping the group stops it) before the
        # requester learns its pid; both sides set it (the child too, in case this comes late)
        with contextlib.suppress(OSError):  # a requester in another session keeps it in ours
            os.setpgid(pid, pgid or pid)
        self.children[pid] = conn
        child_pidfd = os.pidfd_open(pid)  # not reaped before _reap: the pid cannot be reused
        try:
            _send(conn, {"pid": pid}, [child_pidfd])
        finally:
            os.close(child_pidfd)

    def _fork(self, run_child) -> int:
        """Forks with SIGTERM blocked and set to the handler this process started with, so the
        child starts with that one (and coverage.py's fork hook chains to it, `make coverage`),
        never this zygote's own; the child unblocks it once it is set up (_become_child)."""
        signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_BLOCKED)
        signal.signal(signal.SIGTERM, self._startup_sigterm)
        try:
            pid = os.fork()
            if pid == 0:
                try:
                    run_child()
                finally:  # never back into this loop, whatever a child raises on its way out
                    _exit_now(1)
        finally:  # the zygote (a child never gets here)
            signal.signal(signal.SIGTERM, self._on_term)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_BLOCKED)
        return pid

    def _read_request(self, conn: socket.socket) -> tuple[dict, list[int], int]:
        node_pid, uid = peer_pid_uid(conn)
        msg, fds, flags, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        try:
            if uid != os.getuid():
                raise ValueError(f"peer uid {uid} is not this zygote's")
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != 3:
                raise ValueError("request truncated, or without stdout, stderr and its pidfd")
            req = json.loads(msg)
            ok = isinstance(req, dict) and isinstance(req.get("module"), str)
            if not ok or req["module"] not in self.modules:
                raise ValueError(f"module {req.get('module') if ok else None!r} is not preloaded")
            if not (
                isinstance(req.get("argv"), list) and all(isinstance(a, str) for a in req["argv"])
            ):
                raise ValueError("argv must be a list of strings")
            env, cwd = req.get("env"), req.get("cwd")
            if not (isinstance(env, dict) and all(isinstance(v, str) for v in env.values())):
                raise ValueError("env must map names to strings")
            if not isinstance(cwd, str):
                raise ValueError("cwd must be a string")
        except Exception:  # whatever is wrong with it, the fds it brought are closed
            for fd in fds:
                os.close(fd)
            raise
        return req, fds, node_pid

    def _child(self, conn, req: dict, fds: list[int], node_pid: int, pgid: int) -> None:
        code: int = 1
        try:
            self._become_child(conn, req, fds, node_pid, pgid)
            rc = importlib.import_module(req["module"]).main(req["argv"])
            code = 0 if rc is None else int(rc)
        except SystemExit as e:  # as the interpreter does: None is 0, a message is printed, 1
            if e.code is None or isinstance(e.code, int):
                code = e.code or 0
            else:
                print(e.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            _exit_now(code & 0xFF)

    def _become_child(self, conn, req, fds, node_pid: int, pgid: int) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGTERM: set at the fork
        for s in (self.listener, conn, *self.children.values()):
            s.close()
        for fd in (self._wake_r, self._wake_w):
            os.close(fd)
        with contextlib.suppress(OSError):
            os.setpgid(0, pgid)
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, os.sched_getaffinity(node_pid))
        devnull = os.open(os.devnull, os.O_RDONLY)
        for src, dst in ((devnull, 0), (fds[0], 1), (fds[1], 2)):
            os.dup2(src, dst)
            os.close(src)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        tempfile.tempdir = None  # the requester's TMPDIR, not the one this zygote found first
        # the rank dies with its requester (the watch below), never with this zygote: a zygote
        # that dies (killed, crashed) leaves the ranks it forked running
        os.environ.pop(PARENT_PID_ENV, None)
        forked_by_zygote()
        sys.argv = [req["module"], *req["argv"]]
        watch = threading.Thread(target=_die_with, args=(fds[2],), name="requester-watch")
        watch.daemon = True
        watch.start()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_BLOCKED)

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
        """SIGTERM, up to 5 s, SIGKILL: what a node does with its ranks, for any it did not stop."""
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5.0
        while self.children and time.monotonic() < deadline:
            self._reap()
            if self.children:
                readable(self._wake_r, 0.1)
                self._drain_wakeups()
        for pid in list(self.children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        while self.children:  # SIGKILLed: gone at once
            pid, status = os.waitpid(-1, 0)
            conn = self.children.pop(pid, None)
            if conn is not None:
                _send(conn, {"exit": os.waitstatus_to_exitcode(status)})
                conn.close()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _exit_now(code: int) -> NoReturn:
    """A forked child's exit. A second SIGTERM (a node's group, then the node) can run a handler
    that raises on the way out; the signals are blocked first, and a handler already pending that
    raises anyway is caught and the exit tried again, so no child ever returns into the zygote's
    loop (where it would stop the zygote's other children and remove its socket)."""
    while True:
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        except BaseException:  # see above
            continue


def _die_with(pidfd: int) -> None:
    """A forked rank's requester (its node) exited: so does the rank, as a spawned one would."""
    readable(pidfd, None)
    with contextlib.suppress(OSError):  # a plain write: the logging lock may be held elsewhere
        os.write(2, f"pid {os.getpid()}: the process that started it exited: SIGKILL\n".encode())
    os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="fork rank processes from one warm parent")
    ap.add_argument("--socket", required=True, help="Unix socket path, in a 0700 directory")
    ap.add_argument("modules", nargs="+", help="the modules to preload and fork into")
    a = ap.parse_args(argv)
    die_with_parent()  # its starter (a node, `pdserve up`, a test session), named in the env
    server = ZygoteServer(a.socket, a.modules)
    server.preload()
    server.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
