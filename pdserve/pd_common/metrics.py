"""The PD nodes' metrics, added to the node front's (runtime/front/metrics.py) through its one
extension point: KV transfer bytes, tokens, failures and latencies per rank, the control drops of
the KV channel, the PD stages (bootstrap, KV pages), and the decode node's own prefills."""

from __future__ import annotations

from collections import Counter
from typing import Any

from pdserve.kv_transfer.stats import DROP_REASONS, RECEIVER_FAILURES, SENDER_FAILURES
from pdserve.pd_common.messages import KVRankStats
from pdserve.runtime.front.metrics import MetricsExtension, NodeMetrics, rank_counter
from pdserve.runtime.messages import RankStats

BYTES_BUCKETS = tuple(float(1 << k) for k in range(12, 36, 2))  # 4 KiB .. 16 GiB, x4


class KVMetrics(MetricsExtension):
    """A PD node's transfer side; `failure_reasons`: the reasons its ranks can fail a room for,
    each a series at 0 from the first scrape."""

    failure_reasons: tuple[str, ...] = ()

    def __init__(self, metrics: NodeMetrics):
        super().__init__(metrics)
        lab = ["node", "role"]
        self.bootstrap = metrics.hist(
            "pdserve_bootstrap_seconds", "prefill: request arrival to bootstrap decision", lab
        )
        self.alloc_wait = metrics.hist(
            "pdserve_kv_alloc_wait_seconds", "decode: request arrival to its KV pages", lab
        )
        self.seconds = metrics.hist(
            "pdserve_kv_transfer_seconds", "per-room KV transfer latency", lab + ["pp_rank"]
        )
        self.room_bytes = metrics.hist(
            "pdserve_kv_transfer_request_bytes",
            "KV bytes one request moved on one rank",
            lab + ["pp_rank"],
            BYTES_BUCKETS,
        )

    def families(self) -> dict[str, Any]:
        return {
            "kv_bytes": rank_counter(
                "pdserve_kv_transfer_bytes", "KV bytes sent (prefill) or received (decode)"
            ),
            "kv_tokens": rank_counter(
                "pdserve_kv_transfer_tokens",
                "prompt tokens whose KV was sent (prefill) or received (decode)",
            ),
            "kv_skip_tokens": rank_counter(
                "pdserve_kv_transfer_skipped_tokens",
                "prompt tokens not transferred: the decode rank held them in its prefix cache",
            ),
            "kv_skip_bytes": rank_counter(
                "pdserve_kv_transfer_skipped_bytes",
                "KV bytes of the skipped tokens (not transferred)",
            ),
            "kv_window_bytes": rank_counter(
                "pdserve_kv_transfer_window_skipped_bytes",
                "KV bytes of sliding-window layers before the window of the prompt's end: "
                "never read by decode, so not transferred",
            ),
            "kv_fail": rank_counter(
                "pdserve_kv_transfer_failures", "rooms whose KV transfer failed", ("reason",)
            ),
        }

    def add_rank(
        self, fam: dict[str, Any], lv: list[str], st: RankStats, followers: list[RankStats]
    ) -> None:
        """A stage's series: each TP rank moves the heads it holds, so the bytes and the dropped
        control messages are the sum over the stage's ranks; the tokens are its lead's (every
        rank of a stage moves the same tokens), and the failures per reason the most any of its
        ranks counted (a room that fails fails at every rank: a sum would count it TP times)."""
        kv = st.ext
        if not isinstance(kv, KVRankStats):
            return
        every = [kv, *(f.ext for f in followers if isinstance(f.ext, KVRankStats))]
        fam["kv_bytes"].add_metric(lv, sum(k.bytes for k in every))
        fam["kv_tokens"].add_metric(lv, kv.tokens)
        fam["kv_skip_tokens"].add_metric(lv, kv.skipped_tokens)
        fam["kv_skip_bytes"].add_metric(lv, sum(k.skipped_bytes for k in every))
        fam["kv_window_bytes"].add_metric(lv, sum(k.window_skipped_bytes for k in every))
        failures, dropped = dict.fromkeys(self.failure_reasons, 0), Counter()
        for k in every:
            for reason, n in k.failures.items():
                failures[reason] = max(failures.get(reason, 0), n)
            dropped.update(k.dropped)
        for reason, n in sorted(failures.items()):
            fam["kv_fail"].add_metric(lv + [reason], n)
        for reason, n in sorted((dict.fromkeys(DROP_REASONS, 0) | dropped).items()):
            fam["dropped"].add_metric(lv + ["kv-control", reason], n)

    def ingest(self, st: RankStats) -> None:
        m = self.metrics
        lv = (m.node, m.role)
        for name, values in st.samples.items():
            if name == "bootstrap":
                h = self.bootstrap.labels(*lv)
            elif name == "kv_alloc_wait":
                h = self.alloc_wait.labels(*lv)
            else:
                continue
            for v in values:
                h.observe(v)
        if isinstance(st.ext, KVRankStats):
            seconds = self.seconds.labels(*lv, str(st.pp_rank))
            nbytes = self.room_bytes.labels(*lv, str(st.pp_rank))
            for v in st.ext.latencies:
                seconds.observe(v)
            for b in st.ext.room_bytes:
                nbytes.observe(b)


class PrefillMetrics(KVMetrics):
    failure_reasons = SENDER_FAILURES


class DecodeMetrics(KVMetrics):
    """Also the prompt tokens the decode node prefills itself (conditional disaggregation, the
    fallback when no prefill node is up)."""

    failure_reasons = RECEIVER_FAILURES

    def __init__(self, metrics: NodeMetrics):
        super().__init__(metrics)
        self._local_prompt_tokens = metrics.counter(
            "pdserve_decode_local_prompt_tokens",
            "decode node: prompt tokens of requests it prefills itself (no prefill node)",
            ["node", "role"],
        )
        for role in metrics.series_roles:  # at 0 from the start
            self._local_prompt_tokens.labels(metrics.node, role)

    def count_local_prompt(self, tokens: int) -> None:
        self._local_prompt_tokens.labels(self.metrics.node, self.metrics.role).inc(tokens)
