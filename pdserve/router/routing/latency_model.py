"""What the router predicts a route to cost, learnt online from what the nodes are measured to do.

Per worker, by exponentially weighted least squares (`LinearFit`: recent requests count most):

  prefill      seconds from sending a request to the end of its prefill (the prefill node's
               answer, or a decode or colocated node's first token), against the prompt tokens
               that node computes before then: what it waits behind in the node's queue when
               sent (`queue_ahead`: the nodes prefill tenants in fair turn) plus the request's
               own. A decode node has two fits: with streams open (its prefill shares steps with
               them, each step slower) and idle.
  handoff      per decode node, seconds from the prefill node's answer to the first token: the
               KV pages' transfer and the first decode step, against the prompt's tokens (pages).
  decode step  per decode or colocated node, seconds between two tokens of a stream, against
               the node's open streams.

Each fit starts from a prior made of the fixed cost flags (`DisaggConfig`: a decode-side prefill
token costs `local_prefill_cost` prefill tokens, the handoff `transfer_overhead_tokens`), over a
base rate. The prior's two pseudo-observations never fade; they lie on the prior line scaled by
the measured times over the prior's (`LinearFit.scale`), so a fit with few requests keeps the
prior's shape at the measured speed, and measured requests outweigh it after a few dozen.

The fits learn from prefills that ended. A node slower than its fit says so sooner through the
prefills it has open: a prediction is scaled by the largest age over predicted time among them
(`overdue`), which reacts inside a burst, before any of its requests has ended. The fits see each
node alone; what they miss (a node slowing as its load grows, a burst that
lands before any fit has data) shows in the errors. So each path's predictions are calibrated,
per prompt size class (`size_class`: a line learnt mostly from long prompts can miss a short
one's fixed costs by a factor): scaled by exp(b), where b follows the log of measured over
predicted (`BIAS_RATE` per attempt), and a path the router stops taking drifts back to b = 0
(`BIAS_FORGET` per decision), so a slow path that became fast again is tried again.

The router predicts a route's TTFT (time from dispatch to first token) with it, routes to the
route predicted first (router/routing/disagg.py), refuses at admission what is predicted to miss
an SLO (router/slo.py), and records each prediction over what was measured (`errors`).
"""

from __future__ import annotations

import collections
import math
import time

from pdserve.router.config import DisaggConfig

BASE_S_PER_TOKEN = 0.5e-3  # prior prefill rate of one node, before any request is measured
BASE_OVERHEAD_S = 0.01  # prior fixed cost of a request (HTTP, scheduling, the first step)
BASE_STEP_S = 0.02  # prior decode step at batch 1
BASE_STEP_PER_STREAM_S = 1e-3
DECAY = 0.98  # each new observation multiplies the weight of the earlier ones by this
PRIOR_WEIGHT = 0.1  # of each of the prior's two points
PRIOR_SPAN = 1024.0  # x of the prior's second point (tokens or streams)
PRIOR_SCALE_LIMIT = 50.0  # the most the measured times may scale the prior line, either way
ERRORS_KEPT = 2048  # predicted / actual ratios kept for the quantiles
BIAS_RATE = 0.1  # how far one measured error moves a path's calibration (in log space)
BIAS_FORGET = 0.99  # a path not taken drifts back towards no correction, so it is tried again
BIAS_LIMIT = 3.0  # |log| of the largest correction (20x)
SIZE_CLASSES = 9  # prompt sizes calibrated apart: under 64 tokens, then by powers of two


def size_class(tokens: float) -> int:
    """0 below 64 prompt tokens, then one class per power of two; the last from 8192 up."""
    return min(SIZE_CLASSES - 1, max(0, int(tokens).bit_length() - 6))


def size_label(c: int) -> str:
    lo, hi = 32 << c, 64 << c
    return "<64" if c == 0 else f">={lo}" if c == SIZE_CLASSES - 1 else f"{lo}-{hi - 1}"


class LinearFit:
    """y = a + b·x by weighted least squares over decaying observations and a prior line.

    The prior's two pseudo-points lie on the prior line scaled by what was measured: k times it,
    k the measured time over the prior's for the same x (weighted like the observations). A few
    requests thus tell the fit how much slower or faster the node is at every size, where the
    plain prior would read one slow request as a large fixed cost at the prior's rate and
    under-predict every longer queue (a prefill node sharing its core with a busy client: one
    measured 533-token prefill gave 815 ms + 0.86 ms a token against 2.4 ms a token measured).
    Once the observations spread over sizes, they outweigh the pseudo-points."""

    def __init__(self, intercept: float, slope: float, span: float = PRIOR_SPAN):
        self._line = (intercept, slope)
        w = PRIOR_WEIGHT
        y0, y1 = intercept, intercept + slope * span
        # the pseudo-points' sums of weight, x, x² and (for k = 1) y, xy
        self._prior = (2 * w, w * span, w * span * span, w * (y0 + y1), w * span * y1)
        self._data = [0.0] * 5  # sums of weight, x, y, x², xy
        self.observations = 0

    def observe(self, x: float, y: float) -> None:
        d = self._data
        for i in range(5):
            d[i] *= DECAY
        d[0] += 1.0
        d[1] += x
        d[2] += y
        d[3] += x * x
        d[4] += x * y
        self.observations += 1

    def scale(self) -> float:
        """k: the measured times over the prior line's at the same sizes (1 before any)."""
        a0, b0 = self._line
        sw, sx, sy = self._data[:3]
        expected = a0 * sw + b0 * sx
        if sw <= 0 or expected <= 0:
            return 1.0
        return min(PRIOR_SCALE_LIMIT, max(1 / PRIOR_SCALE_LIMIT, sy / expected))

    def coefficients(self) -> tuple[float, float]:
        k = self.scale()
        pw, px, pxx, py, pxy = self._prior
        dw, dx, dy, dxx, dxy = self._data
        sw, sx, sxx = pw + dw, px + dx, pxx + dxx
        sy, sxy = k * py + dy, k * pxy + dxy
        var = sw * sxx - sx * sx
        slope = (sw * sxy - sx * sy) / var if var > 1e-12 else 0.0
        slope = max(0.0, slope)  # more work never takes less time
        intercept = max(0.0, (sy - slope * sx) / sw)
        return intercept, slope

    def predict(self, x: float) -> float:
        a, b = self.coefficients()
        return a + b * max(0.0, x)


class LatencyModel:
    """The fits of every worker, keyed by URL, made from the priors on first use."""

    def __init__(self, cfg: DisaggConfig):
        self.cfg = cfg
        self._fits: dict[tuple[str, str], LinearFit] = {}
        self.errors: dict[str, collections.deque[float]] = {}
        self.bias: dict[tuple[str, int], float] = {}  # (path, size class) -> log of calibration
        # url -> attempt -> (sent, predicted, tenant)
        self._open: dict[str, dict[int, tuple[float, float, str | None]]] = {}

    def _fit(self, kind: str, url: str) -> LinearFit:
        fit = self._fits.get((kind, url))
        if fit is None:
            fit = self._fits[(kind, url)] = self._prior(kind)
        return fit

    def _prior(self, kind: str) -> LinearFit:
        cfg, rate = self.cfg, BASE_S_PER_TOKEN
        if kind in ("step", "decode_step"):
            return LinearFit(BASE_STEP_S, BASE_STEP_PER_STREAM_S, span=64.0)
        if kind == "handoff":
            # the prefill fits hold the fixed cost already
            return LinearFit(cfg.transfer_overhead_tokens * rate, 0.0)
        cost = {
            "prefill": 1.0,
            "local_busy": cfg.local_prefill_cost,
            "local_idle": min(cfg.idle_local_prefill_cost, cfg.local_prefill_cost),
        }[kind]
        return LinearFit(BASE_OVERHEAD_S, cost * rate)

    @staticmethod
    def _prefill_kind(role: str, busy: bool) -> str:
        return "prefill" if role == "prefill" else "local_busy" if busy else "local_idle"

    def prefill_fit(self, worker) -> LinearFit:
        """The fit of `worker`'s prefill time against its queued tokens (a decode node's: of its
        own prefills with streams open)."""
        return self._fit(self._prefill_kind(worker.role, True), worker.url)

    def step_fit(self, url: str) -> LinearFit:
        """The fit of a decode node's step time against its open streams: the seconds between a
        stream's tokens, prompts it prefilled meanwhile included (what the ITL SLO admits by)."""
        return self._fit("step", url)

    def decode_step_fit(self, url: str) -> LinearFit:
        """The same fit of the streams alone: only streams during whose life the node prefilled
        no prompt of its own. A step that carries prefills is slower whatever the decode role's
        size, so the elastic controller reads this one (router/routing/elastic.py)."""
        return self._fit("decode_step", url)

    # --- predicting -------------------------------------------------------------------------
    def prefill_s(
        self, worker, tokens: float, tenant: str | None = None, ahead: float = 0.0
    ) -> float:
        """Seconds until a prompt of `tokens` (to compute) of `tenant` sent to `worker` now ends
        its prefill, behind what it waits for there (`queue_ahead`, plus `ahead` tokens not sent
        yet: SLO admission's share of the router's queue); scaled up by how far the worker's open
        prefills are past theirs."""
        raw = self.fit_prefill_s(worker, tokens, tenant, ahead)
        return raw * self.overdue(worker.url, time.monotonic(), tenant)

    def fit_prefill_s(
        self, worker, tokens: float, tenant: str | None = None, ahead: float = 0.0
    ) -> float:
        """The fit's prediction alone."""
        kind = self._prefill_kind(worker.role, worker.in_flight > 0)
        ahead += queue_ahead(worker, tenant, tokens)
        return self._fit(kind, worker.url).predict(ahead + tokens)

    # --- prefills not ended yet -------------------------------------------------------------
    def opened(self, url: str, key: int, predicted_s: float, tenant: str | None = None) -> None:
        """A prefill of `tenant` sent to `url` now, predicted (by its fit) to end in
        `predicted_s`."""
        self._open.setdefault(url, {})[key] = (time.monotonic(), max(predicted_s, 1e-3), tenant)

    def closed(self, url: str, key: int) -> None:
        open_ = self._open.get(url)
        if open_ is not None:
            open_.pop(key, None)
            if not open_:
                del self._open[url]

    def overdue(self, url: str, now: float, tenant: str | None = None) -> float:
        """How far behind its fit a worker is now for `tenant`: the largest age over predicted
        time of the prefills of that tenant it has open (1 while none is late; every tenant's
        with `tenant` None). It reacts before any of them ends: in a burst, the first requests
        sent to a node slower than its fit say so while they wait. Only the tenant's own count:
        another tenant's prefill is late where the node's fair order put this tenant's prompts
        first (engine/fair_queue.py), which does not slow them."""
        open_ = self._open.get(url)
        if not open_:
            return 1.0
        late = [(now - t) / p for t, p, who in open_.values() if tenant is None or who == tenant]
        return max([1.0, *late])

    def streams_delay_s(self, decode, tokens: float) -> float:
        """The delay a prefill of `tokens` on `decode` adds to the streams open there, summed over
        them: each one's next steps carry the prefill's compute time (the busy fit's per-token
        slope, which holds no fixed cost of the request)."""
        return decode.in_flight * self.prefill_fit(decode).coefficients()[1] * max(0.0, tokens)

    def handoff_s(self, decode, prompt_tokens: float) -> float:
        return self._fit("handoff", decode.url).predict(prompt_tokens)

    def step_s(self, worker, streams: float) -> float:
        return self._fit("step", worker.url).predict(streams)

    def pd_ttft(
        self,
        prefill,
        decode,
        compute_tokens: float,
        prompt_tokens: float,
        tenant: str | None = None,
        ahead: float = 0.0,
    ) -> float:
        raw = self.prefill_s(prefill, compute_tokens, tenant, ahead)
        raw += self.handoff_s(decode, prompt_tokens)
        return self.calibrated("disaggregated", raw, compute_tokens)

    def local_ttft(
        self, worker, tokens: float, tenant: str | None = None, ahead: float = 0.0
    ) -> float:
        """A decode-only (or colocated) route's TTFT: the worker prefills the prompt itself."""
        path = "colocated" if worker.role == "colocated" else "decode_only"
        return self.calibrated(path, self.prefill_s(worker, tokens, tenant, ahead), tokens)

    def calibrated(self, path: str, seconds: float, tokens: float) -> float:
        """`seconds` scaled by the path's calibration for prompts of `tokens` (to compute)."""
        return seconds * math.exp(self.bias.get((path, size_class(tokens)), 0.0))

    def taken(self, path: str, tokens: float) -> None:
        """A route decision: the paths not taken drift back towards no correction, at the size
        class of `tokens`, what the path not taken would have computed."""
        c = size_class(tokens)
        for key in self.bias:
            if key[1] == c and key[0] != path:
                self.bias[key] *= BIAS_FORGET

    # --- learning ---------------------------------------------------------------------------
    def observe_prefill(self, url: str, role: str, busy: bool, tokens: int, seconds: float):
        if not self.cfg.fixed_costs:
            self._fit(self._prefill_kind(role, busy), url).observe(tokens, seconds)

    def observe_handoff(self, url: str, prompt_tokens: int, seconds: float) -> None:
        if not self.cfg.fixed_costs:
            self._fit("handoff", url).observe(prompt_tokens, max(0.0, seconds))

    def observe_step(self, url: str, streams: int, seconds: float, prefills: bool = False) -> None:
        """A finished stream's seconds between tokens; `prefills`: the node prefilled a prompt of
        its own during the stream's life (then the decode-only fit does not learn it)."""
        if not self.cfg.fixed_costs:
            self._fit("step", url).observe(streams, seconds)
            if not prefills:
                self._fit("decode_step", url).observe(streams, seconds)

    def record_error(
        self, path: str, predicted_s: float, actual_s: float, tokens: float
    ) -> float | None:
        """Keeps predicted / actual TTFT of a prompt of `tokens` (to compute) for the status
        page's quantiles, and calibrates its path at its size; returns it."""
        if actual_s <= 0 or predicted_s <= 0:
            return None
        ratio = predicted_s / actual_s
        if not self.cfg.fixed_costs:
            key = (path, size_class(tokens))
            b = self.bias.get(key, 0.0) - BIAS_RATE * math.log(ratio)
            self.bias[key] = max(-BIAS_LIMIT, min(BIAS_LIMIT, b))
        self.errors.setdefault(path, collections.deque(maxlen=ERRORS_KEPT)).append(ratio)
        return ratio

    def forget(self, url: str) -> None:
        for key in [k for k in self._fits if k[1] == url]:
            del self._fits[key]
        self._open.pop(url, None)

    # --- reporting --------------------------------------------------------------------------
    def describe(self) -> dict:
        """Each fit's coefficients, and the error quantiles per path (the status page)."""
        fits = {}
        for (kind, url), fit in sorted(self._fits.items()):
            a, b = fit.coefficients()
            fits.setdefault(url, {})[kind] = {
                "intercept_ms": round(a * 1e3, 3),
                "ms_per_unit": round(b * 1e3, 5),
                "observations": fit.observations,
            }
        errors = {path: quantiles(list(v)) for path, v in sorted(self.errors.items())}
        calibration: dict[str, dict[str, float]] = {}
        for (path, c), b in sorted(self.bias.items()):
            calibration.setdefault(path, {})[size_label(c)] = round(math.exp(b), 3)
        return {"fits": fits, "predicted_over_actual": errors, "calibration": calibration}


def queue_ahead(worker, tenant: str | None, tokens: float) -> float:
    """The prompt tokens queued on `worker` that a new prompt of `tokens` from `tenant` waits
    behind. A node prefills by weighted fair queuing between tenants, one tenant's prompts a
    forward (engine/fair_queue.py, prefill_shares.py): a prompt goes after its own tenant's queue
    and after those of another tenant's prompts whose fair tags end first. Another tenant's
    prompts each take their size in tags, so about the first (own + tokens) / size of them do:
    all of a queue of prompts as short as this one or shorter (up to own + tokens, as when both
    prefill in turn), none of a flood of longer ones. One tenant alone, or no tenant named: the
    whole queue, first come first served. Equal weights are assumed; a heavier tenant's request
    waits a little less than predicted."""
    by = worker.queued_by_tenant
    if tenant is None or not by or by.keys() <= {tenant}:
        return worker.queued_prompt_tokens
    own = by.get(tenant, 0)
    ahead = own
    for t, q in by.items():
        if t != tenant:
            size = q / max(1, worker.queued_requests_by_tenant.get(t, 1))
            ahead += min(q, size * math.floor((own + tokens) / size)) if size > 0 else 0
    return ahead


def quantiles(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    values = sorted(values)

    def q(p: float) -> float:
        return round(values[min(len(values) - 1, int(p * len(values)))], 3)

    return {"count": len(values), "p10": q(0.1), "p50": q(0.5), "p90": q(0.9)}
