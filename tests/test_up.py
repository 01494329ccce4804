"""A cluster started the way `pdserve up` starts it, driven by the official openai SDK."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest
from cluster import (
    ROOT,
    ClusterAuth,
    free_port,
    group_alive,
    launched,
    node_args,
    secret_auth,
    secret_of,
)
from metrics_scrape import family_names, parse, scrape, total, values
from reference import hf_greedy, load_hf

NODE_ARGS = " ".join(node_args(max_running=None))
MAX_NEW = 12
ROUTER_ARGS = "--max-concurrent 24 --max-queue 8 --health-interval 1 --health-failure-threshold 2"
# One client for the many short calls: a module-level httpx call builds a client (and its TLS
# context) of its own each time. No keep-alive: every call still opens its own connection.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


@pytest.fixture(scope="module", autouse=True)
def _close_http():
    yield
    HTTP.close()


@pytest.fixture(scope="module")
def launches(tiny30, tmp_path_factory):
    """Both clusters of this file, started at once: the main one (`pdserve up` with 1 prefill node
    (PP 2) and 2 decode nodes (PP 2), small admission limits) and the two-model one of
    test_up_serves_several_models_each_on_its_own_nodes; the transformers reference of the chat
    tests is computed while they load."""
    tmp = tmp_path_factory.mktemp("up")
    from tiny_model import build_tiny_model

    paths = [build_tiny_model(tmp / name, num_layers=2, seed=5) for name in ("tiny-x", "tiny-y")]
    port, multi_port = free_port(), free_port()
    args = ["--model", str(tiny30), "--port", str(port)]
    args += ["--prefill-pp", "2", "--decode-pp", "2", "--decode-nodes", "2"]
    args += ["--node-args", NODE_ARGS, "--router-args", ROUTER_ARGS]
    multi = ["--model", str(paths[0]), "--model", str(paths[1]), "--port", str(multi_port)]
    with (
        launched(args, tmp / "up.log") as main,
        launched([*multi, "--node-args", NODE_ARGS], tmp / "multi.log") as several,
    ):
        yield {
            "main": (f"http://127.0.0.1:{port}", main),
            "several": (f"http://127.0.0.1:{multi_port}", several),
            "reference": _chat_reference(tiny30),
        }


@pytest.fixture(scope="module")
def cluster(launches):
    url, launch = launches["main"]
    proc = launch.ready(timeout=420)  # a bound, not a speed check: two clusters load at once
    AUTH.secret = secret_of(launch.log)
    return url, proc, launch.log


@pytest.fixture(scope="module")
def chat_reference(launches):
    return launches["reference"]


def _chat_reference(tiny30) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny30))
    model = load_hf(tiny30)
    eos = tok.eos_token_id
    out = {}
    for q in ["the cache page", "prefill decode rank", "router slot layer token"]:
        text = tok.apply_chat_template(
            [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        toks = hf_greedy(model, [ids], MAX_NEW)[0]
        if eos in toks:
            toks = toks[: toks.index(eos) + 1]
        out[q] = (len(ids), toks, tok.decode(toks, skip_special_tokens=True))
    return out


def model_name(url: str) -> str:
    return HTTP.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_up_serves_several_models_each_on_its_own_nodes(launches):
    """`pdserve up --model A --model B`: a prefill and a decode node per model behind one router,
    which routes each request to the nodes of its model. Runs first: its cluster (started with the
    main one, see `launches`) is stopped before the main cluster's tests."""
    url, launch = launches["several"]
    try:
        proc, log = launch.ready(timeout=420), launch.log
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["tiny-x", "tiny-y"]
        workers = HTTP.get(f"{url}/workers", auth=secret_auth(log)).json()["workers"]
        assert sorted((w["role"], w["model"]) for w in workers) == [
            ("decode", "tiny-x"),
            ("decode", "tiny-y"),
            ("prefill", "tiny-x"),
            ("prefill", "tiny-y"),
        ]
        for name, n in (("tiny-x", 2), ("tiny-y", 3)):
            for i in range(n):
                out = client.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": f"hi {i}"}],
                    max_tokens=3,
                    temperature=0,
                )
                assert out.model == name and out.usage.completion_tokens >= 1
        want = {(w["role"], w["model"]): 2 if w["model"] == "tiny-x" else 3 for w in workers}
        deadline = time.monotonic() + 30  # a prefill node may count its part just after the answer
        while True:
            got = {(w["role"], w["model"]): _finished(w["url"]) for w in workers}
            if got == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert got == want, "each model's requests reached only its own nodes"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
        assert group_alive(proc.pid) == [], "processes left behind after Ctrl-C"
    finally:
        launch.stop()


def test_ready_line_and_models(cluster):
    url, _, log = cluster
    text = log.read_text()
    assert "curl " in text and "/v1/chat/completions" in text
    assert model_name(url)


def test_ranks_run_on_the_cores_the_plan_printed(cluster):
    """Every rank process runs on the cores `up` printed for it, and every front on the cores
    printed for the fronts (read back from /proc). With no core left over for I/O (here: 6 ranks
    on the host's cores, or fewer cores), the decode ranks come first in the plan: the last core,
    which the fronts, the router and clients share, gets a prefill rank before any decode rank
    does, and the fronts are bound there."""
    url, _, log = cluster
    line = next(x for x in log.read_text().splitlines() if "placement:" in x)
    plan = re.findall(r"((prefill|decode)-\d+ pp(\d+)) -> cores? (\d+(?:,\d+)*)", line)
    assert len(plan) == 6, line
    if "none left over" in line:
        assert [role for _, role, _, _ in plan[:4]] == ["decode"] * 4, line
    want: dict[tuple[str, int], list[set[int]]] = {}
    for _, role, pp, cores in plan:
        want.setdefault((role, int(pp)), []).append({int(c) for c in cores.split(",")})
    got: dict[tuple[str, int], list[set[int]]] = {}
    for role, nodes in node_urls(url).items():
        for node in nodes:
            for st in HTTP.get(f"{node}/server_info", auth=AUTH).json()["ranks"]:
                cores = os.sched_getaffinity(st["pid"])
                got.setdefault((role, st["pp_rank"]), []).append(cores)
    assert _core_sets(got) == _core_sets(want), line
    # the fronts (and the router, bound with the launcher) run on the cores printed for them
    fronts = re.search(r"fronts/router -> cores? (\d+(?:,\d+)*)", line)
    assert fronts, line  # never left to float
    want_fronts = {int(c) for c in fronts.group(1).split(",")}
    for nodes in node_urls(url).values():
        for node in nodes:
            pid = HTTP.get(f"{node}/server_info", auth=AUTH).json()["pid"]
            assert os.sched_getaffinity(pid) == want_fronts, (node, line)


def _core_sets(by_rank: dict[tuple[str, int], list[set[int]]]) -> dict:
    """(role, pp rank) -> the core sets of those ranks, in a comparable order."""
    return {k: sorted(sorted(c) for c in v) for k, v in by_rank.items()}


def test_openai_sdk_sync_and_async_match_transformers(cluster, chat_reference):
    url, _, _ = cluster
    name = model_name(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    for q, (n_prompt, toks, text) in chat_reference.items():
        msgs = [{"role": "user", "content": q}]
        r = client.chat.completions.create(
            model=name, messages=msgs, max_tokens=MAX_NEW, temperature=0
        )
        assert r.choices[0].message.content == text, q
        assert r.usage.prompt_tokens == n_prompt and r.usage.completion_tokens == len(toks)
        assert r.usage.total_tokens == n_prompt + len(toks)
        stream = client.chat.completions.create(
            model=name,
            messages=msgs,
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
            if chunk.usage:
                usage = chunk.usage
        assert "".join(parts) == text and usage.completion_tokens == len(toks)

    async def run_async():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
        qs = list(chat_reference)
        rs = await asyncio.gather(
            *(
                ac.chat.completions.create(
                    model=name,
                    messages=[{"role": "user", "content": q}],
                    max_tokens=MAX_NEW,
                    temperature=0,
                )
                for q in qs
            )
        )
        for q, r in zip(qs, rs, strict=True):
            assert r.choices[0].message.content == chat_reference[q][2]
        s = await ac.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": qs[0]}],
            max_tokens=MAX_NEW,
            temperature=0,
            stream=True,
        )
        text = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
        assert text == chat_reference[qs[0]][2]
        await ac.close()

    asyncio.run(run_async())


def test_readme_curl_works_through_the_router(cluster):
    """The curl line `pdserve up` prints (the README's) answers, with no secret of any kind."""
    url, _, log = cluster
    cmd = re.search(r"  (curl .*?\}')\n", log.read_text(), re.S).group(1).replace("\\\n", " ")
    out = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and json.loads(out.stdout)["choices"][0]["finish_reason"] in (
        "stop",
        "length",
    ), out


def test_every_node_requires_the_generated_secret(cluster):
    url, proc, log = cluster
    auth = secret_auth(log)
    assert HTTP.get(f"{url}/workers").status_code == 401
    workers = HTTP.get(f"{url}/workers", auth=auth).json()["workers"]
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    for w in workers:
        node = w["url"]
        assert (
            HTTP.post(
                f"{node}/generate", json={"input_ids": [1, 2], "bootstrap_room": 1}
            ).status_code
            == 401
        )
        assert HTTP.post(f"{node}/abort", json={"rid": "x"}).status_code == 401
        assert HTTP.get(f"{node}/server_info").status_code == 401
        assert HTTP.get(f"{node}/server_info", auth=auth).status_code == 200
        if w["role"] == "prefill":
            boot = f"http://127.0.0.1:{w['bootstrap_port']}"
            assert HTTP.put(f"{boot}/route", json={}).status_code == 401
            assert (
                HTTP.post(f"{boot}/heartbeat", json={"session": "s", "peers": []}).status_code
                == 401
            )
        else:
            assert HTTP.put(f"{node}/bootstrap_servers", json={"servers": []}).status_code == 401


def test_every_process_listens_on_loopback_only(cluster):
    """A local cluster (the router on 127.0.0.1): every listening socket of every one of its
    processes (router, fronts and their ZMQ links, bootstrap server, ranks: KV data ports, KV
    control, the PP rendezvous and gloo) is on loopback (docs/SECURITY.md)."""
    _, proc, _ = cluster
    root = psutil.Process(proc.pid)
    listening: dict[tuple[int, str, int], str] = {}
    for p in [root, *root.children(recursive=True)]:
        try:
            conns, cmd = p.net_connections(kind="inet"), " ".join(p.cmdline()[2:4])
        except psutil.NoSuchProcess:
            continue
        for c in conns:
            if c.status == psutil.CONN_LISTEN:
                listening[(p.pid, c.laddr.ip, c.laddr.port)] = cmd
    # the router, 3 fronts and 6 ranks (prefill PP 2, two decode nodes PP 2) each listen
    assert len({pid for pid, _, _ in listening}) >= 10, listening
    wide = [
        f"{cmd} (pid {pid}) on {ip}:{port}"
        for (pid, ip, port), cmd in sorted(listening.items())
        if not ipaddress.ip_address(ip).is_loopback
    ]
    assert not wide, "listening beyond loopback:\n" + "\n".join(wide)


def test_the_secret_is_on_no_command_line(cluster):
    """Every process of the cluster (launcher, router, fronts, ranks): its command line, which any
    local user can read in `ps`, does not hold the secret."""
    _, proc, log = cluster
    secret = secret_of(log).encode()
    pids = group_alive(proc.pid, wait_s=0)
    assert len(pids) >= 7
    for pid in pids:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret not in f.read(), pid


def test_sse_ends_with_done_and_completions_work(cluster):
    url, _, _ = cluster
    name = model_name(url)
    with httpx.stream(
        "POST",
        f"{url}/v1/completions",
        timeout=60,
        json={"model": name, "prompt": "the cache", "max_tokens": 5, "stream": True},
    ) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    r = HTTP.post(
        f"{url}/v1/completions",
        timeout=60,
        json={"model": name, "prompt": "the cache", "max_tokens": 5},
    )
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


AUTH = ClusterAuth()  # signs with the cluster secret, read by the fixture


def node_urls(url: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for w in HTTP.get(f"{url}/workers", auth=AUTH).json()["workers"]:
        out.setdefault(w["role"], []).append(w["url"])
    return out


def pages(node: str) -> list[int]:
    return [s["held_pages"] for s in HTTP.get(f"{node}/server_info", auth=AUTH).json()["ranks"]]


def _serve_one_chat(url: str, name: str) -> str:
    """Sends one short chat request through the router; returns its id."""
    r = HTTP.post(
        f"{url}/v1/chat/completions",
        json={
            "model": name,
            "messages": [{"role": "user", "content": "the page"}],
            "max_tokens": 4,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    return r.json()["id"]


def _check_dashboard(driver, url: str, secret: str, rid: str, tmp_path: Path) -> None:
    """In the browser: every worker with its ranks, then request `rid`'s stage waterfall; saves a
    screenshot into PDSERVE_ARTIFACTS (default: `tmp_path`)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.set_page_load_timeout(30)
    driver.get(f"{url}/dashboard#token={secret}")
    wait = WebDriverWait(driver, 30)
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "tr.worker")) == 3)
    roles = sorted(
        e.get_attribute("data-role") for e in driver.find_elements(By.CSS_SELECTOR, "tr.worker")
    )
    assert roles == ["decode", "decode", "prefill"]
    assert "pp1:" in driver.find_element(By.ID, "workers").text  # every node has 2 ranks
    assert secret not in driver.current_url  # the token left the address bar
    summary = "details.request[data-id] summary"
    wait.until(
        lambda d: any(
            rid.split("-", 1)[1] in e.text for e in d.find_elements(By.CSS_SELECTOR, summary)
        )
    )
    req = next(
        e
        for e in driver.find_elements(By.CSS_SELECTOR, "details.request")
        if rid.split("-", 1)[1] in e.find_element(By.TAG_NAME, "summary").text
    )
    if req.get_attribute("open") is None:
        req.find_element(By.TAG_NAME, "summary").click()
    wait.until(lambda d: len(req.find_elements(By.CSS_SELECTOR, "tr.stage")) >= 5)
    stages = req.text
    for service in ("router", "prefill", "decode"):
        assert service in stages, stages
    out = Path(os.environ.get("PDSERVE_ARTIFACTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(out / "dashboard.png"))


def test_status_page_in_a_real_browser(cluster, tmp_path):
    """Issue #20: /dashboard in headless chromium (selenium) shows every worker with its ranks' KV
    pools, and a request just served with its stage waterfall across the router and both nodes.
    The screenshot is kept in PDSERVE_ARTIFACTS (default: the test's tmp folder)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    url, _, _ = cluster
    name = model_name(url)
    rid = _serve_one_chat(url, name)
    secret = AUTH.secret
    opts = webdriver.ChromeOptions()
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--window-size=1400,1000",
    ):
        opts.add_argument(arg)
    opts.binary_location = "/usr/bin/chromium"
    driver = webdriver.Chrome(options=opts, service=Service("/usr/bin/chromedriver"))
    try:
        _check_dashboard(driver, url, secret, rid, tmp_path)
    finally:
        driver.quit()


def test_client_disconnect_frees_kv_on_both_nodes(cluster):
    url, _, _ = cluster
    name = model_name(url)
    with httpx.stream(
        "POST",
        f"{url}/v1/chat/completions",
        timeout=60,
        json={
            "model": name,
            "messages": [{"role": "user", "content": "the page " * 30}],
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        n = 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n >= 4:
                break
    nodes = node_urls(url)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        held = {n: pages(n) for role in ("prefill", "decode") for n in nodes[role]}
        if not any(any(v) for v in held.values()):
            break
        time.sleep(0.5)
    assert not any(any(v) for v in held.values()), held


def test_bad_inputs_get_4xx_and_the_router_stays_up(cluster):
    url, _, _ = cluster
    name = model_name(url)
    cases = [
        (b"{not json", 400),
        (json.dumps({"model": name, "messages": []}).encode(), 400),
        (
            json.dumps({"model": "nope", "messages": [{"role": "user", "content": "x"}]}).encode(),
            404,
        ),
        (
            json.dumps(
                {"model": name, "messages": [{"role": "user", "content": "x"}], "n": 17}
            ).encode(),
            400,
        ),
        (
            json.dumps(
                {"model": name, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}
            ).encode(),
            400,
        ),
        (
            json.dumps(
                {
                    "model": name,
                    "messages": [{"role": "user", "content": "x"}],
                    "temperature": "hot",
                }
            ).encode(),
            400,
        ),
        (
            json.dumps(
                {"model": name, "messages": [{"role": "user", "content": "the " * 3000}]}
            ).encode(),
            400,
        ),
    ]
    for raw, want in cases:
        r = HTTP.post(
            f"{url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
        )
        assert r.status_code == want, (raw[:80], r.status_code, r.text)
        assert "error" in r.json() and r.json()["error"]["message"]
    assert HTTP.get(f"{url}/health").status_code == 200


def test_429_under_saturation(cluster):
    url, _, _ = cluster
    name = model_name(url)

    async def flood():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [
                c.post(
                    f"{url}/v1/chat/completions",
                    json={
                        "model": name,
                        "messages": [{"role": "user", "content": f"load {i}"}],
                        "max_tokens": 30,
                        "ignore_eos": True,
                    },
                )
                for i in range(64)
            ]
            return await asyncio.gather(*reqs)

    res = asyncio.run(flood())
    codes = [r.status_code for r in res]
    assert 429 in codes and 200 in codes, codes
    r429 = next(r for r in res if r.status_code == 429)
    assert int(r429.headers["retry-after"]) >= 1


async def _streams(url: str, n: int, max_new: int) -> list[list[int]]:
    async def one(c: httpx.AsyncClient, i: int) -> list[int]:
        body = {"input_ids": [3 + i, 7, 11 + i, 19], "stream": True,
                "sampling_params": {"max_tokens": max_new, "ignore_eos": True}}  # fmt: skip
        toks = []
        async with c.stream("POST", f"{url}/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    toks.extend(event["token_ids"])
        return toks

    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(one(c, i) for i in range(n)))


def test_the_zygote_killed_under_load_costs_no_rank(cluster):
    """SIGKILL of the cluster's rank zygote (the one process that forked every rank) while six
    streams run: no rank dies with it, every stream ends whole and exact, every node stays
    healthy. The ranks die with their node instead (the test's teardown finds none left)."""
    url, proc, _ = cluster
    zygote = next(
        c for c in psutil.Process(proc.pid).children() if "pdserve.infra.zygote" in c.cmdline()
    )
    ranks = [c for c in zygote.children() if c.is_running()]
    assert ranks, "the zygote forked no rank"
    want = asyncio.run(_streams(url, 6, 48))

    async def during() -> list[list[int]]:
        task = asyncio.create_task(_streams(url, 6, 48))
        await asyncio.sleep(0.3)
        zygote.send_signal(signal.SIGKILL)
        return await task

    assert asyncio.run(during()) == want
    deadline = time.monotonic() + 10
    while zygote.is_running() and zygote.status() != psutil.STATUS_ZOMBIE:  # `up` reaps it at exit
        assert time.monotonic() < deadline, "the zygote outlived its SIGKILL"
        time.sleep(0.05)
    assert all(r.is_running() and r.status() != psutil.STATUS_ZOMBIE for r in ranks)
    for node in (n for urls in node_urls(url).values() for n in urls):
        assert HTTP.get(f"{node}/health", auth=AUTH, timeout=5).status_code == 200, node
    assert asyncio.run(_streams(url, 2, 8)) == [w[:8] for w in want[:2]]


def test_one_decode_node_killed_requests_keep_succeeding(cluster):
    url, _, _ = cluster
    name = model_name(url)
    decodes = node_urls(url)["decode"]
    victim = HTTP.get(f"{decodes[0]}/server_info", auth=AUTH).json()["pid"]
    os.kill(victim, signal.SIGKILL)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
    ok = 0
    for i in range(8):
        r = client.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": f"q {i}"}],
            max_tokens=4,
            temperature=0,
        )
        ok += bool(r.choices[0].message.content is not None)
    assert ok == 8
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        ws = {w["url"]: w for w in HTTP.get(f"{url}/workers", auth=AUTH).json()["workers"]}
        if not ws[decodes[0]]["healthy"]:
            break
        time.sleep(0.5)
    assert not ws[decodes[0]]["healthy"]


def _healthy(node: str) -> bool:
    try:
        return HTTP.get(f"{node}/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False  # the decode node the test above killed


def test_metrics_of_router_and_nodes(cluster):
    """Every metric in deploy/metrics.txt is exported by the live cluster, they moved with the
    traffic above, and the pool is empty when idle."""

    url, _, _ = cluster
    expected = [
        ln.strip()
        for ln in (ROOT / "deploy" / "metrics.txt").read_text().splitlines()
        if ln.strip()
    ]
    nodes = node_urls(url)
    live = [n for n in nodes["prefill"] + nodes["decode"] if _healthy(n)]
    families: set[str] = set()
    samples = {}
    for target in [url, *live]:
        text = HTTP.get(f"{target}/metrics").text
        families |= family_names(text)
        samples[target] = parse(text)
    names = families | {f + "_total" for f in families}
    missing = [m for m in expected if m not in names]
    assert not missing, f"not exported: {missing}"
    prefill, decode = nodes["prefill"][0], live[-1]
    assert total(samples[decode], "pdserve_generation_tokens_total") > 0
    assert total(samples[prefill], "pdserve_kv_transfer_bytes_total") > 0
    assert total(samples[decode], "pdserve_kv_transfer_bytes_total") > 0
    assert total(samples[prefill], "pdserve_bootstrap_seconds_count") > 0
    assert total(samples[decode], "pdserve_queue_time_seconds_count") > 0
    assert total(samples[prefill], "pdserve_consensus_round_seconds_count") > 0
    assert total(samples[url], "pdserve_router_requests_total") > 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        used = {n: values(scrape(n, timeout=5), "pdserve_kv_pool_used_tokens") for n in live}
        if all(v and not any(v) for v in used.values()):
            break
        time.sleep(0.5)
    assert all(v and not any(v) for v in used.values()), used


def test_prefill_node_killed_every_request_is_answered_by_decode(cluster, chat_reference):
    """Issue #18: the only prefill node is SIGKILLed while 16 requests are in flight, and 16 more
    come after. Every one is answered (by the decode nodes alone once the prefill leg fails or the
    node is gone), token-identical to transformers, and the decode-only routes are counted."""
    url, _, _ = cluster
    name = model_name(url)
    before = total(scrape(url), "pdserve_router_route_decisions_total", path="decode_only")
    prefill = node_urls(url)["prefill"][0]
    victim = HTTP.get(f"{prefill}/server_info", auth=AUTH).json()["pid"]
    qs = list(chat_reference)

    async def ask(ac, i):
        q = qs[i % len(qs)]
        r = await ac.chat.completions.create(
            model=name, messages=[{"role": "user", "content": q}], max_tokens=MAX_NEW, temperature=0
        )
        return q, r.choices[0].message.content

    async def run():
        ac = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
        first = [asyncio.create_task(ask(ac, i)) for i in range(16)]
        await asyncio.sleep(0.3)
        os.kill(victim, signal.SIGKILL)
        done = await asyncio.gather(*first)
        return done + list(await asyncio.gather(*(ask(ac, i) for i in range(16, 32))))

    for q, text in asyncio.run(run()):
        assert text == chat_reference[q][2], q
    after = total(scrape(url), "pdserve_router_route_decisions_total", path="decode_only")
    assert after >= before + 16, (before, after)


def test_ctrl_c_stops_every_process(cluster):
    """Runs last: SIGINT to `pdserve up` stops the router, the nodes and every rank."""
    url, proc, log = cluster
    # up, router, one decode front and its 2 ranks (a decode node and the prefill node were killed)
    assert len(group_alive(proc.pid, wait_s=0)) >= 5
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) == 0, log.read_text()[-2000:]
    assert group_alive(proc.pid) == [], "processes left behind after Ctrl-C"
    assert "[up] stopping" in log.read_text()


def test_free_port_stays_out_of_the_ephemeral_range():
    """The ports `pdserve up` (and the tests) give their servers: bindable, and never in the range
    the kernel hands out as local ports of outgoing connections, where another process's connect
    can take the port between the pick and the server's bind."""
    import socket

    from pdserve.infra.procs import PORTS_FROM, _ephemeral_start

    start = _ephemeral_start()
    for port in [free_port() for _ in range(50)]:
        assert PORTS_FROM <= port < start, (port, start)
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def _finished(node: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        smp.value
        for fam in text_string_to_metric_families(HTTP.get(f"{node}/metrics").text)
        if fam.name == "pdserve_requests"
        for smp in fam.samples
        if smp.name == "pdserve_requests_total"
    )
