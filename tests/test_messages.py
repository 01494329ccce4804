"""The typed messages between a node's processes (runtime/messages.py, pd_common/messages.py): every
kind round-trips, and anything that is not exactly one of them is rejected with MessageError,
never another exception, so a reader can drop and count it."""

from __future__ import annotations

import json

import msgpack
import pytest

from pdserve.pd_common.messages import KVRankStats, PDAddRequest, PrefillDoneEvent
from pdserve.runtime.messages import (
    AbortRequest,
    AbortUnknownEvent,
    AddRequest,
    ErrorEvent,
    FinishEvent,
    MessageError,
    RankStats,
    TokenEvent,
    decode,
    encode,
    pack,
    unpack,
)
from pdserve.runtime.rank_spec import RankSpec

STATS = RankStats(
    pp_rank=1,
    pid=42,
    iterations=10,
    forwards=7,
    held_pages=3,
    used_tokens=40,
    num_pages=64,
    free_pages=61,
    page_size=16,
    cached_pages=2,
    locked_cached_pages=1,
    prefix_hit_tokens=32,
    retractions=0,
    queues={"waiting": 1, "running": 2, "prealloc": 0},
    samples={"queue:waiting": [0.001, 0.5]},
    front_dropped={"malformed": 1},
    ext=KVRankStats(1024, {"waiting_timeout": 1}, [0.02], {"bad_mac": 2}, 5555, [4096]),
    dtype="bfloat16",
)
EVERY_KIND = [
    AddRequest("r1", [1, 2, 3], {"max_tokens": 4, "temperature": 0.0}),
    AbortRequest("r1", "client_abort"),
    PDAddRequest("r2", [5], {}, (1 << 63) - 1, "10.0.0.1:8998"),
    TokenEvent("r1", 17, -0.25, [(17, -0.25), (3, -2.0)]),
    TokenEvent("r1", 17, None, None),
    FinishEvent("r1", "stop", None, "\n\n", 3, 5, 0),
    FinishEvent("r1", "stop", None, 2, 3, 5, 0),
    FinishEvent("r1", "abort", "waiting timeout", None, 3, 1, 0, "waiting_timeout"),
    ErrorEvent("r1", "bad temperature", "temperature", "invalid_request"),
    ErrorEvent("r1", "node failure: rank exited", None, "node_failure"),
    AbortUnknownEvent("r9"),
    PrefillDoneEvent("r2", 100, 64),
    STATS,
]


def _wire(msg) -> object:
    return msgpack.unpackb(msgpack.packb(encode(msg), use_bin_type=True), raw=False)


@pytest.mark.parametrize("msg", EVERY_KIND, ids=lambda m: type(m).__name__)
def test_every_kind_round_trips_through_msgpack(msg):
    back = decode(_wire(msg))
    assert type(back) is type(msg)
    assert encode(back) == _wire(msg)


def test_a_batch_keeps_the_good_and_names_the_bad():
    raw = msgpack.packb(
        [encode(EVERY_KIND[0]), ["token", "r1", "seventeen", None, None], ["nope"], encode(STATS)],
        use_bin_type=True,
    )
    good, bad = unpack(raw)
    assert [type(m) for m in good] == [AddRequest, RankStats]
    assert len(bad) == 2 and "TokenEvent.token" in str(bad[0]) and "nope" in str(bad[1])
    assert unpack(pack(EVERY_KIND))[0] == EVERY_KIND


MALFORMED = [
    None,
    [],
    "add",
    [1, "r1"],
    ["add"],
    ["add", "r1", [1, 2]],  # a field short
    ["add", "r1", [1, 2], {}, "extra"],  # a field too many
    ["add", 5, [1, 2], {}],  # rid not a string
    ["add", "r1", [1, "2"], {}],  # a token id not an int
    ["add", "r1", [1, True], {}],  # bool is no token id
    ["add", "r1", [], {}],  # empty prompt
    ["add", "r1", [1, -2], {}],  # negative token id
    ["add", "r1", [1], []],  # params not a map
    ["add", "x" * 5000, [1], {}],  # string over the bound
    ["pd_add", "r1", [1], {}, -1, ""],  # room below the range
    ["pd_add", "r1", [1], {}, 1 << 63, ""],  # room above it
    ["pd_add", "r1", [1], {}, "7", ""],
    ["token", "r1", 1, "0.5", None],
    ["token", "r1", 1, 0.5, [[1]]],  # a top entry that is not a pair... of the right types
    ["finish", "r1", "stop", None, 1.5, 3, 5, 0, None],  # matched: token id or string
    ["error", "r1", "m", 7, "client_abort"],
    # a reason is a code of runtime/reasons.py, never free text
    ["abort", "r1", "waiting timeout: queued for more than 30 s"],
    ["error", "r1", "m", None, "KV transfer failed"],
    ["finish", "r1", "abort", "m", None, 3, 1, 0, "aborted"],
    [*encode(STATS)[:-2], ["kv"], ""],  # nested stats of the wrong shape
    [*encode(STATS)[:-3], ["abort", "r1", "client_abort"], "", []],  # a message, no extension
    [*encode(STATS)[:-3], ["no_such_tag", 1], "", []],  # an extension of no known kind
]


@pytest.mark.parametrize("obj", MALFORMED, ids=range(len(MALFORMED)))
def test_anything_else_is_a_message_error(obj):
    with pytest.raises(MessageError):
        decode(obj)


def test_garbage_bytes_are_a_message_error():
    for raw in (b"\xc1", b"", msgpack.packb({"a": 1}), msgpack.packb(5)):
        with pytest.raises(MessageError):
            unpack(raw)


def test_rank_spec_round_trips_and_names_a_bad_field():
    spec = RankSpec(
        model="m", engine={"page_size": 16}, pp_size=2, pp_rank=1, dist_init="tcp://h:1", cpus=[0]
    )
    assert RankSpec.from_json(spec.to_json()) == spec
    d = json.loads(spec.to_json())
    with pytest.raises(MessageError, match="pp_rank"):
        RankSpec.from_json(json.dumps({**d, "pp_rank": "1"}))
    with pytest.raises(MessageError, match="fields"):
        RankSpec.from_json(json.dumps({**d, "extra": {}}))  # the old bag of keys is gone
    with pytest.raises(MessageError, match="fields"):
        RankSpec.from_json(json.dumps({k: v for k, v in d.items() if k != "model"}))
