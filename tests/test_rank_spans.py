"""The ranks' span records (runtime/rank/spans.py) of a traced PD request, in-process (ranks as
threads, tests/inproc.py): every rank records its own stages, nested and in order; an untraced
request records nothing. The whole path through real processes and OTLP is tests/test_tracing.py."""

from __future__ import annotations

import time

from inproc import PDCluster, running

from pdserve.pd_common.messages import PDAddRequest

TP = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
PREFILL = {"bootstrap", "bootstrap.wait_decode_alloc", "bootstrap.handshake", "waiting"}
PREFILL |= {"chunk", "release_vote", "finish"}
DECODE = {"prealloc", "transferred_vote", "first_token", "decode", "finish"}


def _submit(c: PDCluster, rid: str, ids: list[int], traceparent: str | None) -> None:
    p = {"max_tokens": 6, "ignore_eos": True}
    c.prefill.front.submit(PDAddRequest(rid, ids, p, 77, "", traceparent=traceparent))
    c.decode.front.submit(PDAddRequest(rid, ids, p, 77, c.fabric.address, traceparent=traceparent))


def _records(c: PDCluster, want_finish: bool = True) -> dict[tuple[str, int], list]:
    """Every rank's records, drained until each rank recorded its `finish` (bounded)."""
    got: dict[tuple[str, int], list] = {}
    nodes = (("prefill", c.prefill), ("decode", c.decode))
    for _ in range(200):
        with c.paused():
            for name, node in nodes:
                for rank, loop in enumerate(node.loops):
                    got.setdefault((name, rank), []).extend(loop.spans.drain())
        if not want_finish or all(
            any(r.name.endswith(".finish") for r in recs) for recs in got.values()
        ):
            return got
        time.sleep(0.05)
    return got


def test_traced_request_has_every_rank_stage(tiny6):
    ids = list(range(3, 40))  # several chunks at the tests' chunk size
    with running(lambda: PDCluster(tiny6, 2, 3)) as c:
        _submit(c, "t", ids, TP)
        assert c.result("t").ok
        recs = _records(c)
    for (role, rank), got in recs.items():
        names = {r.name.split(".", 1)[1] for r in got}
        want = PREFILL if role == "prefill" else DECODE
        assert want <= names, f"{role} pp{rank} lacks {want - names}"
        assert all(r.rid == "t" and r.name.startswith(role + ".") for r in got)
        by_name = {r.name: r for r in got}
        for r in got:
            assert r.start_ns <= r.end_ns, r
            if r.parent:
                parent = by_name[r.parent]
                assert parent.start_ns <= r.start_ns <= r.end_ns <= parent.end_ns, (r, parent)
        if role == "prefill":
            chunks = sorted((r for r in got if r.name == "prefill.chunk"), key=lambda r: r.seq)
            assert [r.seq for r in chunks] == list(range(len(chunks)))
            assert sum(r.attrs["tokens"] for r in chunks) == len(ids)
            assert by_name["prefill.waiting"].end_ns <= chunks[0].start_ns
            assert by_name["prefill.finish"].attrs["finish_reason"] == "prefill_done"
        else:
            assert by_name["decode.first_token"].end_ns <= by_name["decode.decode"].start_ns
            assert by_name["decode.finish"].attrs["finish_reason"] == "length"
            assert [e[0] for e in by_name["decode.prealloc"].events] == ["allocated"]


def test_untraced_request_records_nothing(tiny6):
    with running(lambda: PDCluster(tiny6, 2, 2)) as c:
        _submit(c, "u", list(range(3, 20)), None)
        assert c.result("u").ok
        recs = _records(c, want_finish=False)
        assert all(not loop.spans.active for loop in c.prefill.loops + c.decode.loops)
    assert not any(recs.values())
