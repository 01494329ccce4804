"""The offline engine: one process, the whole model, the same scheduler every PP rank runs.

eng = Engine(EngineConfig(model=path))
outs = eng.generate(["Hello", [1, 2, 3]], SamplingParams(max_tokens=16))
for ev in eng.stream("Hello", SamplingParams(max_tokens=16)): print(ev.new_token_ids)
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from pdserve.engine.config import EngineConfig, apply_threads
from pdserve.engine.core import FinishReason, ParamError, Req, SamplingParams
from pdserve.engine.grammar import GrammarSampler
from pdserve.engine.kernels import spare_core, switches
from pdserve.engine.model.loader import load_model_config, load_slice, resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer
from pdserve.engine.model_runner import ModelRunner
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.window_pages import windowed_pool_pages

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """One step's news about one request (streaming interface)."""

    rid: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    new_logprobs: list[float] = field(default_factory=list)


@dataclass
class Completion:
    rid: str
    prompt_tokens: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig()):
        # the kernel switches are the process's (engine/kernels/switches.py): set before the model
        # loads, where most of what they decide is decided
        switches.use(config.kernels)
        self.threads = apply_threads(config.threads)
        path = resolve_model(config.model)
        self.model_config = load_model_config(path)
        self.config = config = config.for_model(self.model_config.dtype)
        self.tokenizer = load_tokenizer(path)
        model = load_slice(path, 0, self.model_config.num_layers, config.torch_dtype)
        matmuls = "plain weights only"
        if config.small_batch_weights:
            matmuls = model.add_small_batch_weights(
                lambda: load_slice(path, 0, self.model_config.num_layers),  # fp32
                batch_invariant=config.batch_invariant,
            )
        helper = spare_core.start(
            config.spare_cores, self.threads, config.torch_dtype, blocked=model.blocked_matmuls()
        )
        matmuls += f", {helper}" if helper else ""
        max_ctx = min(config.max_context, self.model_config.max_position_embeddings)
        window = self.model_config.sliding_window
        pages, sliding_pages = windowed_pool_pages(config, self.model_config, max_ctx)
        self.runner = ModelRunner(
            model,
            pages,
            config.page_size,
            config.torch_dtype,
            config.seed,
            sliding_pages=sliding_pages,
        )
        self.runner.grammar = GrammarSampler(
            lambda: self.tokenizer, self.model_config.vocab_size, self.model_config.eos_token_ids
        )
        self.scheduler = Scheduler(
            replace(config.scheduler_config(), max_context=max_ctx, window=window),
            self.runner.pool.allocator,
            self.model_config.eos_token_ids,
            detokenize=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            sliding_allocator=self.runner.pool.sliding_allocator,
        )
        self._ids = itertools.count()
        self._done: dict[str, Req] = {}  # finished requests not yet returned by generate/stream
        log.info(
            "engine ready: model=%s layers=%d dtype=%s kv=%d tokens threads=%d, %s",
            path.name,
            self.model_config.num_layers,
            config.dtype,
            config.max_total_tokens,
            self.threads,
            matmuls,
        )

    # --- requests ---------------------------------------------------------------------------------
    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        ids = list(prompt)
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise ParamError("input_ids", f"must be integers in [0, {vocab})")
        return ids

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        rid: str | None = None,
        resume: Sequence[int] = (),
    ) -> str:
        """`resume`: tokens generated before (elsewhere) that the request continues from; they
        are its first output tokens (router/routing/migration.py)."""
        params = (params or SamplingParams()).validate()
        rid = rid if rid is not None else f"req-{next(self._ids)}"
        output = list(resume)
        if len(output) > params.max_tokens:
            raise ParamError("resume", "has more tokens than max_tokens")
        self.scheduler.add(Req(rid, self.encode(prompt), params, output_ids=output))
        return rid

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid) is not None

    # --- the loop ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedules one batch, runs it, applies the sampled tokens; returns what changed."""
        sched = self.scheduler
        batch = sched.schedule(0)
        events: dict[str, RequestOutput] = {}
        if batch.entries:
            logits = self.runner.forward(batch)
            out = self.runner.sample(batch, logits) if batch.sampling_entries else None
            for req in sched.harvest(batch, out):
                events[req.rid] = RequestOutput(
                    req.rid, [req.output_ids[-1]], new_logprobs=req.output_logprobs[-1:]
                )
        for req in sched.drain_finished():
            ev = events.setdefault(req.rid, RequestOutput(req.rid, []))
            ev.finished, ev.finish_reason = True, req.finish
            self._done[req.rid] = req
        return list(events.values())

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Runs all prompts as one continuous batch; returns completions in prompt order."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise ParamError("params", f"{len(params)} sampling params for {len(prompts)} prompts")
        self._done = {}
        rids = [self.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        while self.scheduler.has_work:
            self.step()
        return [self._completion(self._done.pop(rid)) for rid in rids]

    def stream(
        self, prompt: str | Sequence[int], params: SamplingParams | None = None
    ) -> Iterator[RequestOutput]:
        self._done = {}
        rid = self.add_request(prompt, params)
        while True:
            for ev in self.step():
                if ev.rid == rid:
                    yield ev
                    if ev.finished:
                        self._done.pop(rid, None)
                        return

    def _completion(self, req: Req) -> Completion:
        assert req.finish is not None  # `_done` holds finished requests only
        ids = req.output_ids
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if req.finish.kind == "stop" and isinstance(req.finish.matched, str):
            text = text[: text.find(req.finish.matched)] if req.finish.matched in text else text
        return Completion(
            req.rid,
            req.prompt_len,
            list(ids),
            text,
            req.finish,
            list(req.output_logprobs),
            list(req.output_top_logprobs),
        )
