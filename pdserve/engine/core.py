"""The shared vocabulary of the engine: sampling parameters, requests, batches.

Every PP rank builds the same `Req` objects from the same replicated inputs and mutates them with
the same outputs, so everything here must be a pure function of those inputs
(docs/ARCHITECTURE.md section 4).

Lengths, named once and derived from each other:

    prompt_len    = len(input_ids)
    seq_len       = prompt_len + len(output_ids)       tokens the request has, prompt + generated
    kv_len        = tokens whose KV is written in the pool
                    (or scheduled to be, once a batch is built)
    cached_len    = prefix-cache hit at admission (pages shared with other requests)

The tokens one batch computes for a request are its `BatchEntry.num_new` (engine/scheduler.py).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields
from typing import Any


class ParamError(ValueError):
    """A request parameter is invalid. `field` names it, for a 400 that says what to fix."""

    def __init__(self, field_name: str, message: str):
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


# Fields a request may send as null to get the model's default: the value in its
# generation_config.json, else this one (OpenAI's and vLLM's). An absent field keeps the native
# default below (greedy); the router sends null for what an OpenAI client left out.
MODEL_DEFAULTED = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "min_p": 0.0}


def _need(ok: bool, name: str, msg: str) -> None:
    if not ok:
        raise ParamError(name, msg)


MAX_LOGIT_BIAS = 300  # OpenAI's limit on logit_bias entries


def _real(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bias_pairs(v: Any) -> tuple[tuple[int, float], ...]:
    """logit_bias as OpenAI sends it ({"123": 5.0}, string keys) or as pairs, sorted by token id."""
    if v is None:
        return ()
    if isinstance(v, dict):
        items = list(v.items())
    elif isinstance(v, (list, tuple)) and all(
        isinstance(p, (list, tuple)) and len(p) == 2 for p in v
    ):
        items = [tuple(p) for p in v]
    else:
        raise ParamError("logit_bias", "must map token ids to biases")
    out = {}
    for t, b in items:
        try:
            tid = int(t) if not isinstance(t, bool) else None
        except (TypeError, ValueError):
            tid = None
        if tid is None or str(t).strip() != str(tid):
            raise ParamError("logit_bias", f"keys must be token ids, got {t!r}")
        out[tid] = b
    return tuple(sorted(out.items()))


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0  # 0 (below 1e-5) => greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 => off
    min_p: float = 0.0
    seed: int | None = None  # same seed => same sampled output
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Penalties (OpenAI / vLLM semantics): presence and frequency on the generated tokens,
    # repetition (divide positive logits, multiply negative ones) on prompt and generated tokens.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit), sorted by id
    guide: tuple[str, str] | None = None  # structured output: (kind, spec), engine/grammar.py

    @property
    def greedy(self) -> bool:
        # Below 1e-5 sampling is argmax anyway, and logits / temperature can overflow float32.
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> SamplingParams:
        """Raises ParamError naming the first bad field; returns self."""
        need = _need
        need(
            isinstance(self.max_tokens, int)
            and not isinstance(self.max_tokens, bool)
            and self.max_tokens >= 1,
            "max_tokens",
            f"must be an integer >= 1, got {self.max_tokens!r}",
        )
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            need(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                name,
                f"must be a finite number, got {v!r}",
            )
        need(
            0.0 <= self.temperature <= 100.0,
            "temperature",
            f"must be in [0, 100], got {self.temperature}",
        )
        need(0.0 < self.top_p <= 1.0, "top_p", f"must be in (0, 1], got {self.top_p}")
        need(0.0 <= self.min_p <= 1.0, "min_p", f"must be in [0, 1], got {self.min_p}")
        need(
            isinstance(self.top_k, int) and (self.top_k == -1 or 1 <= self.top_k < 2**63),
            "top_k",
            f"must be -1 (off) or in [1, 2^63), got {self.top_k!r}",
        )
        need(
            self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed < 2**63),
            "seed",
            f"must be an integer in [0, 2^63), got {self.seed!r}",
        )
        need(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        need(len(self.stop) <= 16, "stop", "at most 16 stop strings")
        need(
            all(isinstance(t, int) and 0 <= t < 2**63 for t in self.stop_token_ids),
            "stop_token_ids",
            "must be integers in [0, 2^63)",
        )
        need(
            isinstance(self.ignore_eos, bool),
            "ignore_eos",
            f"must be a boolean, got {self.ignore_eos!r}",
        )
        need(
            isinstance(self.logprobs, bool), "logprobs", f"must be a boolean, got {self.logprobs!r}"
        )
        need(
            isinstance(self.top_logprobs, int) and 0 <= self.top_logprobs <= 20,
            "top_logprobs",
            f"must be an integer in [0, 20], got {self.top_logprobs!r}",
        )
        need(self.logprobs or not self.top_logprobs, "top_logprobs", "needs logprobs: true")
        self._check_adjustments()
        self._check_guide()
        return self

    def _check_adjustments(self) -> None:
        """Penalties and logit_bias."""
        need = _need
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            need(_real(v) and -2.0 <= v <= 2.0, name, f"must be in [-2, 2], got {v!r}")
        v = self.repetition_penalty
        need(_real(v) and 0.0 < v <= 10.0, "repetition_penalty", f"must be in (0, 10], got {v!r}")
        need(
            len(self.logit_bias) <= MAX_LOGIT_BIAS, "logit_bias", f"at most {MAX_LOGIT_BIAS} tokens"
        )
        for t, b in self.logit_bias:
            need(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31,
                "logit_bias",
                f"token ids must be integers >= 0, got {t!r}",
            )
            need(
                _real(b) and -100.0 <= b <= 100.0,
                "logit_bias",
                f"biases are in [-100, 100], got {b!r}",
            )

    @property
    def penalized(self) -> bool:
        """Whether sampling must adjust this request's logits before choosing."""
        return bool(
            self.presence_penalty
            or self.frequency_penalty
            or self.repetition_penalty != 1.0
            or self.logit_bias
        )

    def _check_guide(self) -> None:
        if self.guide is None:
            return
        from pdserve.engine.grammar import GrammarError, check_guide

        try:
            check_guide(self.guide)
        except GrammarError as e:
            raise ParamError("guide", str(e)) from None

    @classmethod
    def from_dict(
        cls, d: dict[str, Any] | None, model_defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """Builds validated params from a JSON-like dict; unknown keys are an error naming the key.
        A MODEL_DEFAULTED key given as null takes `model_defaults`' value, else the neutral one."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        for k in d:
            if k not in names:
                raise ParamError(
                    k, f"unknown sampling parameter (known: {', '.join(sorted(names))})"
                )
        for k, neutral in MODEL_DEFAULTED.items():
            if k in d and d[k] is None:
                d[k] = (model_defaults or {}).get(k, neutral)
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
        if "logit_bias" in d:
            d["logit_bias"] = _bias_pairs(d["logit_bias"])
        if isinstance(d.get("guide"), list):
            d["guide"] = tuple(d["guide"])
        for k in ("stop", "stop_token_ids"):
            if k in d:
                if d[k] is None:
                    d[k] = ()
                elif not isinstance(d[k], (list, tuple)):
                    raise ParamError(k, "must be a list")
                else:
                    d[k] = tuple(d[k])
        return cls(**d).validate()

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["stop"] = list(self.stop)
        d["stop_token_ids"] = list(self.stop_token_ids)
        d["logit_bias"] = [list(p) for p in self.logit_bias]
        d["guide"] = list(self.guide) if self.guide is not None else None
        return d


class ReqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    FINISHED = "finished"


@dataclass(frozen=True)
class FinishReason:
    kind: str  # "stop" | "length" | "abort"
    message: str = ""  # why, for aborts and errors
    matched: int | str | None = None  # the stop token id or stop string

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"type": self.kind}
        if self.message:
            d["message"] = self.message
        if self.matched is not None:
            d["matched"] = self.matched
        return d


MAX_TENANT_CHARS = 128
MAX_WEIGHT = 1e6
PRIORITY_RANGE = (-(2**31), 2**31)  # the router's `priority` field (vLLM's range)


@dataclass(frozen=True)
class Share:
    """Whose request this is, for the fair order of a node's waiting queue (engine/fair_queue.py):
    the router's tenant for it, the tenant's weight, and the request's priority (lower first). The
    router sets it on every request it sends; a request without one is the anonymous tenant's."""

    tenant: str = ""
    weight: float = 1.0
    priority: int = 0

    def check(self) -> None:
        """Raises ParamError naming the bad field (the wire codec and the node front call it)."""
        _need(len(self.tenant) <= MAX_TENANT_CHARS, "tenant", f"at most {MAX_TENANT_CHARS} chars")
        _need(
            math.isfinite(self.weight) and 0 < self.weight <= MAX_WEIGHT,
            "tenant_weight",
            f"must be in (0, {MAX_WEIGHT:g}]",
        )
        lo, hi = PRIORITY_RANGE
        _need(lo <= self.priority < hi, "priority", f"must be in [{lo}, {hi})")


ANONYMOUS_SHARE = Share()


@dataclass(eq=False)  # identity hash, so a Req can live in a set
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    arrival: int = 0  # replicated arrival counter (never wall clock)
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    pages: list[int] = field(default_factory=list)  # page table: logical page i -> pool page
    kv_len: int = 0
    cached_len: int = 0
    # the first pages of `pages` that hold no sliding layer's KV: a PD decode request's prompt
    # pages before the window, which the transfer skipped (engine/prefix_cache.py)
    partial_pages: int = 0
    # on a windowed pool (engine/window_pages.py): the sliding layers' pages, from logical page
    # `sliding_first` on (the pages before it, out of every later query's window, are freed)
    sliding_pages: list[int] = field(default_factory=list)
    sliding_first: int = 0
    finish: FinishReason | None = None
    to_finish: FinishReason | None = None  # set by abort while in flight, applied at harvest
    in_flight: bool = False  # scheduled in a slot whose outputs are not harvested
    prefix_node: Any = None  # prefix-cache lock handle
    guide_state: Any = None  # sampling rank only: the grammar matcher (engine/grammar.py)
    # replicated: its guide's compile on the sampling rank is not yet known to be done, so no
    # forward samples it (engine/grammar.py); the sampling rank's notice clears it on every rank
    guide_pending: bool = False
    # sampling rank only: its guide's compile (a Future), held from arrival to its first sample,
    # so the compiled-guide cache may drop it meanwhile (engine/grammar.py)
    guide_compile: Any = None
    share: Share = ANONYMOUS_SHARE  # its tenant's place in the waiting queue's fair order
    fair_key: tuple = ()  # (priority, finish tag, arrival): its place in that order (fair_queue.py)

    @property
    def prompt_len(self) -> int:
        return len(self.input_ids)

    @property
    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finish is not None
