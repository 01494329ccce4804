"""The front's bound on structured-output grammars: a guide must compile within a time limit, or
the request gets a clear error before it reaches a rank (engine/grammar.py).

A guide's spec is bounded in size already (engine/grammar.py MAX_SPEC); what it costs to compile
against the vocabulary is not, and a sampling rank pays it for every distinct guide. So the front
compiles each guide it has not seen on its own compiler, one at a time on a thread of its own,
and remembers the outcome by the guide's SHA-256:
- compiled within `timeout_s` of its thread's CPU time: admitted, and the same guide is admitted
  at once from then on;
- its own compile used more than `timeout_s` of CPU: 400 naming `guide`, now and whenever it
  comes again;
- still queued behind other guides' compiles when `timeout_s` ran out, or compiling but not done
  within `timeout_s` of wall time while its CPU time is under the bound (the thread is niced and
  the node busy): 503 with Retry-After, and the compile goes on, so a retry finds its outcome (a
  flood of distinct guides waits here, in the front's one compile thread, not in a rank's step).
The bound is CPU time, not wall time: a guide refused once is refused for good, and a busy
machine must not make a simple guide one of those. The compile runs on the calling thread (one
xgrammar thread), so that thread's CPU clock counts all of it.
The front's compile is a check only; the sampling rank compiles the guide again on its own thread
(a large schema's compiled grammar serialises to far more bytes, and takes longer to read back,
than compiling it again).
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pdserve.engine.grammar import lower_this_threads_priority
from pdserve.runtime.front.prompt import RequestError

KEPT = 4096  # outcomes remembered (a hash and a short string each)
MAX_QUEUED = 32  # guides waiting for the compile thread; past it a new one is refused at once
# the code of a node's retryable 503 (runtime/front/process.py OVERLOADED): the router tries
# another node and counts no fault against this one (router/routing/attempt.py)
BUSY = "node_overloaded"


def _cpu_since(thread: int, cpu0: float) -> float:
    """CPU seconds thread `thread` (an ident) used since its CPU clock read `cpu0`; 0 where the
    thread is gone (the gate closed): the request is then told to retry, not refused for good."""
    try:
        return time.clock_gettime(time.pthread_getcpuclockid(thread)) - cpu0
    except OSError:
        return 0.0


class GuideGate:
    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_ids: tuple[int, ...] | None, timeout_s: float
    ):
        """`stop_ids` None: the tokenizer's EOS, read at the first compile (a front's tokenizer
        may still be loading when the gate is made)."""
        self.tokenizer, self.vocab_size, self.stop_ids = tokenizer, vocab_size, stop_ids
        self.timeout_s = timeout_s
        self.outcomes: OrderedDict[bytes, str] = OrderedDict()  # digest -> "" ok, else why not
        self._pool = ThreadPoolExecutor(
            1, thread_name_prefix="guide-gate", initializer=lower_this_threads_priority
        )
        self._compiler: Any = None
        # digest -> (the pool thread, its CPU clock when the compile began)
        self._started: dict[bytes, tuple[int, float]] = {}
        self._lock = threading.Lock()  # outcomes and counts: the loop's thread and the pool's
        self.queued = 0  # guides submitted and not yet started
        self.compiles = 0  # guides compiled here (tests)

    async def check(self, guide: Any) -> None:
        """Returns once `guide` is known to compile in time; RequestError otherwise. A guide that
        is not a well-formed [kind, spec] is left to the request's own validation."""
        if not (isinstance(guide, list | tuple) and len(guide) == 2 and all(
                isinstance(g, str) for g in guide)):  # fmt: skip
            return
        key = hashlib.sha256(f"{guide[0]}\0{guide[1]}".encode()).digest()
        with self._lock:
            why = self.outcomes.get(key)
        if why is None:
            why = await self._compile(key, (guide[0], guide[1]))
        if why:
            raise RequestError(400, f"guide: {why}", "guide")

    async def _compile(self, key: bytes, guide: tuple[str, str]) -> str:
        with self._lock:
            if self.queued >= MAX_QUEUED:
                raise self._busy("has too many guides queued")
            self.queued += 1
        job = asyncio.get_running_loop().run_in_executor(self._pool, self._run, key, guide)
        try:
            return await asyncio.wait_for(asyncio.shield(job), self.timeout_s)
        except TimeoutError:
            began = self._started.get(key)
            if began is None:
                raise self._busy(f"did not start this guide within {self.timeout_s:g} s") from None
            used = _cpu_since(*began)
            if used >= self.timeout_s * 0.999:
                return self._remember(key, self._too_slow())
            raise self._busy(
                f"has not finished this guide within {self.timeout_s:g} s (it used {used:.1f} s "
                "of CPU: the node is busy)"
            ) from None

    def _busy(self, what: str) -> RequestError:
        return RequestError(503, f"the node's grammar compiler {what}: retry later", "guide", BUSY)

    def _run(self, key: bytes, guide: tuple[str, str]) -> str:
        """On the pool's thread: the guide's outcome, remembered."""
        with self._lock:
            self.queued -= 1
            known = self.outcomes.get(key)
        if known is not None:  # a duplicate queued behind the first
            return known
        from pdserve.engine.grammar import GrammarError, _grammar, check_guide

        try:
            check_guide(guide)
            compiler = self._compiler_ready()
            c0 = time.thread_time()  # the compile's own CPU (the compiler's set-up is not its)
            self._started[key] = (threading.get_ident(), c0)
            compiler.compile_grammar(_grammar(*guide))
            why = "" if time.thread_time() - c0 < self.timeout_s else self._too_slow()
        except GrammarError as e:
            why = str(e)
        except Exception as e:  # xgrammar's own errors: the guide cannot be compiled
            why = f"{guide[0]} does not compile: {str(e).splitlines()[0][:200]}"
        finally:
            self._started.pop(key, None)
        with self._lock:
            self.compiles += 1
        return self._remember(key, why)

    def _too_slow(self) -> str:
        return (
            f"did not compile within {self.timeout_s:g} s (--grammar-compile-timeout): simplify it"
        )

    def _remember(self, key: bytes, why: str) -> str:
        with self._lock:
            self.outcomes[key] = why
            while len(self.outcomes) > KEPT:
                self.outcomes.popitem(last=False)
        return why

    def _compiler_ready(self):
        if self._compiler is None:
            import xgrammar as xgr

            # a front's tokenizer may be TokenizerLoading's stand-in: xgrammar needs the real one
            ready = getattr(type(self.tokenizer), "ready", None)
            tok = self.tokenizer.ready() if ready is not None else self.tokenizer
            stop = self.stop_ids
            if stop is None:
                eos = getattr(tok, "eos_token_id", None)
                stop = () if eos is None else (eos,)
            info = xgr.TokenizerInfo.from_huggingface(
                tok, vocab_size=self.vocab_size, stop_token_ids=list(stop)
            )
            # one thread: the front's compiles are checks and must leave the ranks their cores
            self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
