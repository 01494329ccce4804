"""The node's waiting queue in fair order between tenants (engine/fair_queue.py), through the real
scheduler, the wire codec and the node front's body check, and the router's part: every request it
sends names its tenant, over whatever the client wrote."""

import pytest

from pdserve.engine.batch import SampleOut
from pdserve.engine.core import Req, SamplingParams, Share
from pdserve.engine.kv_cache import PageAllocator
from pdserve.engine.scheduler import Scheduler, SchedulerConfig
from pdserve.runtime.front.prompt import RequestError, request_share
from pdserve.runtime.message_checks import MessageError
from pdserve.runtime.messages import AddRequest, decode, encode

FLOOD, VICTIM = Share("flood"), Share("victim")


def sched(max_running=64, mbt=64, chunk=64, pages=4096) -> Scheduler:
    cfg = SchedulerConfig(
        page_size=16,
        chunk_size=chunk,
        max_batch_tokens=mbt,
        max_running=max_running,
        max_context=4096,
        enable_prefix_cache=False,
    )
    return Scheduler(cfg, PageAllocator(pages))


def req(rid: str, n: int, share: Share, first: int = 1) -> Req:
    return Req(rid, [first + i % 50 for i in range(n)], SamplingParams(max_tokens=4), share=share)


def step(s: Scheduler) -> list[tuple[str, int]]:
    """One forward: what it computes for whom, then its outputs applied."""
    b = s.schedule(0)
    s.harvest(b, SampleOut([7] * sum(e.need_logits for e in b.entries)))
    s.drain_finished()
    return [(e.req.rid, e.num_new) for e in b.entries]


def admitted_order(s: Scheduler) -> list[str]:
    order = []
    while s.waiting:
        order.append(s.waiting.pop_head().rid)
    return order


def test_one_tenant_is_served_in_arrival_order():
    s = sched()
    for i, n in enumerate([300, 20, 150, 5, 600]):
        s.add(req(f"r{i}", n, FLOOD))
    assert admitted_order(s) == ["r0", "r1", "r2", "r3", "r4"]


def test_a_late_tenant_goes_before_the_flood_it_finds_queued():
    s = sched(max_running=1)
    for i in range(8):
        s.add(req(f"a{i}", 400, FLOOD))
    assert step(s) == [("a0", 64)]
    s.add(req("b0", 50, VICTIM))
    s.add(req("b1", 50, VICTIM))
    # the clock is at a0's start: the victim's two requests finish (in virtual time) before a1
    assert admitted_order(s) == ["b0", "b1", "a1", "a2", "a3", "a4", "a5", "a6", "a7"]


def test_without_the_fair_order_the_victim_would_be_last():
    """The test above fails on arrival order (the scheduler before engine/fair_queue.py): checked
    here by giving both tenants one name."""
    s = sched(max_running=1)
    for i in range(8):
        s.add(req(f"a{i}", 400, FLOOD))
    step(s)
    s.add(req("b0", 50, FLOOD))
    assert admitted_order(s)[-1] == "b0"


def test_weights_share_tokens_in_their_ratio():
    s = sched()
    heavy, light = Share("heavy", weight=3.0), Share("light", weight=1.0)
    for i in range(12):
        s.add(req(f"h{i}", 100, heavy))
        s.add(req(f"l{i}", 100, light))
    first = admitted_order(s)[:8]
    assert sum(r.startswith("h") for r in first) == 6  # 3:1


def test_priority_goes_first_whatever_the_tenant():
    s = sched()
    s.add(req("a", 10, FLOOD))
    s.add(req("b", 10, Share("victim", priority=5)))
    s.add(req("c", 2000, Share("flood", priority=-1)))
    assert admitted_order(s) == ["c", "a", "b"]


def test_a_waiting_prompt_goes_before_admitted_prompts_with_later_tags():
    """Admission order is not enough: the flood admitted before the victim came would hold the
    step's whole budget until its prompts end. Tags: a0 [0, 100], a1 [100, 1100], a2 [1100, 2100];
    b0 comes once a1 is admitted: [100, 164]."""
    s = sched(mbt=64, chunk=32)
    for rid, n in (("a0", 100), ("a1", 1000), ("a2", 1000)):
        s.add(req(rid, n, FLOOD))
    assert step(s) == [("a0", 32), ("a1", 32)]
    s.add(req("b0", 64, VICTIM))
    # admitted at once, ahead of a1 (admitted first, mid-prompt) and of a2 (queued first)
    assert step(s) == [("a0", 32), ("b0", 32)]
    assert step(s) == [("a0", 32), ("b0", 32)]
    assert step(s) == [("b0", 1), ("a0", 4), ("a1", 32), ("a2", 27)]


def test_an_aborted_waiting_request_is_not_charged_to_its_tenant():
    s = sched(max_running=1)
    s.add(req("a0", 100, FLOOD))
    s.add(req("a1", 1000, FLOOD))
    s.abort("a1")
    s.add(req("a2", 100, FLOOD))
    s.add(req("b0", 250, VICTIM))
    # a2 is tagged as if a1 had never come: [100, 200], before b0's [0, 250]; charged for a1, it
    # would be [1100, 1200], after b0
    assert admitted_order(s) == ["a0", "a2", "b0"]


def test_a_retracted_request_keeps_its_place():
    s = sched(mbt=256, chunk=256, pages=15)  # 240 tokens: two growing requests cannot both fit
    for rid in ("a0", "a1"):
        s.add(Req(rid, [3] * 100, SamplingParams(max_tokens=100, ignore_eos=True), share=FLOOD))
    step(s)
    key = s.reqs["a1"].fair_key
    s.add(req("b0", 100, VICTIM))
    for _ in range(40):
        if s.reqs["a1"].status.value == "retracted":
            break
        step(s)
    assert s.reqs["a1"].status.value == "retracted", "the pool was meant to force a retraction"
    assert s.reqs["a1"].fair_key == key  # charged once, in its old place
    keys = [r.fair_key for r in s.waiting]
    assert keys == sorted(keys) and len(keys) == 2


def test_many_tenants_do_not_grow_the_tag_map_without_bound():
    s = sched(max_running=1, pages=1 << 16)
    for i in range(5000):
        s.add(req(f"t{i}", 1, Share(f"tenant-{i}")))
        s.waiting.pop_head()
    assert len(s.waiting._finish) <= 4097


def test_the_share_crosses_the_wire_and_is_checked():
    msg = AddRequest("r", [1, 2], {}, share=Share("acme", 2.5, -3))
    assert decode(encode(msg)).share == Share("acme", 2.5, -3)
    assert decode(encode(AddRequest("r", [1], {}))).share == Share()
    wire = encode(msg)
    wire[-1] = ["acme", 0.0, 0]
    with pytest.raises(MessageError, match="tenant_weight"):
        decode(wire)
    wire[-1] = ["x" * 129, 1.0, 0]
    with pytest.raises(MessageError, match="tenant"):
        decode(wire)
    wire[-1] = ["acme", 1.0, "high"]
    with pytest.raises(MessageError):
        decode(wire)


@pytest.mark.parametrize(
    "body,field",
    [
        ({"tenant": 5}, "tenant"),
        ({"tenant": "t" * 200}, "tenant"),
        ({"tenant_weight": -1}, "tenant_weight"),
        ({"tenant_weight": float("nan")}, "tenant_weight"),
        ({"tenant_weight": True}, "tenant_weight"),
        ({"priority": 1.5}, "priority"),
        ({"priority": 2**40}, "priority"),
    ],
)
def test_the_node_front_names_a_bad_share_field(body, field):
    with pytest.raises(RequestError) as e:
        request_share(body)
    assert e.value.status == 400 and e.value.param == field


def test_the_node_front_reads_the_share():
    assert request_share({}) == Share()
    assert request_share({"tenant": "acme", "tenant_weight": 2, "priority": 1}) == Share(
        "acme", 2.0, 1
    )


def test_a_retracted_pd_decode_is_tagged_when_it_first_waits():
    """A PD decode joins running (add_prefilled), never the queue: retracted, it waits for the
    first time and is tagged then (seen failing in tests/test_inproc_pd.py before this)."""
    s = sched(pages=64)
    r = Req("d", [3] * 40, SamplingParams(max_tokens=8), output_ids=[5], share=VICTIM)
    s.add_prefilled(r, s.allocator.alloc(3), slot=0)
    s.add(req("a0", 30, FLOOD))
    s._retract(r)
    assert r.fair_key and [q.rid for q in s.waiting] == ["a0", "d"]


def capped(cap=48, **kw) -> Scheduler:
    s = sched(**kw)
    s.cfg = SchedulerConfig(**{**s.cfg.__dict__, "fair_prefill_tokens": cap})
    return s


def test_one_tenant_alone_is_not_capped():
    s = capped(mbt=256, chunk=256)
    s.add(req("a0", 200, FLOOD))
    assert step(s) == [("a0", 200)]


def test_with_another_tenant_on_the_node_a_forward_prefills_one_tenant_at_most_the_cap():
    s = capped(mbt=256, chunk=256)
    s.add(req("a0", 200, FLOOD))
    s.add(req("a1", 200, FLOOD))
    s.add(req("b0", 100, VICTIM))
    # b0's tag is smallest ([0, 100]): its prompt has the forwards to itself, 48 tokens each
    assert step(s) == [("b0", 48)]
    assert step(s) == [("b0", 48)]
    assert step(s) == [("b0", 4)]
    # b0 decodes: its steps are not prompt tokens, and the flood prefills beside them
    assert step(s) == [("b0", 1), ("a0", 48)]
    s.abort("b0")
    s.drain_finished()
    assert step(s) == [("a0", 152), ("a1", 104)]  # the victim gone: the flood has it all


def test_a_flood_prompt_with_the_earlier_tag_keeps_its_forward():
    """Fair order decides whose forward it is, not lightness: the flood's prompt tagged earlier
    than the victim's finishes first, though the victim's is the flood's second."""
    s = capped(mbt=256, chunk=256)
    s.add(req("a0", 60, FLOOD))
    assert step(s) == [("a0", 60)]
    s.add(req("a1", 100, FLOOD))  # tags [start, finish]: [60, 160] (after a0's [0, 60])
    s.add(req("b0", 200, VICTIM))  # [0, 200]: the clock is a0's start
    assert step(s)[1:] == [("a1", 48)]  # after a0's decode step
    assert step(s)[1:] == [("a1", 48)]
    assert step(s)[1:] == [("a1", 4)]
    assert step(s) == [("a1", 1), ("b0", 48)]


def test_requests_a_pd_loop_holds_count_for_the_cap():
    s = capped(mbt=256, chunk=256)
    s.add(req("a0", 200, FLOOD))
    held = [VICTIM]
    s.held_elsewhere = lambda: held
    assert step(s) == [("a0", 48)]
    held.clear()
    assert step(s) == [("a0", 152)]
