"""A fresh `pdserve up` cluster, observed (docs/METRICS.md, infra/logs.py): every metric the Grafana
dashboard queries is exported before the first request, and the log of a healthy start plus ten
requests is one line per node and rank, the ready lines, and nothing else: no warning or error
(Mooncake's included), no line per health probe or request."""

from __future__ import annotations

import re
import time

import httpx
import pytest
from cluster import up
from prometheus_client.parser import text_string_to_metric_families
from test_deploy import dashboard_exprs, metric_names, metrics_list

from pdserve.kv_transfer.stats import DROP_REASONS, RECEIVER_FAILURES, SENDER_FAILURES
from pdserve.runtime.reasons import ABORT_REASONS

NODE_ARGS = "--page-size 4 --max-total-tokens 4096 --threads 1"


@pytest.fixture(scope="module")
def fresh(tiny6, tmp_path_factory):
    """Router, a prefill node and a decode node (PP 1 each), probing every second."""
    log = tmp_path_factory.mktemp("obs") / "up.log"
    args = ["--node-args", NODE_ARGS, "--router-args", "--health-interval 1"]
    with up(tiny6, log, args) as (url, _, auth):
        workers = httpx.get(f"{url}/workers", auth=auth, timeout=10).json()["workers"]
        yield url, {w["role"]: w["url"] for w in workers}, log, auth


def scrape(url: str) -> dict[str, list]:
    """Family name (counters with `_total`) -> its samples."""
    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam.samples
    return out


def labels_of(samples: list, name: str, key: str, **where) -> set[str]:
    return {
        s.labels[key]
        for s in samples
        if s.name == name and all(s.labels.get(k) == v for k, v in where.items())
    }


def test_a_fresh_cluster_exports_every_dashboard_metric_before_any_request(fresh):
    url, nodes, _, _ = fresh
    families = {"router": scrape(url), **{role: scrape(u) for role, u in nodes.items()}}
    # with a series (a histogram: its buckets), not just a HELP line
    with_series = {name for fams in families.values() for name, s in fams.items() if s}
    used = set().union(*map(metric_names, dashboard_exprs()))
    missing = sorted(used - with_series)
    assert not missing, f"the dashboard queries {missing}, not exported before the first request"
    missing = sorted(set(metrics_list()) - with_series)
    assert not missing, f"deploy/metrics.txt lists {missing}, not exported before the first request"
    # the label sets known in advance, at 0
    for role in ("prefill", "decode"):
        fam = families[role]
        name = "pdserve_requests_aborted_total"
        assert labels_of(fam[name], name, "reason") == ABORT_REASONS, role
        drops = labels_of(
            fam["pdserve_control_messages_dropped_total"],
            "pdserve_control_messages_dropped_total",
            "reason",
            channel="kv-control",
            pp_rank="0",
        )
        assert drops == set(DROP_REASONS), (role, drops)
    for role, reasons in (("prefill", SENDER_FAILURES), ("decode", RECEIVER_FAILURES)):
        fam = families[role]["pdserve_kv_transfer_failures_total"]
        assert labels_of(fam, "pdserve_kv_transfer_failures_total", "reason") == set(reasons)
    name = "pdserve_requests_total"
    assert labels_of(families["decode"][name], name, "finish_reason") == {"stop", "length", "abort"}
    states = labels_of(
        families["router"]["pdserve_router_circuit_state"], "pdserve_router_circuit_state", "state"
    )
    assert states == {"closed", "open", "half_open"}
    model = families["decode"]["pdserve_model_info"][0].labels
    served = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    assert model["model"] == served and model["dtype"] == "float32"


# What a healthy log must not hold: Python warnings and errors (text format), glog's W/E/F lines,
# tracebacks, and any line per request or probe (httpx, uvicorn's access log).
NOISE = re.compile(
    r" (WARNING|ERROR|CRITICAL) |^[WEF]\d{4} |Traceback|HTTP Request:|\"(GET|POST|PUT) /|^INFO: "
)


def test_a_healthy_start_and_ten_requests_log_only_the_start_up_lines(fresh):
    url, nodes, log, auth = fresh
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    with httpx.Client(base_url=url, timeout=60) as c:
        for i in range(10):
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"the cache page {i}"}],
                "max_tokens": 6,
                "stream": i % 2 == 1,
            }
            r = c.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text

        # three more health-probe rounds of every worker, logged or not
        def workers() -> list[dict]:
            return c.get("/workers", auth=auth).json()["workers"]

        probed = {w["url"]: w["good_probes"] for w in workers()}
        deadline = time.monotonic() + 60
        while any(w["good_probes"] < probed[w["url"]] + 3 for w in workers()):
            assert time.monotonic() < deadline, "the router stopped probing its workers"
            time.sleep(0.1)
    text = log.read_text()
    noise = [ln for ln in text.splitlines() if NOISE.search(ln)]
    assert not noise, "\n".join(noise)
    starts = [ln for ln in text.splitlines() if not ln.startswith(" ")]  # the curl lines
    assert sum("prefill node front on" in ln for ln in starts) == 1
    assert sum("decode node front on" in ln for ln in starts) == 1
    assert sum(re.search(r"pp_rank 0/1 ready: layers", ln) is not None for ln in starts) == 2
    assert sum("router ready" in ln for ln in starts) == 1
    assert starts[-1].startswith("[up] ready: "), starts[-3:]
    others = [
        ln
        for ln in starts
        if not re.search(r"node front on|pp_rank \d+/\d+ ready|router ready|^\[up\] ", ln)
    ]
    assert not others, "\n".join(others)
