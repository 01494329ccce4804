"""Two-pass ring votes bound to microbatch slots (docs/ARCHITECTURE.md section 5, way 2).

Every rank observes, for each vote kind, which ids (rooms or rids) reached a final state locally:
`good` (e.g. transfer Success) or `bad` (Failed). The vote turns these different observations into
one verdict that every rank applies in the same iteration.

Pass 1 (PP0 -> last, in the slot being scheduled): each rank merges its ballot into the running
tally and forwards it. Pass 2 (last -> PP0 -> ... -> PP(n-2), when the slot is harvested): the
verdict travels round the ring and every rank returns it to its caller, which applies it.

The verdict of `slot` is, per kind, with G_k / B_k the good / bad ids of rank k after its local
aborts were moved from good to bad, and T_k = G_k | B_k (ids final on rank k):

    good = G_0 & G_1 & ... & G_n-1                     progress needs every rank
    bad  = (B_0 | B_1 | ... | B_n-1) & T_0 & ... & T_n-1
                                                        one failure fails all, but only once every
                                                        rank reached a final state for the id

So an id is decided (good or bad) only when every rank has it final; nothing is applied early. The
tally carried in pass 1 keeps `good | bad` = ids final on every rank so far, which is what lets
bad be restricted without a third set (see `merge`).

Pending ids are not decided twice: the last rank removes from a new verdict every id that is
already in a verdict not yet harvested, so each id is applied at most once per decision, on all
ranks (callers still apply only ids they hold, which is the same on every rank).

Call order, identical on every rank (L = num_slots = pp_size + async_depth), every iteration, even
when all ballots are empty (the empty messages are the metronome):

    for i in itertools.count():
        slot = i % L
        # PP0: send | middle: recv, merge, send | last: recv, merge, keep
        vote.pass1(slot, ballots)
        ...                                # schedule, launch, exchange hidden states
        # last: return the verdict it sent to PP0 in pass 1 |
        # PP0: recv, forward | middle: recv, forward unless next is last
        verdicts = vote.pass2((slot + 1) % L)
        apply(verdicts)                    # same verdicts, same iteration, every rank

pass2(h) returns the verdict of the latest pass1(h) (empty verdicts while slot h never voted), so a
vote cast in iteration j is applied in iteration j + L - 1. The last rank sends a slot's verdict to
PP0 as soon as its pass 1 completes, and PP0 receives it when it harvests that slot, L - 1 turns
later: like the sampled outputs, the verdict never makes PP0 wait for the last rank's current
iteration, so the pipeline stays full, and the last rank never waits on pass 2.

Applying safely: `Verdict.partition(is_done)` splits off ids whose local status is not final. The
invariant above makes that split empty on a correct rank (every rank had the id final in pass 1,
and final states are absorbing, see kvpoll.update_status); if it is not, the ids are logged at
warning level and returned as `retry` so the caller keeps them and offers them again; never an
exception, never applied early.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from pdserve.consensus.kvpoll import KVPoll, done_for
from pdserve.consensus.transport import ConsensusError, ConsensusTimeout, RingTransport

logger = logging.getLogger(__name__)

RELEASE = "release"  # prefill: transfer ended (Success/Failed) -> free the prefill KV
TRANSFERRED = "transferred"  # decode: KV arrived (Success) -> start decoding; Failed -> fail
PREALLOC = "prealloc"  # decode: good = WaitingForInput (pages preallocated), bad = Failed
KINDS = (RELEASE, TRANSFERRED, PREALLOC)

Id = int | str
_EMPTY: frozenset = frozenset()
_ID_TYPES = frozenset({int, str})


def _id_key(x: Id) -> tuple[int, int | str]:
    return (1, x) if isinstance(x, str) else (0, x)


def _check_ids(ids: Iterable, what: str) -> frozenset:
    s = ids if type(ids) is frozenset else frozenset(ids)
    if s and not set(map(type, s)) <= _ID_TYPES:  # exact types: no bool, no IntEnum
        bad = next(x for x in s if type(x) not in _ID_TYPES)
        raise TypeError(f"{what}: vote ids are ints (rooms) or strings (rids), got {bad!r}")
    return s


def _sorted(ids: frozenset) -> list:
    try:
        return sorted(ids)  # one id type per kind: the fast, usual case
    except TypeError:
        return sorted(ids, key=_id_key)  # ints and strings mixed: ints first


@dataclass(frozen=True)
class Ballot:
    """One rank's observation for one kind: ids final-good, final-bad, and locally aborted."""

    good: frozenset = _EMPTY
    bad: frozenset = _EMPTY
    aborted: frozenset = _EMPTY

    @classmethod
    def from_statuses(
        cls, kind: str, statuses: Mapping[Id, KVPoll | None], aborted: Iterable[Id] = ()
    ) -> Ballot:
        """Ballot from local KVPoll statuses: Failed -> bad,
        other final states for `kind` -> good."""
        good = {i for i, s in statuses.items() if s != KVPoll.Failed and done_for(kind, s)}
        bad = {i for i, s in statuses.items() if s == KVPoll.Failed}
        return cls(frozenset(good), frozenset(bad), frozenset(aborted))

    def resolved(self) -> tuple[frozenset, frozenset]:
        """(good, bad) with aborted ids moved from good to bad;
        an id both good and bad counts bad."""
        good, bad = _check_ids(self.good, "good"), _check_ids(self.bad, "bad")
        aborted = _check_ids(self.aborted, "aborted")
        moved = good & aborted
        return good - bad - aborted, bad | moved


@dataclass(frozen=True)
class Verdict:
    """What every rank applies for one kind: ids good on all ranks, ids failed somewhere."""

    good: frozenset = _EMPTY
    bad: frozenset = _EMPTY

    def partition(
        self,
        is_done: Callable[[Id], bool],
        kind: str = "",
    ) -> tuple[frozenset, frozenset, frozenset]:
        """(good, bad, retry): ids whose local status is not final go to retry, with a warning."""
        retry = frozenset(i for i in self.good | self.bad if not is_done(i))
        if retry:
            logger.warning(
                "pid %d: %s verdict has %d id(s) not final locally, retried next turn: %s",
                os.getpid(),
                kind or "vote",
                len(retry),
                sorted(retry, key=_id_key)[:8],
            )
        return self.good - retry, self.bad - retry, retry


def merge(
    tally: tuple[frozenset, frozenset],
    good_k: frozenset,
    bad_k: frozenset,
) -> tuple[frozenset, frozenset]:
    """Fold rank k's resolved ballot into the pass-1 tally (good, bad).

    Invariant kept: tally good | bad = ids final on every rank so far, good & bad = {}.
    """
    good, bad = tally
    return good & good_k, (bad & (good_k | bad_k)) | (good & bad_k)


def _pack(sets: Sequence[tuple[frozenset, frozenset]]) -> list:
    return [[_sorted(g), _sorted(b)] for g, b in sets]


class RingVote:
    """Two-pass ring vote over `transport` for a fixed tuple of `kinds`, with `num_slots` slots."""

    def __init__(self, transport: RingTransport, num_slots: int, kinds: Sequence[str] = (RELEASE,)):
        if not (isinstance(num_slots, int) and num_slots >= 1):
            raise ValueError(f"num_slots must be an int >= 1, got {num_slots!r}")
        if not kinds or len(set(kinds)) != len(kinds):
            raise ValueError(f"kinds must be non-empty and distinct, got {kinds!r}")
        self.t = transport
        self.num_slots = num_slots
        self.kinds = tuple(kinds)
        self._voted = [False] * num_slots  # pass1 done, pass2 not yet (every rank)
        self._kept: list[list | None] = [
            None
        ] * num_slots  # last rank: verdict per slot, not yet sent

    # ---- pass 1 -------------------------------------------------------------------------------
    def pass1(self, slot: int, ballots: Mapping[str, Ballot]) -> None:
        """Cast this rank's ballots for `slot` (kinds missing from `ballots` vote empty)."""
        self._check_slot(slot)
        if self._voted[slot]:
            raise ConsensusError(f"pass1 for slot {slot} again before pass2 harvested it")
        unknown = set(ballots) - set(self.kinds)
        if unknown:
            raise ValueError(f"unknown vote kind(s) {sorted(unknown)}; this vote has {self.kinds}")
        mine = [ballots.get(k, Ballot()).resolved() for k in self.kinds]
        if self.t.is_first:
            tally = mine
        else:
            tally = [
                merge(tk, g, b) for tk, (g, b) in zip(self._recv("v1", slot)[1], mine, strict=True)
            ]
        self._voted[slot] = True
        if self.t.is_last:
            # The verdict leaves at once; PP0 takes it when it harvests `slot` (L - 1 turns
            # later), so PP0 never waits for the last rank's current iteration and the pipeline
            # stays full.
            self._kept[slot] = kept = self._without_pending(slot, tally)
            if self.t.size > 1:
                self.t.send_next(["v2", slot, _pack(kept)])
        else:
            self.t.send_next(["v1", slot, _pack(tally)])

    def _without_pending(self, slot: int, tally: list) -> list:
        out = []
        for j, (good, bad) in enumerate(tally):
            pending: set = set()
            for s, kept in enumerate(self._kept):
                if kept is not None and s != slot:
                    pending |= kept[j][0] | kept[j][1]
            out.append((good - pending, bad - pending))
        return out

    # ---- pass 2 -------------------------------------------------------------------------------
    def pass2(self, slot: int) -> dict[str, Verdict]:
        """The verdicts of `slot`'s latest pass1, on every rank in the same iteration."""
        self._check_slot(slot)
        if not self._voted[slot]:
            # The slot has not voted yet (the first turns): every rank knows it, nothing travels.
            return {k: Verdict() for k in self.kinds}
        if self.t.is_last:
            kept = self._kept[slot]
            assert kept is not None  # the last rank keeps a verdict whenever the slot voted (pass1)
            self._kept[slot] = None
        else:
            raw, kept = self._recv("v2", slot)
            if self.t.rank + 1 < self.t.size - 1:
                self.t.send_next(raw)  # forwarded unchanged (already sorted)
        self._voted[slot] = False
        return {k: Verdict(g, b) for k, (g, b) in zip(self.kinds, kept, strict=True)}

    # ---- helpers ------------------------------------------------------------------------------
    def _check_slot(self, slot: int) -> None:
        if not (isinstance(slot, int) and 0 <= slot < self.num_slots):
            raise ValueError(f"slot must be in [0, {self.num_slots}), got {slot!r}")

    def _recv(self, tag: str, slot: int) -> tuple[list, list[tuple[frozenset, frozenset]]]:
        """(raw message, parsed (good, bad) per kind) of the vote `tag` for `slot` from the
        previous rank."""
        try:
            msg = self.t.recv_prev()
        except ConsensusTimeout as e:
            raise ConsensusTimeout(
                f"{e} (waiting for vote {tag} of slot {slot}, kinds {self.kinds})"
            ) from None
        try:
            if msg[0] != tag or msg[1] != slot or len(msg) != 3 or len(msg[2]) != len(self.kinds):
                raise ValueError("tag, slot or kind count differs")
            parsed = [(frozenset(g), frozenset(b)) for g, b in msg[2]]
        except (TypeError, ValueError, IndexError, KeyError) as e:
            raise ConsensusError(
                f"rank {self.t.rank}: expected vote {tag} of slot {slot} with "
                f"{len(self.kinds)} kind(s), got {str(msg)[:200]} ({e}); "
                "ranks are out of step"
            ) from None
        return msg, parsed
