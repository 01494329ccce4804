"""The client of a rank zygote (infra/zygote.py): `Zygote` starts one, or names the shared one
(PDSERVE_RANK_ZYGOTE), and `fork()`s rank processes from it; a `ZygoteChild` is the part of
`subprocess.Popen` that `pdserve.infra.procs.stop_processes` and a node's watch thread use."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from pdserve.infra.procs import PARENT_PID_ENV, stop_processes
from pdserve.infra.zygote import ENV, START_TIMEOUT_S, peer_pid_uid, readable

log = logging.getLogger(__name__)

# the exit code of a child whose zygote died before it: the code was its parent's to read
EXIT_UNKNOWN = 255


class ZygoteChild:
    """A process forked for this one by a zygote; poll/wait/send_signal as on subprocess.Popen,
    safe from several threads (a node's watch thread polls while its main thread stops). Its exit
    code comes from the zygote. A zygote that dies first leaves the child running: its end is then
    seen on its pidfd, and its code, which only its parent could read, is EXIT_UNKNOWN."""

    def __init__(self, conn: socket.socket, module: str):
        self.conn = conn
        self.args = module
        self.returncode: int | None = None
        self._pid: int | None = None
        self._pidfd: int | None = None
        self.orphaned = False  # the zygote is gone; the child may still run
        self._lock = threading.RLock()

    @property
    def pid(self) -> int:
        """Waits (up to START_TIMEOUT_S) for the fork; 0 when it never happened."""
        self._wait_pid(START_TIMEOUT_S)
        return self._pid or 0

    def _wait_pid(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while self._pid is None and self.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._readable(min(left, 0.5))

    def _readable(self, timeout_s: float) -> None:
        with self._lock:
            fd: int | None = -1
            if self.returncode is None:
                fd = self._pidfd if self.orphaned else self.conn.fileno()
        if fd is not None and fd >= 0:
            readable(fd, timeout_s)

    def poll(self) -> int | None:
        with self._lock:
            while self.returncode is None and not self.orphaned and readable(self.conn.fileno(), 0):
                self._take_message()
            if self.returncode is None and self.orphaned:
                # orphaned is set only while a pidfd is held; _ended clears it with returncode
                assert self._pidfd is not None
                if readable(self._pidfd, 0):
                    self._ended(EXIT_UNKNOWN)
            return self.returncode

    def _ended(self, code: int) -> None:
        self.returncode = code
        self.conn.close()
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def _take_message(self) -> None:
        try:
            raw, fds, _flags, _ = socket.recv_fds(self.conn, 4096, 1)
        except OSError:
            raw, fds = b"", []
        if not raw and self._pidfd is not None:  # the zygote is gone, not the child
            log.warning(
                "the rank zygote exited; %s (pid %s) goes on without it", self.args, self._pid
            )
            self.orphaned = True
            return
        msg = json.loads(raw) if raw else {"exit": -signal.SIGKILL}  # gone before it forked
        if "error" in msg:
            log.error("the rank zygote refused %s: %s", self.args, msg["error"])
            msg = {"exit": 1}
        if "pid" in msg:
            self._pid = int(msg["pid"])
            self._pidfd = fds[0] if fds else None
        else:
            for fd in fds:
                os.close(fd)
        if "exit" in msg:
            self._ended(int(msg["exit"]))

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = 1.0 if deadline is None else deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._readable(min(left, 1.0))
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """Signals the child through its pidfd (never a recycled pid). A request the zygote has
        not forked within 10 s (still importing, or stuck) is withdrawn: the zygote forks nothing
        for a connection that is gone, and a child forked meanwhile dies with this process."""
        self._wait_pid(10.0)
        with self._lock:
            if self.returncode is not None:
                return
            if self._pid is None:
                self.conn.close()
                self.returncode = -sig
                return
            if self._pidfd is not None:
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


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
        # no preexec_fn: the starter may have threads (a node front does); the zygote sets its
        # parent-death signal itself and exits if the parent named here is already gone
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve.infra.zygote", "--socket", path, *modules],
            stdin=subprocess.DEVNULL,
            env={**os.environ, PARENT_PID_ENV: str(os.getpid())},
        )
        return cls(path, proc, tmpdir)

    @classmethod
    def shared_or_start(cls, modules: list[str]) -> Zygote:
        path = os.environ.get(ENV)
        return cls(path) if path else cls.start(modules)

    def _connect(self) -> socket.socket:
        """A zygote started here may not have bound its socket yet: retried while it lives. A
        shared one that is not there is an error at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            conn.settimeout(30)
            try:
                conn.connect(self.path)
                return conn
            except (FileNotFoundError, ConnectionRefusedError) as e:
                conn.close()
                starting = self.proc is not None and self.proc.poll() is None
                if not starting or time.monotonic() > deadline:
                    raise RuntimeError(f"no rank zygote at {self.path}: {e}") from None
                time.sleep(0.05)

    def fork(
        self,
        module: str,
        argv: list[str],
        *,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        output: tuple[int, int] = (1, 2),
        new_group: bool = False,
    ) -> ZygoteChild:
        """`module.main(argv)` in a forked process, with `env` (default: ours), `cwd`, its stdout
        and stderr on the `output` descriptors, in our process group or (`new_group`) its own."""
        conn = self._connect()
        _pid, uid = peer_pid_uid(conn)
        if uid != os.getuid():
            conn.close()
            raise RuntimeError(f"the rank zygote at {self.path} runs as uid {uid}, not ours")
        req = {
            "module": module,
            "argv": argv,
            "env": dict(os.environ if env is None else env),
            "cwd": cwd or os.getcwd(),
            "new_group": new_group,
        }
        me = os.pidfd_open(os.getpid())  # the child watches this process through it
        try:
            socket.send_fds(conn, [json.dumps(req).encode()], [*output, me])
        finally:
            os.close(me)
        return ZygoteChild(conn, module)

    def close(self) -> None:
        """Stops a zygote started here (its children were stopped first); a shared one stays."""
        if self.proc is not None:
            stop_processes([self.proc], grace_s=10)
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
