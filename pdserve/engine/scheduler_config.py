"""The scheduler's limits, and whether a request can ever run under them: apart from the scheduler
so the limits and the admission check read on their own (both are pure, identical on every rank).
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.engine.config import check_batch_limits
from pdserve.engine.core import ParamError, SamplingParams
from pdserve.engine.kv_cache import pages_needed


@dataclass(frozen=True)
class SchedulerConfig:
    page_size: int = 16
    chunk_size: int = 512  # max prompt tokens of one request in one batch
    max_batch_tokens: int = 2048  # max new tokens in one forward (decodes + prefill chunks)
    # max prompt tokens in a forward while any request decodes (0: max_batch_tokens): a running
    # stream's next token then waits for at most this much prefill
    mixed_prefill_tokens: int = 0
    # max prompt tokens of one tenant in a forward while another tenant has a request on the node
    # (0: no cap): a flood's prefill delays the other tenants' next step by at most this much
    fair_prefill_tokens: int = 0
    max_running: int = 64  # admitted requests across all slots
    max_context: int = 2048  # prompt + output tokens of one request
    enable_prefix_cache: bool = True
    num_slots: int = 1  # microbatch slots (pp_size + async_depth)
    window: int = 0  # the model's sliding window: how far back a cached prefix must be whole

    def __post_init__(self):
        for name in ("page_size", "max_running", "max_context", "num_slots"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        check_batch_limits(
            self.chunk_size,
            self.max_batch_tokens,
            self.mixed_prefill_tokens,
            self.fair_prefill_tokens,
        )


def check_admissible(
    cfg: SchedulerConfig, num_pages: int, prompt_len: int, params: SamplingParams
) -> None:
    """Raises ParamError for a request that could never run
    (too long for the context or for a pool of `num_pages` pages)."""
    if prompt_len < 1:
        raise ParamError("prompt", "is empty")
    total = prompt_len + params.max_tokens
    if total > cfg.max_context:
        raise ParamError(
            "max_tokens",
            f"prompt ({prompt_len} tokens) + max_tokens ({params.max_tokens}) "
            f"exceeds the context limit of {cfg.max_context} tokens",
        )
    if pages_needed(total, cfg.page_size) > num_pages:
        raise ParamError(
            "max_tokens",
            f"prompt + max_tokens ({total} tokens) can never fit in the KV pool "
            f"({num_pages * cfg.page_size} tokens)",
        )
