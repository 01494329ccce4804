"""kv_transfer.mooncake against a real Mooncake engine over TCP on loopback (it writes into its own
registered memory, so one process is enough): windowed writes, stop, dead peer, rejected address."""

from __future__ import annotations

import ctypes
import random

import pytest

from pdserve.kv_transfer.mooncake import MooncakeEngine, TransferError

SIZE, DESC = 1 << 20, 4096


@pytest.fixture(scope="module")
def engine():
    return MooncakeEngine("127.0.0.1", "mooncake-tcp")


@pytest.fixture(scope="module")
def never_registered(engine):
    """Memory that stays allocated for the whole module and is never registered, so no registered
    buffer can overlap it. An address computed past `dst` was not enough: where the allocator put
    `src` a few MiB above `dst`, it landed inside `src` and the peer rightly accepted the write
    (seen once in CI). The peer does refuse unregistered memory (checked on Mooncake 0.3.13)."""
    return (ctypes.c_char * SIZE)()


@pytest.fixture
def buffers(engine):
    src, dst = (ctypes.c_char * SIZE)(), (ctypes.c_char * SIZE)()
    src[:] = random.Random(7).randbytes(SIZE)
    ctypes.memset(dst, 0, SIZE)
    for b in (src, dst):
        engine.register(ctypes.addressof(b), SIZE)
    yield src, dst
    for b in (src, dst):
        engine.unregister(ctypes.addressof(b))


def scattered(src, dst):
    """Every 4 KiB block of src to a shuffled block of dst: (descriptors, expected dst bytes)."""
    n = SIZE // DESC
    order = list(range(n))
    random.Random(3).shuffle(order)
    s, d = ctypes.addressof(src), ctypes.addressof(dst)
    data = bytes(src)
    want = bytearray(SIZE)
    for i, j in enumerate(order):
        want[j * DESC : (j + 1) * DESC] = data[i * DESC : (i + 1) * DESC]
    return [(s + i * DESC, d + j * DESC, DESC) for i, j in enumerate(order)], bytes(want)


@pytest.mark.parametrize("window", [1, 8, 1000])
def test_windowed_write_is_byte_exact(engine, buffers, window):
    descs, want = scattered(*buffers)
    assert engine.write(engine.session_id, descs, window) == SIZE
    assert bytes(buffers[1]) == want


class StatusLog:
    """The real transfer engine, passed through, noting the batches submitted and those whose
    status came back final (done or failed) to the caller."""

    def __init__(self, te):
        self.te, self.submitted, self.ended = te, [], set()

    def transfer_submit_write(self, *args):
        bid = self.te.transfer_submit_write(*args)
        self.submitted.append(bid)
        return bid

    def transfer_check_status(self, bid):
        rc = self.te.transfer_check_status(bid)
        if rc != 0:
            self.ended.add(bid)
        return rc

    def __getattr__(self, name):
        return getattr(self.te, name)


def test_stop_ends_the_write_with_nothing_left_in_flight(engine, buffers, monkeypatch):
    src, dst = buffers
    descs, _ = scattered(src, dst)
    polls = iter(range(1 << 30))
    log = StatusLog(engine._te)
    monkeypatch.setattr(engine, "_te", log)
    with pytest.raises(TransferError, match="stopped") as e:
        engine.write(engine.session_id, descs, 32, lambda: next(polls) >= 3)
    assert e.value.session_id is None  # stopped by us: the peer is not to blame
    assert bytes(dst) != bytes(SIZE)  # some blocks had landed: it stopped part-way
    assert len(log.submitted) < len(descs)  # it stopped submitting
    # and it returned only once every write it had submitted had ended: none still on the wire
    assert log.submitted and set(log.submitted) <= log.ended


def test_dead_peer_and_rejected_address_raise_with_the_session(engine, buffers, never_registered):
    src, dst = buffers
    with pytest.raises(TransferError) as e:
        engine.write("127.0.0.1:1", [(ctypes.addressof(src), ctypes.addressof(dst), DESC)], 8)
    assert e.value.session_id == "127.0.0.1:1"
    # an address outside every registered buffer of the peer: refused by the peer, retried once
    with pytest.raises(TransferError) as e:
        engine.write(
            engine.session_id,
            [(ctypes.addressof(src), ctypes.addressof(never_registered), DESC)],
            8,
        )
    assert e.value.session_id == engine.session_id
