"""Structured output: a grammar constrains which tokens a request may sample (xgrammar).

A request's `guide` is (kind, spec): `json_schema` (a JSON Schema, as JSON text), `json_object`
(any JSON object; spec ""), `regex`, `choice` (a JSON list of strings; the output is one), or
`structural_tag` (xgrammar's structural tag, as JSON text: the router forces tool calls in a model
family's format with one, router/tools/request.py).

Only the rank that samples (the last PP rank) holds grammar state, and that state is a function of
the request's own generated tokens: before each sampling step the matcher is fed the tokens the
request gained since the last one (`Req.output_ids`, identical on every rank), then the step's
bitmask removes every token the grammar forbids. So nothing new travels between ranks, a
retracted request resumes with the same state, and on a PD pair the decode side's matcher starts
by feeding the first token the prefill side sampled under the same grammar.

Compiling a grammar against the vocabulary takes from milliseconds up to seconds for a large JSON
Schema. It never runs in a step, and no step waits for it:
- the sampling rank starts it on a thread of its own, of lower priority, as soon as a guided
  request arrives (`GrammarSampler.prepare`, called by the loops as they apply the request);
- every rank marks the request `guide_pending`, and the scheduler computes all of it but the token
  that samples (engine/guide_hold.py);
- the sampling rank reports the compiles that are done (`compiled`), and every rank clears the
  mark at the same point of the lockstep: at once on a lone rank, or with the outputs that go
  round the ring on a pipeline (runtime/rank/slot_loop.py).
So a stream of distinct large schemas slows the requests that carry them, not every stream on the
node, as it did while the first sample waited for the compile. The front bounds the compile before
that: a guide must compile within `--grammar-compile-timeout` on the front's own compiler, else a
400 (runtime/front/guide_gate.py). Compiled guides are cached by their (kind, spec) on both.

xgrammar (MLC) was chosen over llguidance and outlines-core: it is the engine vLLM and SGLang use by
default, it ships CPU wheels with a torch bitmask kernel, and it compiles JSON Schema, EBNF, regex
and structural tags (tool calls) in one API. Its per-token cost on this CPU is in bench/.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Container, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)
KINDS = ("json_schema", "json_object", "regex", "choice", "structural_tag")
MAX_SPEC = 64 << 10  # characters of a schema, regex or choice list
MAX_COMPILED = 256  # compiled guides a sampling rank keeps (the oldest goes first)
# ... and their bytes (xgrammar's `memory_size_bytes`), beyond the known guides' own bound
# (engine/guide_hold.py KNOWN_BYTES): a 42 KB JSON schema compiles to 6.6 MB against SmolLM2's
# vocabulary, so 256 of them would hold 1.7 GB
MAX_COMPILED_BYTES = 128 << 20
# The niceness added to the threads that compile guides, the front's check (runtime/front/
# guide_gate.py) and the sampling rank's: a compile is work one request asked for, and nothing but
# that request waits on it, so it must not take the CPU from the forward that every running stream
# waits on. Linux schedules threads by their own nice value, and xgrammar's worker threads inherit
# it from the thread that builds the compiler, so each builds its compiler on its niced thread.
COMPILE_NICE = 10


def lower_this_threads_priority(nice: int = COMPILE_NICE) -> None:
    """Adds `nice` to the calling thread's niceness (a ThreadPoolExecutor initializer). Raising
    one's own niceness needs no privilege; where the OS refuses anyway, the thread runs as is."""
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        pass


class GrammarError(ValueError):
    """A guide that is not one of the kinds, or whose spec does not compile."""


def _grammar(kind: str, spec: str):
    import xgrammar as xgr

    if kind == "json_schema":
        return xgr.Grammar.from_json_schema(spec, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return xgr.Grammar.builtin_json_grammar()
    if kind == "regex":
        return xgr.Grammar.from_regex(spec)
    if kind == "structural_tag":
        return xgr.Grammar.from_structural_tag(spec)
    choices = json.loads(spec)
    return xgr.Grammar.from_regex("|".join(_regex_literal(c) for c in choices))


def _regex_literal(s: str) -> str:
    return "(" + "".join("\\" + c if c in r"\.^$|?*+()[]{}/" else c for c in s) + ")"


def check_guide(guide: Any) -> tuple[str, str]:
    """The guide as (kind, spec) if it is well formed and compiles; GrammarError naming why."""
    if (
        not isinstance(guide, (list, tuple))
        or len(guide) != 2
        or guide[0] not in KINDS
        or not isinstance(guide[1], str)
        or len(guide[1]) > MAX_SPEC
    ):
        raise GrammarError(f"must be [kind, spec] with kind one of {', '.join(KINDS)}")
    kind, spec = guide
    if kind == "choice":
        try:
            choices = json.loads(spec)
        except ValueError:
            choices = None
        if not (
            isinstance(choices, list)
            and 0 < len(choices) <= 256
            and all(isinstance(c, str) and c for c in choices)
        ):
            raise GrammarError("choice: a JSON list of 1 to 256 non-empty strings")
    if why := _parse_error(kind, spec):
        raise GrammarError(why)
    return kind, spec


@functools.lru_cache(maxsize=64)
def _parse_error(kind: str, spec: str) -> str:
    """Why the guide does not parse ("" if it does). Cached: every rank checks every request's
    params as it applies it, and a large schema takes milliseconds to parse."""
    try:
        _grammar(kind, spec)
    except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses with its reason
        return f"{kind} does not compile: {str(e).splitlines()[0][:200]}"
    return ""


@dataclass
class GuideState:
    """One request's matcher on the sampling rank, and how many of its tokens it has seen."""

    matcher: Any
    fed: int = 0


@dataclass
class GrammarSampler:
    """Grammar masks for a sampling rank: compiles each guide once (cached), keeps one matcher per
    request (on the Req, so it goes with it), and masks a batch's logits in place."""

    load_tokenizer: Any  # () -> the model's HF tokenizer, loaded at the first guided request
    vocab_size: int
    stop_token_ids: tuple[int, ...]
    _compiler: Any = None
    # guide -> its compile, done or under way on `_pool`; touched only by the rank's own thread
    _compiled: OrderedDict[tuple[str, str], Future] = field(default_factory=OrderedDict)
    _sizes: dict[tuple[str, str], int] = field(default_factory=dict)  # a done entry's bytes
    # the guides every rank knows compiled (engine/guide_hold.py `guides_known`): never evicted
    pinned: Container = ()
    # () -> the guides held requests wait for, whose report may be on its way round to make them
    # known (engine/guide_hold.py `guides_awaited`): evicted only where nothing else can go
    awaited: Callable[[], Container] = lambda: ()
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(
            1, thread_name_prefix="grammar-compile", initializer=lower_this_threads_priority
        )
    )

    def warm_up_in_background(self) -> None:
        """Builds the tokenizer info and the compiler (seconds on a small CPU) on the compile
        thread, off the rank's loop; the first guide's compile queues behind it."""
        self._pool.submit(self._compiler_ready)

    def _compiler_ready(self):
        import xgrammar as xgr

        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(
                    self.load_tokenizer(),
                    vocab_size=self.vocab_size,
                    stop_token_ids=list(self.stop_token_ids),
                )
                # one worker thread, made now on the calling (niced) thread: see COMPILE_NICE
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def prepare(self, guide: tuple[str, str]) -> Future:
        """The compile of `guide`, started off the rank's thread unless it is done or under way.
        The cache keeps the last MAX_COMPILED; a request holds its own (`Req.guide_compile`)."""
        if guide in self._compiled:
            self._compiled.move_to_end(guide)
            return self._compiled[guide]
        return self._keep(guide, self._pool.submit(self._build, guide))

    def _keep(self, guide: tuple[str, str], fut: Future) -> Future:
        """`fut` as the cache's entry for `guide`, newest; the oldest entries not in use go to make
        room, and while those others' compiles hold more than MAX_COMPILED_BYTES. A guide in use
        stays: a known one (a request with it is not held), or one a held request waits for,
        whose report may be on its way round to make it known."""
        self._drop(guide)
        awaited = self.awaited()
        while len(self._compiled) >= MAX_COMPILED:  # known guides are fewer than MAX_COMPILED
            free = [g for g in self._compiled if g not in self.pinned]
            self._drop(next((g for g in free if g not in awaited), free[0]))
        self._compiled[guide] = fut
        others = [g for g in self._compiled if g not in self.pinned and g not in awaited]
        others = [g for g in others if g != guide]
        total = sum(self._size(g) for g in others)
        for g in others:  # oldest first
            if total <= MAX_COMPILED_BYTES:
                break
            total -= self._size(g)
            self._drop(g)
        return fut

    def _size(self, guide: tuple[str, str]) -> int:
        """The cached compile's bytes, measured once it is done."""
        n = self._sizes.get(guide)
        if n is None:
            fut = self._compiled[guide]
            n = compiled_bytes(fut)
            if fut.done():
                self._sizes[guide] = n
        return n

    def _drop(self, guide: tuple[str, str]) -> None:
        self._compiled.pop(guide, None)
        self._sizes.pop(guide, None)

    def _build(self, guide: tuple[str, str]):
        return self._compiler_ready().compile_grammar(_grammar(*guide))

    def compiled(self, reqs: Iterable[Any]) -> list[tuple[str, int]]:
        """(rid, the compiled guide's bytes), in `reqs` order, of the `guide_pending` requests
        whose guide's compile has ended (a failed one raises at the request's first sample; its
        bytes are 0). Each request checks the compile it holds: more distinct guides pending than
        the cache keeps must not evict one another's compiles for ever. One that holds none (not
        prepared here) starts it now."""
        done = []
        for req in reqs:
            if req.guide_pending:
                if req.guide_compile is None:
                    req.guide_compile = self.prepare(req.params.guide)
                if req.guide_compile.done():
                    done.append((req.rid, compiled_bytes(req.guide_compile)))
                    # the cache's entry is this done compile, for the guide every rank will know
                    self._keep(req.params.guide, req.guide_compile)
        return done

    def _compile(self, req: Any):
        """The request's compiled guide, at its first sample. In a loop the compile is done by now
        (`guide_pending` held the request until `compiled` said so); the offline engine holds
        nothing and waits here."""
        fut = req.guide_compile or self.prepare(req.params.guide)
        req.guide_compile = None  # the matcher holds what it needs from here
        return fut.result()

    def close(self) -> None:
        """Stops the compile thread: a compile under way ends first (xgrammar cannot be
        interrupted), queued ones are dropped."""
        self._pool.shutdown(wait=True, cancel_futures=True)

    def mask(self, logits, reqs: list) -> None:
        """Forbids, row by row, the tokens each guided request's grammar does not allow next."""
        import xgrammar as xgr

        rows = [i for i, r in enumerate(reqs) if r.params.guide is not None]
        if not rows:
            return
        bitmask = xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        masked = [i for i in rows if self._fill(reqs[i], bitmask, i)]
        if masked:
            xgr.apply_token_bitmask_inplace(logits, bitmask[: logits.shape[0]], indices=masked)

    def _fill(self, req, bitmask, row: int) -> bool:
        """Feeds the request's new tokens and fills its row; False when its grammar is done (it
        accepted a stop token and `ignore_eos` goes on) or gave up: the row stays unconstrained.
        A request's grammar never stops the rank."""
        import xgrammar as xgr

        state = req.guide_state
        if state is None:
            state = req.guide_state = GuideState(xgr.GrammarMatcher(self._compile(req)))
        if state.matcher is None:
            return False
        try:
            for tok in req.output_ids[state.fed :]:  # what was harvested since the last step
                if state.matcher.is_terminated() or not state.matcher.accept_token(tok):
                    break
            state.fed = len(req.output_ids)
            if state.matcher.is_terminated():
                state.matcher = None
                return False
            state.matcher.fill_next_token_bitmask(bitmask, row)
            return True
        except RuntimeError as e:  # xgrammar's checks; the same tokens fail the same way anywhere
            log.warning("%s: grammar stopped constraining the output: %s", req.rid, e)
            state.matcher = None
            return False


def hold_for_guide(req: Any, sched: Any, grammar: GrammarSampler | None) -> None:
    """On every rank, as a request is applied: a guided request samples nothing until the
    sampling rank reports its guide compiled (`guide_pending`, `sched.hold`: engine/
    guide_hold.py); that rank (the one with a `grammar`) starts the compile now, off its loop's
    thread, and keeps the guides every rank knows compiled or held requests wait for."""
    sched.hold(req)
    if grammar is not None and req.params.guide is not None and not req.finished:
        grammar.pinned, grammar.awaited = sched.guides_known, sched.guides_awaited
        req.guide_compile = grammar.prepare(req.params.guide)


def compiled_guides(reqs: dict[str, Any], grammar: GrammarSampler | None) -> list[tuple[str, int]]:
    """The sampling rank's notice: the `guide_pending` requests of `reqs` whose compile ended,
    with each compiled guide's bytes (engine/guide_hold.py bounds the known guides' by them). A
    rank without a grammar sampler holds none back (their first sample fails, as it did)."""
    pending = [r for r in reqs.values() if r.guide_pending]
    return [(r.rid, 0) for r in pending] if grammar is None else grammar.compiled(pending)


def compiled_bytes(fut: Future) -> int:
    """What a compile holds (xgrammar's `memory_size_bytes`); 0 under way or failed."""
    if not fut.done() or fut.exception() is not None:
        return 0
    return int(fut.result().memory_size_bytes)
