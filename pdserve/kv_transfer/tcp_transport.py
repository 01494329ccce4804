"""KV writes over an authenticated TCP transport: the default where there is no RDMA.

Why not Mooncake's TCP transport: in 0.3.13 its data listener and its handshake listener accept on
every interface whatever address it is given, neither authenticates the peer, and the handshake
hands any caller the addresses of the registered buffers, which the data port then reads and
writes (docs/SECURITY.md). This transport has the same seam as kv_transfer/mooncake.py
(`register`, `unregister`, `write`, `session_id`) and:

- listens only on the address it is given (loopback for a local cluster);
- admits a connection only after a challenge-response on the cluster secret (the secret itself
  never crosses the wire), in both directions, from which a key for this connection is derived;
- carries writes in frames sealed with AES-256-GCM under that key (the header and the ranges as
  associated data, the nonce from the direction and the frame's sequence number): the KV is
  encrypted, and a frame from anyone else, replayed, reordered or changed fails its tag, is
  refused and the connection closed. AES-GCM (the `cryptography` package, OpenSSL's AES-NI code)
  seals and opens several times faster than HMAC-SHA256 hashes, which had bounded the transport
  (measured: bench/results/HISTORY.md, "The KV data plane that only the cluster can use");
- writes a frame only once its tag holds and every range it names lies inside memory this process
  registered, so nothing else of the process can be touched; it has no read operation at all;
- writes a flush group's frames only when the writer's flush arrives: a writer that gave up (a
  timeout, an error) and closed its connection leaves nothing behind to land in pages that may
  already belong to another request;
- bounds everything: unauthenticated handshakes (in all and per source address) apart from the
  authenticated connections, the frame size, the entries of a frame, the bytes awaiting a flush,
  and the time of a whole handshake, of a frame and of an idle connection.

Without a cluster secret (loopback-only development) the key is derived from the empty secret, as
for the ZMQ channels (infra/channel_auth.py): then anyone on the host could forge it, which is why
a node refuses a non-loopback bind without one.
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import threading
import time
from collections.abc import Sequence

from pdserve.infra.channel_auth import channel_key
from pdserve.kv_transfer.layout import Desc
from pdserve.kv_transfer.mooncake import TransferError, write_bounds
from pdserve.kv_transfer.tcp_listener import _Server

# the wire's names, some for the tests that forge frames
from pdserve.kv_transfer.tcp_wire import (  # noqa: F401
    _ACK,
    _ENTRY,
    _FRAME,
    CHANNEL,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    MAX_CONNECTIONS,
    MAX_ENTRIES,
    MAX_FRAME_BYTES,
    MAX_HANDSHAKES,
    MAX_HANDSHAKES_PER_SOURCE,
    NONCE,
    POOL_PER_PEER,
    TAG,
    WRITE,
    _mac,
    _nonce,
    _recv_exactly,
    _Regions,
)
from pdserve.kv_transfer.tcp_writer import _Client

logger = logging.getLogger(__name__)


class TcpTransferEngine:
    """One per process, like MooncakeEngine: a listener on `host` for the writes of peers, and a
    pool of authenticated connections to the peers this process writes to."""

    protocol = "tcp"
    device = ""

    def __init__(self, host: str, secret: str | None = None, port: int = 0):
        self._key = channel_key(CHANNEL, secret)
        self._regions = _Regions()
        self._stop = threading.Event()
        self._listener = socket.create_server((host, port), backlog=128)
        self.host = host
        self.session_id = f"{host}:{self._listener.getsockname()[1]}"
        self._conns = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._handshakes: dict[str, int] = {}  # source address -> handshakes under way
        self._handshakes_lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._open_lock = threading.Lock()
        self._pool: dict[str, list[_Client]] = {}
        self._pool_lock = threading.Lock()
        self.refused = 0  # connections or frames refused (a counter for tests and logs)
        threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True).start()
        logger.debug("KV transfer engine: authenticated TCP, session %s", self.session_id)

    # --- the seam ---------------------------------------------------------------------------
    def register(self, ptr: int, length: int) -> None:
        self._regions.add(ptr, length)

    def unregister(self, ptr: int) -> None:
        self._regions.remove(ptr)

    def write(
        self, session_id: str, descs: Sequence[Desc], max_inflight: int, should_stop=lambda: False
    ) -> int:
        """Writes every descriptor to the peer (blocking) and returns the bytes moved. A failed
        write is tried once more on a new connection (writes are idempotent). It returns or raises
        only once the peer has answered for every frame sent, so after it the destination is never
        written by this call again (a peer that does not answer within the drain time is cut off
        and logged). `max_inflight` is Mooncake's window: one TCP stream needs none."""
        total, deadline = write_bounds(descs, max_inflight)
        if not descs:
            return 0
        for attempt in (1, 2):
            client = None
            try:
                client = self._take(session_id, deadline)
                client.write(descs, should_stop, deadline)
                self._give_back(session_id, client)
                return total
            except TransferError:
                if client is not None:
                    client.close()
                raise
            except (OSError, ConnectionError, ValueError) as e:
                if client is not None:
                    client.close()
                if attempt == 2 or should_stop() or time.monotonic() > deadline:
                    raise TransferError(f"write to {session_id} failed: {e}", session_id) from e
        raise AssertionError("unreachable")

    def close(self) -> None:
        self._stop.set()
        for s in [self._listener, *self._open]:  # shutdown wakes a thread blocked on it
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._listener.close()
        with self._pool_lock:
            for clients in self._pool.values():
                for c in clients:
                    c.close()
            self._pool.clear()
        with self._open_lock:
            for s in self._open:
                s.close()

    # --- client side --------------------------------------------------------------------------
    def _take(self, session_id: str, deadline: float) -> _Client:
        with self._pool_lock:
            idle = self._pool.get(session_id)
            if idle:
                return idle.pop()
        host, _, port = session_id.rpartition(":")
        if not host or not port.isdigit():
            raise TransferError(f"bad peer session {session_id!r}", session_id)
        timeout = max(0.1, min(HANDSHAKE_TIMEOUT_S, deadline - time.monotonic()))
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=timeout)
        try:
            handshake_deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT_S)
            return _Client.handshake(sock, self._key, session_id, handshake_deadline)
        except BaseException:
            sock.close()
            raise

    def _give_back(self, session_id: str, client: _Client) -> None:
        with self._pool_lock:
            idle = self._pool.setdefault(session_id, [])
            if len(idle) < POOL_PER_PEER:
                idle.append(client)
                return
        client.close()

    # --- server side --------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while True:
            try:
                sock, addr = self._listener.accept()
            except OSError as e:
                if self._stop.is_set():
                    return
                # out of descriptors or buffers for a moment: the listener must outlive it
                logger.warning("KV data port %s: accept failed: %s", self.session_id, e)
                self._stop.wait(0.1)
                continue
            if self._stop.is_set():
                sock.close()
                return
            source = addr[0]
            if not self._begin_handshake(source):
                sock.close()  # at a handshake bound: the peer retries later
                self.refused += 1
                continue
            try:
                threading.Thread(
                    target=self._serve, args=(sock, source), name="kv-tcp-conn", daemon=True
                ).start()
            except RuntimeError:  # no thread to be had
                self._end_handshake(source)
                sock.close()

    def _begin_handshake(self, source: str) -> bool:
        with self._handshakes_lock:
            mine = self._handshakes.get(source, 0)
            if (
                mine >= MAX_HANDSHAKES_PER_SOURCE
                or sum(self._handshakes.values()) >= MAX_HANDSHAKES
            ):
                return False
            self._handshakes[source] = mine + 1
            return True

    def _end_handshake(self, source: str) -> None:
        with self._handshakes_lock:
            left = self._handshakes.get(source, 1) - 1
            if left:
                self._handshakes[source] = left
            else:
                self._handshakes.pop(source, None)

    def _serve(self, sock: socket.socket, source: str) -> None:
        with self._open_lock:
            self._open.add(sock)
        admitted = False
        try:
            try:
                key = self._server_handshake(sock)
            finally:
                self._end_handshake(source)
            if key is None:
                self.refused += 1
                return
            # only an authenticated connection takes one of the connection slots
            admitted = self._conns.acquire(blocking=False)
            if not admitted:
                self.refused += 1
                return
            _Server(sock, key, self._regions, self).run()
        except (OSError, ConnectionError, ValueError) as e:
            logger.debug("KV connection from %s ended: %s", source, e)
        finally:
            with self._open_lock:
                self._open.discard(sock)
            sock.close()
            if admitted:
                self._conns.release()

    def _server_handshake(self, sock: socket.socket) -> bytes | None:
        """Challenge-response: the peer proves it holds the secret for this listener's session,
        then this side proves it back; returns the connection's key, or None (refused)."""
        deadline = time.monotonic() + HANDSHAKE_TIMEOUT_S  # for the whole handshake
        sock.settimeout(HANDSHAKE_TIMEOUT_S)
        mine = secrets.token_bytes(NONCE)
        sock.sendall(MAGIC + mine)
        hello = _recv_exactly(sock, len(MAGIC) + NONCE + TAG, deadline=deadline)
        magic, theirs, proof = hello[:4], hello[4 : 4 + NONCE], hello[4 + NONCE :]
        expected = _mac(self._key, b"client", mine, theirs, self.session_id.encode())
        if magic != MAGIC or not hmac.compare_digest(proof, expected):
            logger.warning("KV data port %s: refused a peer without the secret", self.session_id)
            return None
        sock.sendall(_mac(self._key, b"server", theirs, mine))
        return _mac(self._key, b"session", mine, theirs)


def make_engine(host: str, protocol: str | None, device: str | None):
    """The transfer engine for a KV manager: this transport for TCP, Mooncake for RDMA (and for
    Mooncake's own TCP transport, only when asked for by name)."""
    from pdserve.kv_transfer.mooncake import MooncakeEngine, resolve_protocol

    protocol, device = resolve_protocol(protocol, device)
    if protocol == "tcp":
        return TcpTransferEngine(host)
    return MooncakeEngine(host, protocol, device)
