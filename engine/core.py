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

    @property
    def greedy(self) -> bool:
        # Below 1e-5 sampling is argmax anyway, and logits / temperature can overflow float32.
        return self.temperature < 1e-5 or self.top_k == 1

    def validate(self) -> SamplingParams:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ParamError(name, msg)

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
        return self

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> SamplingParams:
        """Builds validated params from a JSON-like dict;
        unknown keys are an error naming the key."""
        d = dict(d or {})
        names = {f.name for f in fields(cls)}
        for k in d:
            if k not in names:
                raise ParamError(
                    k, f"unknown sampling parameter (known: {', '.join(sorted(names))})"
                )
        if isinstance(d.get("stop"), str):
            d["stop"] = [d["stop"]]
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
    finish: FinishReason | None = None
    to_finish: FinishReason | None = None  # set by abort while in flight, applied at harvest
    in_flight: bool = False  # scheduled in a slot whose outputs are not harvested
    prefix_node: Any = None  # prefix-cache lock handle

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
