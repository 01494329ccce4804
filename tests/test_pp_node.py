"""A colocated PP node made of real processes: gloo at async depth 1, a stop string, bound cores,
two hosts, a divergence caught by the checker over gloo, rank death. The model is tiny6 (6 layers),
split evenly over PP 2 and 3 here. PP 1 to 4 (the uneven 2/2/1/1 split), async depth 1 and an
abort storm on PP 3 run in-process (tests/test_inproc_loop.py); SmolLM2's 30-layer split, 8/8/7/7
over PP 4, is split_layers' unit test in tests/test_kv_transfer_units.py."""

from __future__ import annotations

import os
import signal
import time
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from cluster import NODE_ARGS, free_port, group_alive, helper_threads, start, wait_healthy
from one_thread import hf_greedy_one_thread

from pdserve.infra.zygote import ENV as ZYGOTE_ENV

MAX_NEW = 12


@pytest.fixture(scope="module")
def reference(tiny6, mixed_prompts):
    return hf_greedy_one_thread(tiny6, mixed_prompts, MAX_NEW)


def generate_all(url: str, prompts: list[list[int]], max_new: int = MAX_NEW) -> list[list[int]]:
    def one(ids):
        r = httpx.post(
            f"{url}/generate",
            timeout=120,
            json={"input_ids": ids, "sampling_params": {"max_tokens": max_new, "ignore_eos": True}},
        )
        r.raise_for_status()
        return r.json()["token_ids"]

    with ThreadPoolExecutor(len(prompts)) as ex:
        return list(ex.map(one, prompts))


def rank_stats(url: str, settle_s: float = 3.0) -> list[dict]:
    """Per-rank stats, after the ranks had time to push fresh ones."""
    time.sleep(settle_s)
    return httpx.get(f"{url}/server_info", timeout=10).json()["ranks"]


# PP 1 to 4 (the uneven split 2/2/1/1 included) and async depth 1 run in seconds in-process
# (tests/test_inproc_loop.py, ranks as threads over the in-memory PP group); here, real processes
# over gloo at async depth 1, whose sends complete turns later, each rank bound to its own core.
@pytest.mark.parametrize("pp,depth", [(2, 1)], ids=["pp2-async1"])
def test_greedy_matches_transformers(pp, depth, tiny6, mixed_prompts, reference, tmp_path):
    port = free_port()
    cmd = [
        "serve",
        "--model",
        str(tiny6),
        "--pp",
        str(pp),
        "--port",
        str(port),
        "--async-depth",
        str(depth),
        *NODE_ARGS,
    ]
    with start(cmd, port, tmp_path / "node.log", env={"PDSERVE_RANK_CONSENSUS_CHECK": "1"}) as (
        url,
        _,
    ):
        got = generate_all(url, mixed_prompts)
        for i, (g, want) in enumerate(zip(got, reference, strict=True)):
            assert g == want, f"prompt {i} (len {len(mixed_prompts[i])}) differs from transformers"
        _check_stop_string(url, tiny6, mixed_prompts, reference)
        stats = rank_stats(url)
        _check_rank_cores(stats, pp)
        assert [s["held_pages"] for s in stats] == [0] * pp
        assert httpx.get(f"{url}/health").status_code == 200, (
            "the consensus checker or a rank failed"
        )
    assert "diverged" not in (tmp_path / "node.log").read_text()


def _check_rank_cores(stats, pp):
    """Each rank process runs on the cores the node's plan gave it (read back from /proc), and no
    two ranks share a core while the host has enough of them."""
    from pdserve.runtime.placement import plan_placement

    plan = plan_placement(pp, sorted(os.sched_getaffinity(0)), threads=1)  # NODE_ARGS: --threads 1
    got = [os.sched_getaffinity(s["pid"]) for s in sorted(stats, key=lambda s: s["pp_rank"])]
    assert got == [set(c) for c in plan.rank_cores]
    if pp <= len(os.sched_getaffinity(0)):
        assert not plan.shared and len(set().union(*got)) == pp
    # and its prefill helper runs on the plan's I/O cores, if any, at nice 19
    # (engine/kernels/spare_core.py)
    for s in stats:
        on_io = helper_threads(s["pid"], plan.io_cores) if plan.io_cores else 0
        assert on_io == (1 if plan.io_cores else 0), (s, plan)


def _check_stop_string(url, model, prompts, refs):
    """A stop string the greedy answer reaches mid-way ends it there: the ranks decode the output
    tail for the check (engine.detokenizer.StopDetokenizer, loaded on first use). The stop string is
    the text of one answer token whose first occurrence starts where that token starts."""
    from pdserve.engine.model.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    for prompt, ref in zip(prompts, refs, strict=True):
        for k in range(3, len(ref) - 2):
            head = tok.decode(ref[:k], skip_special_tokens=True)
            full = tok.decode(ref, skip_special_tokens=True)
            stop = tok.decode(ref[: k + 1], skip_special_tokens=True)[len(head) :]
            if len(stop.strip()) >= 2 and full.find(stop) == len(head):
                break
        else:
            continue
        r = httpx.post(
            f"{url}/generate",
            timeout=120,
            json={
                "input_ids": prompt,
                "sampling_params": {"max_tokens": MAX_NEW, "ignore_eos": True, "stop": [stop]},
            },
        )
        r.raise_for_status()
        got = r.json()
        assert got["meta_info"]["finish_reason"]["type"] == "stop", got
        assert got["token_ids"] == ref[: k + 1], (stop, got)
        assert got["text"] == head, (stop, got["text"], full)
        return
    raise AssertionError("no reference answer has a usable stop string")


def test_sigkill_of_a_rank_is_noticed_and_nothing_is_left(tiny6, tmp_path):
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", "3", "--port", str(port), *NODE_ARGS]
    with start(cmd, port, tmp_path / "node.log") as (url, proc):
        assert httpx.get(f"{url}/health").json()["dead"] is False
        pids = [s["pid"] for s in httpx.get(f"{url}/server_info").json()["ranks"]]
        os.kill(pids[1], signal.SIGKILL)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 30:
            if httpx.get(f"{url}/health").status_code == 503:
                break
            time.sleep(0.2)
        health = httpx.get(f"{url}/health")
        # dead, not starting: what tests/cluster.py wait_healthy stops waiting at
        assert health.status_code == 503 and health.json()["dead"] is True, health.text
        r = httpx.post(f"{url}/generate", json={"input_ids": [5, 6, 7]}, timeout=10)
        assert r.status_code == 503 and "unhealthy" in r.json()["error"]["message"]
        while time.monotonic() - t0 < 30 and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "rank processes outlived the failure"
    assert group_alive(proc.pid) == []


@pytest.mark.parametrize("own_zygote", [True, False], ids=["own-zygote", "shared-zygote"])
def test_sigterm_to_the_front_stops_the_ranks_and_leaves_no_files(tiny6, tmp_path, own_zygote):
    """`kill PID` of a node: its front stops its ranks and its zygote, removes its socket folders
    and exits 0. Before the fix uvicorn re-raised the SIGTERM under the default handler and the
    front died before it stopped anything (its own zygote's folder stayed in /tmp)."""
    port, tmp = free_port(), tmp_path / "tmp"
    tmp.mkdir()
    env = {"TMPDIR": str(tmp)}
    if own_zygote:
        env[ZYGOTE_ENV] = ""  # as a node outside the tests: it starts its own rank zygote
    cmd = ["serve", "--model", str(tiny6), "--pp", "2", "--port", str(port), *NODE_ARGS]
    with start(cmd, port, tmp_path / "node.log", env=env) as (url, proc):
        pids = [s["pid"] for s in httpx.get(f"{url}/server_info").json()["ranks"]]
        made = sorted(p.name.split("-")[1] for p in tmp.iterdir())
        assert made == (["front", "zygote"] if own_zygote else ["front"]), made
        proc.send_signal(signal.SIGTERM)  # the front alone: it must stop the rest itself
        assert proc.wait(timeout=60) == 0, (tmp_path / "node.log").read_text()[-3000:]
        assert not any(_alive(p) for p in pids), "rank processes outlived their front"
        assert group_alive(proc.pid, wait_s=0) == []
        assert list(tmp.iterdir()) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split()[2] != "Z"


def test_ranks_on_two_hosts_with_node_rank(tiny6, mixed_prompts, reference, tmp_path):
    """`--nnodes 2`: the same command on two "hosts" (here two process trees on loopback)."""
    port, dist = free_port(), free_port()
    common = [
        "serve",
        "--model",
        str(tiny6),
        "--pp",
        "2",
        "--nnodes",
        "2",
        "--dist-init-addr",
        f"127.0.0.1:{dist}",
        *NODE_ARGS,
    ]
    with (
        start(
            [*common, "--node-rank", "0", "--port", str(port)],
            port,
            tmp_path / "host0.log",
            wait=False,
        ) as (url, p0),
        start(
            [*common, "--node-rank", "1", "--port", str(free_port())],
            port,
            tmp_path / "host1.log",
            wait=False,
        ) as (_, p1),
    ):
        wait_healthy(url, p0, 120, tmp_path / "host0.log")
        assert generate_all(url, mixed_prompts[:6]) == reference[:6]
        ranks = httpx.get(f"{url}/server_info").json()["ranks"]
        assert [r["pp_rank"] for r in ranks] == [0, 1]
    assert "pp_rank 1/2 ready" in (tmp_path / "host1.log").read_text()  # host 1 ran PP1


# The test-only hook (PDSERVE_TEST_PLANT_DIVERGENCE: a rank-local allocation on PP1) with the rank
# consensus checker on: the real ranks' gloo comparison finds it and the node stops. The same
# divergence in-process: tests/test_inproc_loop.py; the hook without the checker: below.
PLANTED = {"PDSERVE_RANK_CONSENSUS_CHECK": "1", "PDSERVE_TEST_PLANT_DIVERGENCE": "1"}


def test_planted_divergence_is_caught(tiny6, mixed_prompts, tmp_path):
    port = free_port()
    cmd = ["serve", "--model", str(tiny6), "--pp", "2", "--port", str(port), *NODE_ARGS]
    divergence_stops_the_node(cmd, port, tmp_path / "node.log", PLANTED, mixed_prompts[:2])


def divergence_stops_the_node(cmd, port, log_path, env, prompts) -> str:
    """Starts the node with a planted divergence (`env`), sends `prompts`: their requests fail,
    the node turns unhealthy, and its log names the first diverging call. Returns the log."""
    with start(cmd, port, log_path, env=env) as (url, _):
        with pytest.raises(httpx.HTTPError):
            generate_all(url, prompts)
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").status_code == 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert httpx.get(f"{url}/health").status_code == 503
    log = log_path.read_text()  # the rank logs the failure before it stops
    assert "rank consensus check FAILED" in log
    assert "first diverging call" in log and "'schedule'" in log, log[-3000:]
    return log


@pytest.mark.parametrize("checker_on", [False, True])
def test_planted_divergence_needs_the_checker(checker_on, monkeypatch):
    """The hook plants nothing unless the consensus checker is on too (which stops the node at
    once): the variable alone can never make a node hand out different pages."""
    from pdserve.consensus import rank_checker
    from pdserve.engine.kv_cache import PageAllocator
    from pdserve.runtime.rank.process import plant_divergence_if_asked
    from pdserve.runtime.rank_spec import RankSpec

    monkeypatch.setenv("PDSERVE_TEST_PLANT_DIVERGENCE", "1")
    monkeypatch.setattr(rank_checker, "ENABLED", checker_on)
    pool = types.SimpleNamespace(allocator=PageAllocator(8))
    for rank in (0, 1):
        spec = RankSpec(model="m", engine={}, pp_size=2, pp_rank=rank, dist_init="")
        plant_divergence_if_asked(spec, types.SimpleNamespace(pool=pool))
    assert pool.allocator.num_free == (7 if checker_on else 8)  # PP1 only, checked only
