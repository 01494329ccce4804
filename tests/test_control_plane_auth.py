"""The sealing of the nodes' ZMQ control plane (infra/channel_auth.py): a frame opens only with
its secret and channel, once and intact. The same against real nodes (a colocated PP node and a
PD pair getting foreign, malformed, oversized and forged control messages) runs on the nodes of
tests/test_internal_auth.py, which check the internal plane's HTTP side."""

from __future__ import annotations

import msgpack
import pytest

from pdserve.infra.channel_auth import AuthError, Opener, Sealer

SECRET = "control-plane-test-secret"


# ---- sealing -------------------------------------------------------------------------------------
def test_a_frame_opens_only_with_its_secret_and_channel_once_and_intact():
    seal = Sealer("kv-control", "decode/1", secret=SECRET).seal
    frame = seal(b"payload")
    opener = Opener("kv-control", secret=SECRET)
    assert opener.open(frame) == ("decode/1", b"payload")
    rejected = {
        "another secret": (Opener("kv-control", secret="other"), seal(b"x")),
        "another channel": (Opener("front-evt", secret=SECRET), seal(b"x")),
        "no secret": (Opener("kv-control", secret=""), seal(b"x")),
        "flipped payload bit": (opener, (lambda f: f[:-1] + bytes([f[-1] ^ 1]))(seal(b"x"))),
        "renamed sender": (opener, seal(b"x").replace(b"decode/1", b"decode/2")),
        "truncated": (opener, seal(b"x")[:20]),
        "unsealed": (opener, msgpack.packb({"t": "status"})),
        "empty": (opener, b""),
    }
    for what, (o, f) in rejected.items():
        with pytest.raises(AuthError) as e:
            o.open(f)
        assert e.value.reason == "unauthenticated", what
    with pytest.raises(AuthError) as e:
        opener.open(frame)  # the same frame again
    assert e.value.reason == "replayed"
    older, newer = seal(b"a"), seal(b"b")
    assert opener.open(newer)[1] == b"b"
    with pytest.raises(AuthError):
        opener.open(older)  # overtaken by a later frame of the same sender
