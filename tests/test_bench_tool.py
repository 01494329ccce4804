"""`pdserve bench` against a real `pdserve up` cluster on the tiny model, cross-checked with aiperf.

The cluster is started once (1 prefill + 1 decode node, PP 1 each, for each of its two models: tiny6
and the slower wide8 of the ITL cross-check; an API key so every run also checks the Bearer token);
the two tests that need none run first, while it loads. Each test runs the real command as a
subprocess and reads its JSON.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from itertools import pairwise
from pathlib import Path

import httpx
import pytest
from cluster import ROOT, free_port, kill_group, launched, node_args
from tiny_model import build_tiny_model

KEY = "bench-test-key"
NODE_ARGS = " ".join(node_args(chunk_size=32, max_batch_tokens=128, max_running=None))
AIPERF_VERSION = "0.13.0"


@pytest.fixture(scope="module")
def wide8(tmp_path_factory):
    """The model of the ITL cross-check: tiny6's tokenizer, 8 layers of hidden 512 (123 MB of fp32
    weights, built in under a second), so that a decode step really takes the server about 15 ms
    here (tiny6: about 1 ms), long next to a busy client's jitter. Its id (its folder's name) sorts
    after tiny6's, so tiny6 stays the cluster's first model, the one `pdserve bench` and aiperf
    default to."""
    return build_tiny_model(
        tmp_path_factory.mktemp("wide8"),
        num_layers=8,
        hidden=512,
        heads=8,
        kv_heads=2,
        intermediate=2048,
        seed=1,
    )


@pytest.fixture(scope="module", autouse=True)
def launch(tiny6, wide8, tmp_path_factory):
    """The cluster, started with the module's first test: the tests that need none run first,
    while it loads. wide8 is a second model of the same cluster (its own prefill and decode node,
    the router picks them by the request's model): cheaper than a cluster of its own, and its
    idle ranks poll at most every 250 ms (runtime/rank/idle_wait.py)."""
    port = free_port()
    log = tmp_path_factory.mktemp("bench_up") / "up.log"
    args = [
        "--model",
        str(tiny6),
        "--model",
        str(wide8),
        "--port",
        str(port),
        "--prefill-pp",
        "1",
        "--decode-pp",
        "1",
        "--api-key",
        KEY,
        "--node-args",
        NODE_ARGS,
    ]
    with launched(args, log) as up:
        yield f"http://127.0.0.1:{port}", up


@pytest.fixture(scope="module")
def cluster(launch):
    url, up = launch
    up.ready(timeout=420)  # a bound, not a speed check (shared cores can be busy)
    return url


def model_ids(url: str) -> list[str]:
    r = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return [m["id"] for m in r.json()["data"]]


def bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "bench", "--no-progress", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_json(url: str, out: Path, *args: str) -> dict:
    r = bench("--url", url, "--api-key", KEY, "--output", str(out), *args)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(out.read_text())


def ordered(d: dict) -> bool:
    return (
        d["count"] > 0
        and d["min"] <= d["p50"] <= d["p90"] <= d["p99"] <= d["max"]
        and d["min"] <= d["mean"] <= d["max"]
    )


def test_bad_url_fails_fast_with_a_clear_error():
    port = free_port()  # nothing listens there; the run must end by itself within the timeout
    r = bench("--url", f"http://127.0.0.1:{port}", "--num-requests", "2", timeout=180)
    assert r.returncode == 2, r.stdout + r.stderr
    assert (
        f"cannot reach the server at http://127.0.0.1:{port}" in r.stderr
        and "Traceback" not in r.stderr
    )


def test_workload_is_seeded_and_lengths_are_exact(tiny6):
    from pdserve.bench.workload import LengthDist, TokenCounter, Workload

    tok = TokenCounter(str(tiny6))
    isl, osl = LengthDist.parse("--isl", "normal:30,10"), LengthDist.parse("--osl", "uniform:2,9")

    def prompts(seed: int, key: str = "load0", tokenizer=tok) -> list:
        return Workload(isl=isl, osl=osl, seed=seed, tokenizer=tokenizer).requests(12, key)

    a = prompts(0)
    assert a == prompts(0)
    assert [r.prompt for r in a] != [r.prompt for r in prompts(1)]
    assert [r.prompt for r in a] != [r.prompt for r in prompts(0, "load1")]
    assert [r.prompt for r in prompts(5, tokenizer=None)] == [
        r.prompt for r in prompts(5, tokenizer=None)
    ]
    for r in a:
        assert tok.count(r.prompt) == r.prompt_tokens and isl.lo <= r.prompt_tokens <= isl.hi
        assert 2 <= r.max_tokens <= 9
    assert len({r.prompt_tokens for r in a}) > 3 and len({r.max_tokens for r in a}) > 2
    words = prompts(0, tokenizer=None)
    assert all(len(r.prompt.split()) == r.prompt_words and r.prompt_tokens is None for r in words)
    rng = random.Random(0)
    assert {LengthDist.parse("x", "uniform:3,5").sample(rng) for _ in range(200)} == {3, 4, 5}
    clipped = LengthDist.parse("x", "normal:10,50,4,12")
    assert {clipped.sample(rng) for _ in range(300)} <= set(range(4, 13))


def _assert_sweep_load(s: dict) -> None:
    """One load of the concurrency sweep: 6 measured requests of exactly 6 tokens, all good."""
    assert (s["completed"], s["failed"], s["cancelled"], s["warmup_requests"]) == (
        6,
        0,
        0,
        1,
    ), s
    # ignore_eos: every answer is exactly max_tokens long, counted by the server's usage.
    assert s["output_tokens_as_requested"] == 6 and s["total_output_tokens"] == 36
    assert s["output_tokens_source"] == {"usage": 6} and s["input_tokens_source"] == {"server": 6}
    for key in ("ttft_ms", "itl_ms", "e2e_ms"):
        assert ordered(s[key]), (key, s[key])
    assert s["ttft_ms"]["max"] <= s["e2e_ms"]["max"]
    # A huge SLO: every request is good, so goodput is the request throughput itself.
    assert s["good_requests"] == 6 and s["goodput"] == s["request_throughput"] > 0
    assert s["output_token_throughput"] == pytest.approx(36 / s["duration_s"], rel=1e-3)
    recs = s["records"]
    assert [r["warmup"] for r in recs] == [True] + [False] * 6
    prompt_overhead = {r["prompt_tokens"] - r["client_prompt_tokens"] for r in recs}
    assert {r["client_prompt_tokens"] for r in recs} == {24} and len(prompt_overhead) == 1, recs
    for r in recs:
        assert (
            r["ok"] and r["output_tokens"] == r["max_tokens"] == 6 and len(r["chunk_times_ms"]) >= 1
        )
        assert (
            r["chunk_times_ms"] == sorted(r["chunk_times_ms"])
            and r["chunk_times_ms"][0] == r["ttft_ms"]
        )
        assert r["chunk_times_ms"][-1] <= r["e2e_ms"]


def test_concurrency_sweep_counts_latencies_goodput_and_plot(cluster, tiny6, tmp_path):
    png = tmp_path / "sweep.png"
    res = run_json(
        cluster,
        tmp_path / "sweep.json",
        "--tokenizer",
        str(tiny6),
        "--isl",
        "24",
        "--osl",
        "6",
        "--concurrency",
        "1,3",
        "--num-requests",
        "6",
        "--warmup",
        "1",
        "--save-records",
        "--slo-ttft-ms",
        "1e9",
        "--slo-itl-ms",
        "1e9",
        "--slo-e2e-ms",
        "1e9",
        "--plot",
        str(png),
    )
    assert res["config"]["loads"] == [{"concurrency": 1}, {"concurrency": 3}]
    assert res["config"]["api_key_sent"] is True and KEY not in json.dumps(res)
    assert [s["load"] for s in res["loads"]] == [{"concurrency": 1}, {"concurrency": 3}]
    for s in res["loads"]:
        _assert_sweep_load(s)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_poisson_rate_on_completions_with_an_impossible_slo(cluster, tiny6, tmp_path):
    res = run_json(
        cluster,
        tmp_path / "rate.json",
        "--endpoint",
        "completions",
        "--tokenizer",
        str(tiny6),
        "--isl",
        "uniform:8,40",
        "--osl",
        "5",
        "--request-rate",
        "100",
        "--num-requests",
        "8",
        "--warmup",
        "0",
        "--save-records",
        "--slo-ttft-ms",
        "0.001",
        "--seed",
        "3",
    )
    (s,) = res["loads"]
    assert s["load"] == {"request_rate": 100.0} and s["completed"] == 8 and s["failed"] == 0
    assert s["good_requests"] == 0 and s["goodput"] == 0.0 < s["request_throughput"]
    recs = s["records"]
    # No chat template on /v1/completions: the server counts exactly the tokens our tokenizer built.
    assert all(r["prompt_tokens"] == r["client_prompt_tokens"] for r in recs), recs
    assert (
        all(8 <= r["prompt_tokens"] <= 40 for r in recs)
        and len({r["prompt_tokens"] for r in recs}) > 1
    )
    assert all(r["output_tokens"] == 5 for r in recs)
    # Open loop: arrivals follow the seeded Poisson clock, not the answers, so requests overlap
    # (100/s puts all 8 out within a fraction of the time one PD request takes) and gaps differ.
    starts = [r["start_ms"] for r in recs]
    ends = [r["start_ms"] + r["e2e_ms"] for r in recs]
    assert starts == sorted(starts)
    assert any(starts[i + 1] < ends[i] for i in range(len(recs) - 1)), (starts, ends)
    gaps = [b - a for a, b in pairwise(starts)]
    assert max(gaps) > 2 * min(gaps), gaps


def test_jsonl_workload_and_chat_messages(cluster, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "\n".join(
            json.dumps(e)
            for e in [
                {"prompt": "the cache page moves to the decode rank", "max_tokens": 5},
                {
                    "messages": [
                        {"role": "system", "content": "be brief"},
                        {"role": "user", "content": "a router"},
                    ],
                    "max_tokens": 7,
                },
                {"prompt": "prefill layer token"},
            ]
        )
        + "\n\n"
    )
    res = run_json(
        cluster,
        tmp_path / "jsonl.json",
        "--dataset",
        str(data),
        "--osl",
        "3",
        "--concurrency",
        "2",
        "--num-requests",
        "6",
        "--warmup",
        "0",
        "--save-records",
    )
    (s,) = res["loads"]
    assert s["completed"] == 6 and s["total_output_tokens"] == 2 * (5 + 7 + 3)
    recs = s["records"]
    assert [r["max_tokens"] for r in recs] == [5, 7, 3, 5, 7, 3]
    assert [r["output_tokens"] for r in recs] == [5, 7, 3, 5, 7, 3]
    # No tokenizer given: the server's usage is the only prompt count, and it is reported.
    assert all(r["client_prompt_tokens"] is None and r["prompt_tokens"] > 0 for r in recs)
    assert s["total_input_tokens"] == sum(r["prompt_tokens"] for r in recs)


def test_user_errors_name_the_flag(cluster, tmp_path, capsys, monkeypatch):
    from pdserve.cli import main

    monkeypatch.delenv("PDSERVE_API_KEY", raising=False)  # the key's default

    def error_of(*args: str) -> str:
        assert main(["bench", "--url", cluster, "--no-progress", *args]) == 2
        return capsys.readouterr().err

    assert "--api-key" in error_of("--num-requests", "1")  # the cluster wants a key
    assert "--isl" in error_of("--isl", "uniform:5")
    assert "--osl" in error_of("--osl", "0")
    assert "--concurrency" in error_of("--concurrency", "2,x")
    assert "not both" in error_of("--concurrency", "2", "--request-rate", "1")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": ""}\n')
    err = error_of("--dataset", str(bad))
    assert f"{bad}:2" in err and "'prompt'" in err
    chat_only = tmp_path / "chat.jsonl"
    chat_only.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    assert "--endpoint chat" in error_of("--dataset", str(chat_only), "--endpoint", "completions")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if matplotlib were not installed
    assert "pip install 'pdserve[bench]'" in error_of("--plot", str(tmp_path / "x.png"))


def _aiperf() -> str:
    """aiperf lives in its own venv (.venv/aiperf, made by scripts/setup.sh): its exact pins
    (pyzmq, prometheus-client, huggingface-hub, rich, psutil) would otherwise downgrade ours."""
    exe = os.environ.get("PDSERVE_AIPERF") or str(ROOT / ".venv" / "aiperf" / "bin" / "aiperf")
    assert shutil.which(exe), f"aiperf {AIPERF_VERSION} not found at {exe}: run scripts/setup.sh"
    return exe


# Output tokens per request of the cross-check: a decode phase of 31 steps (over 100 ms here) is
# long next to the scheduling delays of a client on a busy 2-core machine. With 6, CI once saw ours
# read each request's first chunk about 20 ms late, with the rest, so its ITL mean was 0.24 ms
# against aiperf's 4.3 ms.
CROSS_OSL = 32


def _text_tokens_only(model: Path) -> dict:
    """A logit_bias that bans every token that decodes to no text on its own: the byte-level BPE's
    bytes 0x80-0xFF (a third of the tiny models' vocabulary, which a random model draws often) and
    the special tokens. Unbanned, the server rightly holds a partial UTF-8 character back until a
    later token completes it, so a request's first text can come several tokens late, and the two
    meters, with different prompts, see different tokens held back."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    texts = [tok.decode([i], skip_special_tokens=True) for i in range(tok.get_vocab_size())]
    banned = [i for i, t in enumerate(texts) if not t or "\ufffd" in t]
    assert 0 < len(banned) <= 300, len(banned)  # OpenAI's (and the server's) limit
    return {str(i): -100 for i in banned}


def _start_bench_until_stopped(
    url: str, tiny6: Path, out: Path, err: Path, extra: dict
) -> subprocess.Popen:
    """`pdserve bench` at concurrency 2 for longer than aiperf needs: bounded by time alone (a
    count ran out once, when a loaded machine slowed aiperf's start), and stopped with Ctrl-C.
    Returns once its measured phase runs (its progress bar, not the warm-up's, is on)."""
    with open(err, "w") as ef:
        p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdserve.cli",
                "bench",
                "--url",
                url,
                "--api-key",
                KEY,
                "--tokenizer",
                str(tiny6),
                "--isl",
                "24",
                "--osl",
                str(CROSS_OSL),
                "--extra-body",
                json.dumps(extra),
                "--concurrency",
                "2",
                "--duration",
                "900",
                "--warmup",
                "1",
                "--output",
                str(out),
                "--save-records",
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=ef,
            text=True,
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    while not re.search(r"(^|[\r\n])concurrency 2:", err.read_text()):
        if p.poll() is not None or time.monotonic() > deadline:
            kill_group(p)
            raise AssertionError(err.read_text()[-3000:])
        time.sleep(0.2)
    return p


def _aiperf_profile_cmd(
    model: str,
    url: str,
    tokenizer: Path,
    art: Path,
    extra: dict,
    *,
    isl: int = 24,
    osl: int = CROSS_OSL,
    concurrency: int = 2,
    requests: int = 12,
) -> list[str]:
    """aiperf's command line: `requests` streamed chat requests (after 1 warm-up), `concurrency` at
    a time, of `isl` prompt and `osl` output tokens, its records exported into `art`."""
    return [
        _aiperf(),
        "profile",
        "-m",
        model,
        "--url",
        url,
        "--api-key",
        KEY,
        "--endpoint-type",
        "chat",
        "--streaming",
        "--tokenizer",
        str(tokenizer),
        "--isl",
        str(isl),
        "--osl",
        str(osl),
        "--random-seed",
        "0",
        # Prompts of random vocabulary tokens (vllm bench's random dataset), still built and
        # counted by aiperf with the model's tokenizer: the default corpus (Shakespeare) costs
        # aiperf a tokenization of 5 MB of text at every start, most of its run time here.
        "--prompt-corpus",
        "random",
        "--num-dataset-entries",
        str(requests),
        "--extra-inputs",
        json.dumps({"ignore_eos": True, **extra}),
        "--use-server-token-count",
        "--concurrency",
        str(concurrency),
        "--request-count",
        str(requests),
        "--warmup-request-count",
        "1",
        "--ui",
        "none",
        "--no-gpu-telemetry",
        "--no-server-metrics",
        "--record-processors",
        "1",
        "--export-level",
        "records",
        "--artifact-dir",
        str(art),
    ]


def _run_aiperf(cmd: list[str], cwd: Path) -> None:
    env = {
        k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"
    }  # aiperf rejects a local folder with it
    r = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=480)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


def _assert_interrupted_results(
    proc: subprocess.Popen, stdout: str, out: Path, err: Path
) -> tuple[dict, list[dict]]:
    """Ctrl-C: exit code 130, no traceback, the partial results written and consistent.
    Returns (our load's results, its measured records)."""
    assert proc.returncode == 130, err.read_text()[-2000:]
    assert "Traceback" not in err.read_text() and "(interrupted)" in stdout
    res = json.loads(out.read_text())
    (ours,) = res["loads"]
    assert res["interrupted"] is True and ours["interrupted"] is True
    measured = [x for x in ours["records"] if not x["warmup"]]
    # The two requests in flight at Ctrl-C are cancelled, unless their answers were already in the
    # client's socket: a starved client reads them before it acts on the signal, and its workers
    # then stop taking requests (a loaded full run on 2026-12-04: 313 completed, 0 cancelled).
    assert ours["cancelled"] <= 2 and ours["failed"] == 0
    assert ours["completed"] + ours["cancelled"] == len(measured)
    assert sum(x["error"] == "cancelled" for x in measured) == ours["cancelled"]
    return ours, measured


def _read_aiperf_results(art: Path) -> tuple[dict, list[dict]]:
    """(aiperf's summary, its records of the profiling phase) from its artifact folder."""
    peer = json.loads((art / "profile_export_aiperf.json").read_text())
    peer_recs = [
        json.loads(line) for line in (art / "profile_export.jsonl").read_text().splitlines() if line
    ]
    peer_recs = [x for x in peer_recs if x["metadata"]["benchmark_phase"] == "profiling"]
    return peer, peer_recs


def _assert_counts_agree(peer: dict, peer_recs: list[dict], ours: dict) -> None:
    """Counts are facts of the workload: both meters must report them equal."""
    assert peer["aiperf_version"] == AIPERF_VERSION
    # Counts: 12 requests of exactly CROSS_OSL output tokens (server usage) for aiperf, and as many
    # each for ours.
    n = CROSS_OSL
    assert peer["request_count"]["avg"] == len(peer_recs) == 12
    assert peer["usage_completion_tokens"]["min"] == peer["usage_completion_tokens"]["max"] == n
    assert peer["total_usage_completion_tokens"]["avg"] == 12 * n
    assert ours["output_tokens_per_request"]["min"] == ours["output_tokens_per_request"]["max"] == n
    assert ours["total_output_tokens"] == n * ours["completed"]
    # Prompts: both built 24-token texts with the same tokenizer; the server adds the same template.
    ours_prompt = ours["total_input_tokens"] / ours["completed"]
    assert abs(peer["usage_prompt_tokens"]["avg"] - ours_prompt) <= 1, (
        peer["usage_prompt_tokens"],
        ours_prompt,
    )


def _within(a: float, b: float, factor: float = 2.0) -> bool:
    return b / factor <= a <= b * factor


def _assert_window_rates_agree(peer: dict, peer_recs: list[dict], measured: list[dict]) -> None:
    """Our requests inside aiperf's window [first send, last answer] against aiperf's: rates and
    TTFT within 4x; our ITLs by their definition."""
    w0 = min(x["metadata"]["request_start_ns"] for x in peer_recs) / 1e9
    w1 = max(x["metadata"]["request_end_ns"] for x in peer_recs) / 1e9
    ok = [x for x in measured if x["ok"]]
    assert min(x["start_unix"] for x in measured) < w0, "ours was not running when aiperf started"
    inside = [x for x in ok if w0 <= x["start_unix"] and x["start_unix"] + x["e2e_ms"] / 1000 <= w1]
    ended_inside = [x for x in ok if w0 <= x["start_unix"] + x["e2e_ms"] / 1000 <= w1]
    assert len(inside) >= 4, (len(inside), w1 - w0)

    rates = (len(ended_inside) / (w1 - w0), peer["request_throughput"]["avg"])
    ttfts = (statistics.median(x["ttft_ms"] for x in inside), peer["time_to_first_token"]["p50"])
    itls = (statistics.mean(x["itl_ms"] for x in inside), peer["inter_token_latency"]["avg"])
    # Each of our ITLs is its own record's (e2e - TTFT) / (tokens - 1), to the records' rounding:
    # what a unit slip or an undivided e2e would break.
    for x in inside:
        gaps = (x["e2e_ms"] - x["ttft_ms"]) / (x["output_tokens"] - 1)
        assert abs(x["itl_ms"] - gaps) <= 0.002, x
    print(
        f"\ncross-check in aiperf's {w1 - w0:.1f} s window (ours, aiperf): req/s {rates}, "
        f"TTFT p50 ms {ttfts}, ITL mean ms {itls}"
    )
    # Within 4x: the two meters are two client processes on a 2-core machine that the suite keeps
    # busy, and a starved client measures late. Seen in loaded full runs with 6 output tokens:
    # req/s 3.4x apart (19.4 against 5.7 in a 2.1 s window), ITL 3.2x and 2.0x, TTFT 2.7x and 2.0x,
    # and once ITL 18x (see CROSS_OSL). 4x still catches what this check is for: a unit slip
    # (1000x). ITL means are not compared: a starved reader takes a request's tokens in one burst
    # and sees its gaps shrink (2026-12-04, loaded: ours 1.20 ms against aiperf's 0.29 ms; with
    # both cores busy, ours 0.02 ms against 0.75 ms), so the records' own arithmetic is checked
    # above instead, and the means are compared on slow tokens in
    # test_itl_agrees_with_aiperf_one_meter_at_a_time.
    for name, pair in (("req/s", rates), ("TTFT p50", ttfts)):
        assert _within(*pair, factor=4.0), (name, pair)


def test_cross_check_with_aiperf_and_ctrl_c(cluster, tiny6, tmp_path):
    """Two meters on one server at the same time; then Ctrl-C ends ours with partial results.

    Both send streamed chat requests, 2 at a time, of 24 prompt tokens (exact, built with the
    model's tokenizer; aiperf's of random vocabulary tokens) and CROSS_OSL output tokens with
    ignore_eos, each of which decodes to text (`_text_tokens_only`), so both meters' first token is
    the first token the server sent.
    aiperf sends 12 (after 1 warm-up); `pdserve bench` runs all the while (started first, stopped
    with Ctrl-C after aiperf), and its requests inside aiperf's window [first send, last answer]
    are compared with aiperf's. Run together, both meters see the same server under the same load
    (4 in flight) at the same moments, which run one after the other they do not on a shared
    2-core machine (a first version did that and saw 1.7x-2.3x apart either way). Counts are facts
    of the workload and must be equal; rates and latencies must agree within 4x: a check that the
    two meters measure the same thing, not a performance assertion.
    """
    model = model_ids(cluster)[0]
    assert model == tiny6.name  # the first model: what ours, given none, sends to
    art, out, err = tmp_path / "aiperf", tmp_path / "ours.json", tmp_path / "ours.stderr"
    extra = {"logit_bias": _text_tokens_only(tiny6)}
    cmd = _aiperf_profile_cmd(model, cluster, tiny6, art, extra)
    ours_proc = _start_bench_until_stopped(cluster, tiny6, out, err, extra)
    try:
        _run_aiperf(cmd, tmp_path)
        assert ours_proc.poll() is None, err.read_text()[-2000:]
        ours_proc.send_signal(signal.SIGINT)
        stdout, _ = ours_proc.communicate(timeout=60)
    finally:
        kill_group(ours_proc)

    ours, measured = _assert_interrupted_results(ours_proc, stdout, out, err)
    peer, peer_recs = _read_aiperf_results(art)
    _assert_counts_agree(peer, peer_recs, ours)
    _assert_window_rates_agree(peer, peer_recs, measured)


# The ITL cross-check's workload, the same for both meters: ITL_REQUESTS streamed chat requests
# (after 1 warm-up) one at a time, of ITL_ISL prompt and ITL_OSL output tokens, on wide8. The long
# prompt is there for a broken ITL that takes in the TTFT: its 12 chunks of prefill (about 550 ms
# here) against 15 gaps of about 15 ms make e2e / (tokens - 1) about 3x the true ITL.
ITL_ISL, ITL_OSL, ITL_REQUESTS = 384, 16, 8
# How far apart the two meters' ITL means may be. Measured on 2026-12-06 (ours / aiperf, ms; the
# 2-core machine with other test runs on it, load average 3-12): 14.6/15.3, 17.9/18.1, 15.4/16.7,
# and 16.2/23.7 (1.46x) with two more processes spinning on both cores; the same two commands
# outside pytest, 17 times (prompts of 128-384 tokens, 6 times with the spinners), 0.73x to 1.43x
# apart. Run one after the other, the meters see a server whose speed drifts with the machine's
# load, and aiperf 0.13 starves itself: at a fixed concurrency its timing manager spins a core while
# a request is in flight (timing/strategies/request_rate.py: yield_to_event_loop until a slot
# frees), so its worker now and then reads a whole answer in one burst (an ITL of 0 ms for that
# request). 2x covers that with room, and still catches a TTFT taken in (49.0 against 16.2 ms when
# tried) and a unit slip (1000x). Not covered: a machine so loaded that neither meter measures the
# server. With the two spinners on top of load 9, one run in two saw 6.5 against 51.6 ms: our
# client, starved, read the first half of each answer in one burst, and the server's steps took 3x
# longer in aiperf's turn than in ours.
ITL_FACTOR = 2.0


def test_itl_agrees_with_aiperf_one_meter_at_a_time(cluster, wide8, tmp_path):
    """Our ITL mean against aiperf's own `inter_token_latency`, on a server whose tokens are slow.

    The concurrent cross-check above cannot compare ITL: tiny6 takes about 1 ms a token, so a
    starved client reads a request's tokens in one burst and both meters measure the client. Here
    wide8 takes about 15 ms a token (a real decode step: 8 layers of hidden 512), long next to a
    client's scheduling jitter, and the meters run one after the other, each alone at concurrency 1
    (so neither meter's load shapes the other's batches), with the same workload (ITL_ISL,
    ITL_OSL, ignore_eos, streamed chat, text tokens only: `_text_tokens_only`). Both define ITL as
    (e2e - TTFT) / (tokens - 1) per request and average it over the requests; the means must agree
    within ITL_FACTOR."""
    model = wide8.name
    assert model in model_ids(cluster)
    extra = {"logit_bias": _text_tokens_only(wide8)}
    res = run_json(
        cluster,
        tmp_path / "ours.json",
        "--model",
        model,
        "--tokenizer",
        str(wide8),
        "--isl",
        str(ITL_ISL),
        "--osl",
        str(ITL_OSL),
        "--extra-body",
        json.dumps(extra),
        "--concurrency",
        "1",
        "--num-requests",
        str(ITL_REQUESTS),
        "--warmup",
        "1",
    )
    (ours,) = res["loads"]
    art = tmp_path / "aiperf"
    cmd = _aiperf_profile_cmd(
        model,
        cluster,
        wide8,
        art,
        extra,
        isl=ITL_ISL,
        osl=ITL_OSL,
        concurrency=1,
        requests=ITL_REQUESTS,
    )
    _run_aiperf(cmd, tmp_path)
    peer, peer_recs = _read_aiperf_results(art)

    # The same workload, all of it answered: counts are facts, equal for both.
    assert (ours["completed"], ours["failed"], ours["output_tokens_as_requested"]) == (
        ITL_REQUESTS,
        0,
        ITL_REQUESTS,
    ), ours
    assert len(peer_recs) == ITL_REQUESTS and peer["request_count"]["avg"] == ITL_REQUESTS
    assert (
        peer["usage_completion_tokens"]["min"] == peer["usage_completion_tokens"]["max"] == ITL_OSL
    )
    itls = (ours["itl_ms"]["mean"], peer["inter_token_latency"]["avg"])
    ttfts = (ours["ttft_ms"]["mean"], peer["time_to_first_token"]["avg"])
    print(f"\nITL mean ms (ours, aiperf): {itls}; TTFT mean ms {ttfts}")
    # The premise: the server's own gaps, as aiperf saw them, are long next to client jitter. A
    # faster server (better kernels) calls for a bigger wide8, not a looser factor.
    assert peer["inter_token_latency"]["p50"] >= 5.0, peer["inter_token_latency"]
    assert _within(*itls, factor=ITL_FACTOR), (itls, ttfts)
