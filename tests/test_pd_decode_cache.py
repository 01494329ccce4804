"""The decode prefix cache with real processes: a prefill node (PP 2) and a decode node (PP 3) of
tiny6 (layers 3/3 against 2/2/2), real Mooncake writes over TCP on loopback, the rank consensus
checker on. A conversation's later turns move only the pages after what the decode ranks cached, as
the nodes' /metrics count it. (Every layout, aborts and the bytes of each rank:
tests/test_inproc_decode_cache.py.)"""

from __future__ import annotations

import random
import time

from metrics_scrape import scrape, total
from one_thread import one_torch_thread
from pd_cluster import pd_generate_all, pd_pair, wait_pages_free
from reference import hf_greedy, load_hf

MAX_NEW = 8
PS = 4  # tests/cluster.py NODE_ARGS page size
COUNTERS = (
    "pdserve_kv_transfer_bytes_total",
    "pdserve_kv_transfer_tokens_total",
    "pdserve_kv_transfer_skipped_tokens_total",
    "pdserve_kv_transfer_skipped_bytes_total",
)


def _counters(url: str, ranks: int, tokens: int, timeout: float = 30.0) -> list[dict[str, float]]:
    """Each rank's transfer counters once every rank counted `tokens` prompt tokens (moved plus
    skipped: the ranks push their stats twice a second); the last reading after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        page = scrape(url)
        got = [{n: total(page, n, pp_rank=str(r)) for n in COUNTERS} for r in range(ranks)]
        done = all(
            g["pdserve_kv_transfer_tokens_total"] + g["pdserve_kv_transfer_skipped_tokens_total"]
            == tokens
            for g in got
        )
        if done or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def test_conversation_moves_only_new_pages(tiny6, tmp_path):
    """Three turns over PP 2 -> PP 3: the answers are transformers', turn 1 moves the whole prompt,
    turns 2 and 3 skip what the decode ranks cached from the turn before (tokens and bytes, on both
    nodes' /metrics), and no page is held afterwards."""
    hf = load_hf(tiny6)
    rng = random.Random(23)
    prompt = [rng.randrange(3, 380) for _ in range(37)]
    with pd_pair(tiny6, 2, 3, tmp_path) as ((purl, bport, _), (durl, _)):
        seen, kept, before = 0, 0, [dict.fromkeys(COUNTERS, 0.0)] * 3
        for turn in range(3):
            with one_torch_thread():
                want = hf_greedy(hf, [prompt], MAX_NEW)[0]
            assert pd_generate_all(purl, durl, bport, [prompt], MAX_NEW) == [want], turn
            held = (kept // PS) * PS
            seen += len(prompt)
            after = _counters(durl, 3, seen)
            for r, (a, b) in enumerate(zip(after, before, strict=True)):
                grew = {n: a[n] - b[n] for n in COUNTERS}
                assert grew["pdserve_kv_transfer_tokens_total"] == len(prompt) - held, (turn, r)
                assert grew["pdserve_kv_transfer_skipped_tokens_total"] == held, (turn, r)
                per_token = (
                    a["pdserve_kv_transfer_bytes_total"] / a["pdserve_kv_transfer_tokens_total"]
                )
                assert grew["pdserve_kv_transfer_bytes_total"] == (len(prompt) - held) * per_token
                assert grew["pdserve_kv_transfer_skipped_bytes_total"] == held * per_token
            if turn:
                assert held > 0
            before, kept = after, len(prompt) + MAX_NEW - 1
            prompt = prompt + want + [rng.randrange(3, 380) for _ in range(9)]
        prefill = _counters(purl, 2, seen)
        skipped_bytes = "pdserve_kv_transfer_skipped_bytes_total"
        assert sum(p[skipped_bytes] for p in prefill) == sum(d[skipped_bytes] for d in after) > 0
        hits = total(scrape(durl), "pdserve_prefix_cache_hit_tokens_total")
        assert hits == 3 * sum(a["pdserve_kv_transfer_skipped_tokens_total"] for a in after[:1])
        left = wait_pages_free(purl, durl)
        assert not any(left[purl]) and not any(left[durl]), left
    for name in ("prefill", "decode"):
        assert "diverged" not in (tmp_path / f"{name}.log").read_text()
