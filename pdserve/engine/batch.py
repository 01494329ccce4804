"""What one forward computes and what comes back: the scheduler's `ScheduledBatch` (one
`BatchEntry` per request: tokens `[start, start + num_new)`, its pages, whether it samples) and the
last rank's `SampleOut` for the batch's sampling entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.engine.core import Req


@dataclass
class BatchEntry:
    req: Req
    start: int
    num_new: int
    need_logits: bool
    pages: list[int]
    sliding_pages: list[int] | None = None  # a windowed pool's table (engine/window_pages.py)


@dataclass
class ScheduledBatch:
    slot: int
    entries: list[BatchEntry] = field(default_factory=list)
    # a live request waits for its guide's compile: the last rank's outputs for this batch go
    # round the ring even if it samples nothing, and say which compiles are done (grammar.py)
    awaits_guides: bool = False

    def digest(self) -> list:
        """What the rank consensus checker compares of a batch (consensus/rank_checker.py)."""
        entries = [
            (
                e.req.rid,
                e.start,
                e.num_new,
                e.need_logits,
                e.pages[-1:],
                (e.sliding_pages or [])[-1:],
            )
            for e in self.entries
        ]
        return [self.slot, self.awaits_guides, entries]

    @property
    def num_tokens(self) -> int:
        return sum(e.num_new for e in self.entries)

    @property
    def sampling_entries(self) -> list[BatchEntry]:
        return [e for e in self.entries if e.need_logits]

    @property
    def is_pure_chunk(self) -> bool:
        """A batch whose outputs carry no token (only intermediate prefill chunks)."""
        return bool(self.entries) and not any(e.need_logits for e in self.entries)


@dataclass
class SampleOut:
    """What the last rank sampled for a batch's sampling entries, in entry order."""

    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
