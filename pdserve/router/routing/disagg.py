"""Conditional disaggregation: whether a request that could go to a (prefill, decode) pair goes to
the decode node alone, and why.

A decode node prefills a request that names no prefill node itself (chunked, mixed with its running
batch). The router sends a request there instead of to the pair, in this order of reasons:

  short_prompt       the prompt is estimated shorter than `min_prompt_tokens`: a KV transfer and
                     a bootstrap handshake cost more than computing it where it is decoded
  decode_prefix_hit  the decode node is estimated to hold at least `decode_prefix_fraction` of the
                     prompt in its prefix cache, and more of it than the prefill node (it served an
                     earlier turn of the conversation that the prefill node did not): it computes
                     only the rest
  prefill_queue      the latency model (latency_model.py) predicts an earlier first token from
                     prefilling on the decode node than from the pair: the prefill node's time
                     for its queue and the prompt it does not hold, plus the handoff (KV transfer
                     and first step), against the decode node's time for its local queue and the
                     prompt it does not hold, at its rate with streams open (its prefill shares
                     their steps) or idle; with `stream_delay_weight` > 0, plus that weight times
                     the delay the prefill adds to the streams open there (each stream's steps
                     carry its compute time: the prefill fit's per-token slope times the tokens,
                     times the streams), else the pair takes it (reason `decode_streams`). The
                     rates are learnt from the requests served; the
                     flags `local_prefill_cost`, `idle_local_prefill_cost` and
                     `transfer_overhead_tokens` are only their priors (a local prefill token
                     costs that many prefill tokens until measured), and `local_prefill_cost` 0
                     turns the rule off

A stream that moves from a failed decode node (router/routing/migration.py) is decided by the same
rules on its replay: the prompt and the tokens already sent, which either node prefills; both paths
then count it under the reason `migration`.

Both nodes' caches count. A prompt that both hold most of (one shared system prompt before every
request) costs each node only the rest, so it stays disaggregated and its prefill stays off the
decode streams' core: when only the decode node's cache counted, such a workload (512 shared tokens,
32-504 more, aiperf at concurrency 8) prefilled 44 of 53 requests on the decode node.

Every estimate is the router's own: prompt tokens from the prompt's characters with a
characters-per-token ratio learnt from the nodes' answers (`TokenEstimator`; exact for token-id
prompts), each node's cache from the prompts the router sent there (a `PrefixTree` per role, as the
cache_aware policy keeps), queues from the prompt tokens the router has sent and not seen finish.
They steer routing only; nothing is wrong when one is off, a request just takes the slower path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pdserve.router.config import DisaggConfig
from pdserve.router.routing.latency_model import LatencyModel
from pdserve.router.routing.prefix_tree import PrefixTree

DECODE_ONLY_REASONS = (
    "no_prefill",
    "prefill_failed",
    "short_prompt",
    "decode_prefix_hit",
    "prefill_queue",
    "pair_down",  # every prefill node's pair with this decode node is down (pair_health.py)
    "migration",  # a stream moving from a failed decode node (router/routing/migration.py)
)
DISAGGREGATED_REASONS = (
    "default",
    "decode_streams",  # the decode node alone was predicted sooner, but not by what it would
    # delay the streams open there (`stream_delay_weight`)
    "migration",
)


class TokenEstimator:
    """Tokens a request's prefill computes: its prompt (exact for `input_ids`, else characters /
    a learnt ratio) and, for a migrated stream, the tokens already sent (`resume`)."""

    def __init__(self, chars_per_token: float = 4.0, weight: float = 0.1):
        self.chars_per_token = chars_per_token
        self.weight = weight  # exponential moving average: recent answers count most

    def estimate(self, body: dict[str, Any], key: str) -> int:
        resume = body.get("resume")
        replay = len(resume["token_ids"]) if isinstance(resume, dict) else 0
        ids = body.get("input_ids")
        if isinstance(ids, list):
            return len(ids) + replay
        return max(1, round(len(key) / self.chars_per_token)) + replay

    def learn(self, chars: int, tokens: Any) -> None:
        """One answer: `tokens` prompt tokens (a node's meta) for a prompt key of `chars`."""
        if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens > 0 and chars > 0:
            w = self.weight
            self.chars_per_token = (1 - w) * self.chars_per_token + w * (chars / tokens)


@dataclass(frozen=True)
class Decision:
    path: str  # "disaggregated" | "decode_only"
    reason: str
    prompt_tokens: int  # the estimate, charged to the queue it joins
    predicted_ttft_s: float  # the latency model's, for this path (latency_model.py)


class Disaggregation:
    """Decides the path of each request; keeps the estimates it decides on."""

    def __init__(self, cfg: DisaggConfig):
        self.cfg = cfg
        self.tokens = TokenEstimator()
        self.model = LatencyModel(cfg)
        self.decode_cache = PrefixTree(cfg.max_tree_chars)
        self.prefill_cache = PrefixTree(cfg.max_tree_chars)

    def decide(
        self, body: dict[str, Any], key: str, prefill: Any, decode: Any, tenant: str | None = None
    ) -> Decision:
        """`prefill`, `decode`: the workers the policies chose (each with `url`,
        `queued_prompt_tokens`, `queued_by_tenant`, `prefix_cache` and `in_flight`); `tenant`:
        the request's, which decides what it waits behind on a node (latency_model.py
        `queue_ahead`)."""
        cfg, n = self.cfg, self.tokens.estimate(body, key)
        if n < cfg.min_prompt_tokens:
            return self._decision("decode_only", "short_prompt", n, decode, tenant)
        # a node started with --no-prefix-cache keeps no prompt, whatever it was sent
        held = self.held_tokens(self.decode_cache, key, decode, n)
        held_p = self.held_tokens(self.prefill_cache, key, prefill, n)
        if (
            cfg.decode_prefix_fraction <= 1
            and held >= cfg.decode_prefix_fraction * n
            and held > held_p
        ):
            return self._decision(
                "decode_only", "decode_prefix_hit", n - held, decode, tenant, n - held_p
            )
        pd = self.model.pd_ttft(prefill, decode, n - held_p, n, tenant)
        reason = "default"
        if cfg.local_prefill_cost > 0:
            local = self.model.local_ttft(decode, n - held, tenant)
            if local < pd:
                delay = cfg.stream_delay_weight * self.model.streams_delay_s(decode, n - held)
                if local + delay < pd:
                    self.model.taken("decode_only", n - held_p)
                    return Decision("decode_only", "prefill_queue", n - held, local)
                reason = "decode_streams"
        self.model.taken("disaggregated", n - held)
        return Decision("disaggregated", reason, n - held_p, pd)

    def _decision(
        self,
        path: str,
        reason: str,
        tokens: int,
        decode: Any,
        tenant: str | None,
        pair_tokens: int | None = None,
    ) -> Decision:
        """A decode-only decision; `pair_tokens`: what the pair would have computed (default:
        `tokens`), the size its calibration drifts at."""
        self.model.taken(path, tokens if pair_tokens is None else pair_tokens)
        return Decision(path, reason, tokens, self.model.local_ttft(decode, tokens, tenant))

    @staticmethod
    def held_tokens(cache: PrefixTree, key: str, worker: Any, n: int) -> int:
        """Prompt tokens `worker` is estimated to hold in its prefix cache (0 when it keeps none or
        never saw the prefix)."""
        if not key or not worker.prefix_cache:
            return 0
        matched, holders = cache.match(key)
        return int(n * matched / len(key)) if worker.url in holders else 0

    def routed(self, key: str, decode_url: str, prefill_url: str | None = None) -> None:
        """The decode node (and the prefill node, on a disaggregated route) will hold this
        prompt's KV once the request ends (the prefix cache)."""
        if key:
            self.decode_cache.insert(key, decode_url)
            if prefill_url:
                self.prefill_cache.insert(key, prefill_url)
