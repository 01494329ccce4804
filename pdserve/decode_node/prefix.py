"""The decode prefix cache of a PD decode rank: the prompt pages a room takes from the rank's radix
cache (engine/prefix_cache.py) instead of receiving them.

A finished request's pages (transferred prompt plus generated tokens) go into the cache as on a
colocated node (`Scheduler._release_kv`). A new room then holds the longest cached page-aligned
prefix of its prompt, locked, and registers only the pages after it (`KVReceiver.register(...,
prefix_tokens)`): the prefill side still computes the whole prompt but sends only those pages, and
cannot address the cached ones.

How much: at most `prompt_len - 1` tokens, as `Scheduler._admit` matches. The decode side computes
nothing for the prompt (the first token comes in the aux data), so a whole cached prompt would do;
the bound keeps the page of the last prompt token the room's own, so every registered room has at
least one page (`pd.pages` non-empty means "registered" in the loop) and at least one transferred
token, and it costs one page only when the prompt fills its last page exactly.

Agreement: every decode rank's cache sees the same inserts, evictions and matches in the same order
(docs/ARCHITECTURE.md section 4), so the match is the same on every rank; `DecodeLoop._hold_prefix`
records it for the rank consensus checker.

Ownership (P = page_size, H = held.tokens):

    held.pages          tokens [0, H)       tree pages, locked by `held.handle`, never written
    pd.pages            tokens [H, prompt)  the room's own pages, written by the transfer
    success             the scheduler takes both (`add_prefilled(..., cached_len=H, prefix_node)`)
                        and inserts / unlocks at finish or retraction, like any request
    failure or abort    the prefix is unlocked at once (nothing could write it); the own pages
                        wait in quarantine for the release vote
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.engine.scheduler import Scheduler


@dataclass(eq=False)
class HeldPrefix:
    """A room's cached prompt prefix on one decode rank."""

    pages: list[int] = field(default_factory=list)  # tree pages of tokens [0, tokens)
    handle: Any = None  # the prefix cache node locked for them (None: nothing locked)
    tokens: int = 0  # len(pages) * page_size


def hold_prefix(sched: Scheduler, prompt: list[int]) -> HeldPrefix:
    """Locks the longest cached page-aligned prefix of `prompt` of at most `len(prompt) - 1`
    tokens (nothing without a prefix cache)."""
    cache = sched.cache
    if cache is None:
        return HeldPrefix()
    pages, handle = cache.match(prompt, len(prompt) - 1)
    cache.lock(handle)
    return HeldPrefix(pages, handle, len(pages) * sched.cfg.page_size)


def release_prefix(sched: Scheduler, held: HeldPrefix | None) -> None:
    """Unlocks a held prefix the room no longer needs (its pages stay in the cache)."""
    if held is not None and held.handle is not None:
        sched.cache.unlock(held.handle)
        held.handle, held.pages, held.tokens = None, [], 0
