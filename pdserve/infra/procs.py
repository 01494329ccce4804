"""Process hygiene shared by every launcher: children die with their parent,
and are always reaped."""

from __future__ import annotations

import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from typing import Protocol

log = logging.getLogger(__name__)


# free_port's range starts here: above Mooncake's handshake/RPC ports (12001, 15000-17000)
PORTS_FROM = 20000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port free right now, for a server to bind soon after. Taken below the kernel's ephemeral
    range: a port the OS hands out for bind(0) is also what it hands out as the local port of the
    next outgoing connection, which then holds it when the server binds (seen: EADDRINUSE on a
    prefill node's bootstrap port while other processes connected). Random, then checked. The
    check binds without SO_REUSEADDR, so it skips a port another process holds with
    reserve_port()."""
    with _bound(host, reuse=False) as s:
        return s.getsockname()[1]


def reserve_port(host: str = "127.0.0.1") -> socket.socket:
    """A port as free_port picks it, kept bound (not listening) by the socket returned, with
    SO_REUSEADDR: until the caller closes it, free_port in any process skips that port, while a
    server that binds with SO_REUSEADDR (torch's TCPStore, uvicorn) can still take it. This closes
    free_port's window between the check and the server's bind (seen: a PP rank's TCPStore lost its
    port to another node starting at the same moment, and that node never became healthy).

    The flag is set only after the bind: Linux lets two bound, not listening sockets share a port
    when both had it at bind time, so a hold bound with it could share its port with another
    reservation made at the same moment. Set afterwards, it still lets the server bind."""
    s = _bound(host, reuse=False)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


def hold_port(host: str, port: int) -> socket.socket:
    """`port` on `host`, named by the user, kept bound (not listening) by the socket returned
    until the server that will listen there has: OSError at once where another socket listens
    there (a clear error before minutes of start-up, not after), and no free_port() in any
    process picks it meanwhile. SO_REUSEADDR from the start, unlike reserve_port: a port that the
    last run's connections leave in TIME_WAIT is free to take again, as the server's own bind
    (uvicorn's, with the flag) will take it. The flag's price: Linux lets two sockets that both set
    it and neither listens share a port, so a hold does not see another hold (a second `pdserve
    up` on the same port started in the same minutes) nor a server between its bind and its
    listen; that one fails at its router's start instead."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    s = socket.socket(family, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind((host, port))
    except OSError:
        s.close()
        raise
    return s


def _bound(host: str, reuse: bool) -> socket.socket:
    end = _ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(100 if end - PORTS_FROM > 1000 else 0):
        s = _socket(reuse)
        try:
            s.bind((host, rng.randrange(PORTS_FROM, end)))
        except OSError:
            s.close()
            continue
        return s
    s = _socket(reuse)  # no usable range below the ephemeral ports: the OS picks
    s.bind((host, 0))
    return s


def _socket(reuse: bool) -> socket.socket:
    s = socket.socket()
    if reuse:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return s


PARENT_PID_ENV = "PDSERVE_PARENT_PID"
# True in a process a zygote forked (infra/zygote.py): it dies with the process that asked for it
# (a pidfd watched by a thread), not with the zygote, its parent. A flag in memory, not in the
# environment: what such a process starts in turn dies with its parent as usual.
_forked_by_zygote = False


def forked_by_zygote() -> None:
    """Called in a zygote's child: its die_with_parent leaves the zygote out."""
    global _forked_by_zygote
    _forked_by_zygote = True


def die_with_parent() -> None:
    """Linux: SIGKILL this process when its parent dies, so a crashed launcher leaves no orphans.
    A parent that died before this call is caught too (the signal would never come): a child
    whose environment names its parent (PARENT_PID_ENV) exits at once when that is no longer its
    parent. A zygote's child does neither: its parent is the zygote, whose death must cost no
    running rank; it dies with its node instead (forked_by_zygote)."""
    if _forked_by_zygote:
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    parent = os.environ.get(PARENT_PID_ENV, "")
    if parent.isdigit() and int(parent) != os.getppid():
        os._exit(1)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)


def exit_on_stop_signals(log: logging.Logger, what: str) -> None:
    """SIGTERM and SIGHUP end this process as SystemExit(0) in its main thread, after a log line
    that names the sender (pid, command name): a process that just exits 0 leaves no trace of who
    stopped it. Call from the main thread before any other thread starts, since the signals are
    blocked here and in every thread started later; a thread takes them with sigwaitinfo, which
    (unlike a handler) gives the sender, and interrupts the main thread with SIGUSR1."""
    signal.pthread_sigmask(signal.SIG_BLOCK, set(STOP_SIGNALS))

    def stop(*_) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGUSR1, stop)
    main = threading.main_thread().ident
    assert main is not None

    def watch() -> None:
        info = signal.sigwaitinfo(set(STOP_SIGNALS))
        log.warning(
            "%s stops: %s from pid %d (%s, uid %d)",
            what,
            signal.Signals(info.si_signo).name,
            info.si_pid,
            _comm(info.si_pid),
            info.si_uid,
        )
        signal.pthread_kill(main, signal.SIGUSR1)

    threading.Thread(target=watch, name="stop-signals", daemon=True).start()


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "gone"


def set_process_name(name: str) -> None:
    """Linux: the name `ps -o comm`, top and /proc/PID/comm show (15 bytes at most). A rank forked
    from a zygote (infra/zygote.py) would otherwise show the zygote's name and command line."""
    with open("/proc/self/comm", "w") as f:  # the main thread's name is the process's
        f.write(name[:15])


class StoppableProcess(Protocol):
    """The part of `subprocess.Popen` that stop_processes uses (infra/zygote_client.ZygoteChild
    has it too)."""

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def kill(self) -> None: ...


def stop_processes(procs: Sequence[StoppableProcess], grace_s: float = 5.0) -> None:
    """SIGTERM, wait up to `grace_s`, then SIGKILL; always waits so nothing is left as a zombie."""
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        left = deadline - time.monotonic()
        try:
            p.wait(timeout=max(0.05, left))
        except subprocess.TimeoutExpired:
            log.warning("pid %d ignored SIGTERM for %.0f s; killing it", p.pid, grace_s)
            p.kill()
            p.wait(timeout=5)
