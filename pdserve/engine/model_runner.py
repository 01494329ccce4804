"""Runs one scheduled batch through this rank's model slice over its KV pool.

Shared by the offline engine (one slice = the whole model) and by every PP rank. The first slice
embeds token ids; the others take the previous slice's hidden states. Only the last slice returns
logits, and only it samples.
"""

from __future__ import annotations

import torch

from pdserve.engine.batch import SampleOut, ScheduledBatch
from pdserve.engine.core import SamplingParams
from pdserve.engine.forward_batch import BatchItem, ForwardBatch, build_forward_batch
from pdserve.engine.grammar import GrammarSampler
from pdserve.engine.kv_cache import KVLayout, KVPool
from pdserve.engine.model.llama import ModelSlice
from pdserve.engine.sampling import sample


class ModelRunner:
    def __init__(
        self,
        model: ModelSlice,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        seed: int = 0,
        sliding_pages: int = 0,
    ):
        """`sliding_pages` > 0: a windowed pool, the slice's sliding layers in that many pages of
        their own (engine/kv_cache.py)."""
        cfg = model.layer_cfg  # a TP rank's pool holds its own KV heads only
        self.model = model
        start = model.layer_start
        sliding = tuple(i - start for i in range(start, model.layer_end) if model.cfg.is_sliding(i))
        self.pool = KVPool(
            KVLayout(
                num_pages=num_pages,
                page_size=page_size,
                layer_start=model.layer_start,
                layer_end=model.layer_end,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                dtype=dtype,
            ),
            sliding=sliding,
            sliding_pages=sliding_pages,
        )
        # Decided (and the in-place kernel loaded, or built) now, not inside the first request.
        model.choose_decode_attention(self.pool)
        model.choose_extend_attention(self.pool)
        self.generator = torch.Generator().manual_seed(seed)
        self.grammar: GrammarSampler | None = None  # set on the sampling rank (structured output)

    @property
    def is_first(self) -> bool:
        return self.model.is_first

    @property
    def is_last(self) -> bool:
        return self.model.is_last

    def input_ids(self, batch: ScheduledBatch) -> torch.Tensor:
        ids: list[int] = []
        for e in batch.entries:
            ids.extend(e.req.all_ids[e.start : e.start + e.num_new])
        return torch.tensor(ids, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, batch: ScheduledBatch, hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] (not last slice) or logits [sampling entries, vocab] (last)."""
        items = [BatchItem(e.pages, e.start, e.num_new, e.need_logits) for e in batch.entries]
        fb = self._forward_batch(items)
        if self.pool.sliding_kv is not None:  # the sliding layers' own pages
            sliding = [
                BatchItem(e.sliding_pages or [], e.start, e.num_new, e.need_logits)
                for e in batch.entries
            ]
            fb.sliding = self._forward_batch(sliding, masks=False)  # it attends with fb's
        x = self.input_ids(batch) if self.is_first else hidden_in
        assert x is not None and x.shape[0] == batch.num_tokens, (
            "hidden states do not match the batch"
        )
        return self.model(x, fb, self.pool)

    def _forward_batch(self, items: list[BatchItem], masks: bool = True) -> ForwardBatch:
        invariant = self.model.batch_invariant
        return build_forward_batch(
            items,
            self.pool.page_size,
            one_decode_group=self.model.choose_decode_attention(self.pool),
            one_extend_group=not invariant and self.model.choose_extend_attention(self.pool),
            one_token_group=invariant,
            window=self.model.window,
            masks=masks,
        )

    def sample(self, batch: ScheduledBatch, logits: torch.Tensor) -> SampleOut:
        entries = batch.sampling_entries
        params: list[SamplingParams] = [e.req.params for e in entries]
        steps = [len(e.req.output_ids) for e in entries]
        histories = [(e.req.input_ids, e.req.output_ids) for e in entries]
        mask = None
        if any(p.guide is not None for p in params):
            if self.grammar is None:
                raise RuntimeError("a guided request on a runner without a grammar sampler")
            reqs = [e.req for e in entries]
            mask = lambda x: self.grammar.mask(x, reqs)  # noqa: E731
        return sample(logits, params, steps, self.generator, histories, mask)
