"""A Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2, Qwen3, and Gemma 3's variations on it)
that runs one PP layer slice over the paged KV pool.

RMSNorm, RoPE (default / linear / llama3 / GGUF freq factors), GQA, SwiGLU, optional q/k/v bias,
tied or untied embeddings. Slice [layer_start, layer_end): the embedding lives only on the first
slice, the final norm and LM head only on the last. Q/K/V and gate/up are fused into one weight each
at load time, so every layer runs four big matmuls over all T tokens of the batch.

Weights are loaded by name (Hugging Face names, global layer indices) through `load_weights`; the
loaders in `engine/model/loader.py` and `engine/model/gguf_file.py` turn safetensors or GGUF tensors
into those names.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kernels import (
    bf16_linear,
    decode_stack,
    layer_ops,
    packed_linear,
    paged_attention,
)
from pdserve.engine.kv_cache import KVPool
from pdserve.engine.model.attention_masks import group_masks
from pdserve.engine.model.config import ModelConfig, slice_weight_names
from pdserve.engine.model.decoder_layer import (
    IN_PLACE,
    DecoderLayer,
    empty_parameter,
    norm_dtype,
    norm_weight,
)
from pdserve.engine.model.linear import (
    SmallWeights,
    batch_invariant_why_not,
    linear,
    packed_rows,
    small_batch_weights,
)
from pdserve.engine.model.rope import RopeTable
from pdserve.engine.model.tensor_parallel import TPShard, shard_config

log = logging.getLogger(__name__)


class ModelSlice(torch.nn.Module):
    """Layers [layer_start, layer_end) of the decoder;
    pool local layer i = global layer layer_start + i."""

    def __init__(
        self,
        cfg: ModelConfig,
        layer_start: int,
        layer_end: int,
        dtype=torch.float32,
        shard: TPShard | None = None,
    ):
        """`shard`: a TP rank's place in its stage's group; its layers hold its share of the heads
        and the MLP (`layer_cfg`), the rest is whole (engine/model/tensor_parallel.py)."""
        super().__init__()
        if not 0 <= layer_start < layer_end <= cfg.num_layers:
            raise ValueError(
                f"bad layer slice [{layer_start}, {layer_end}) of {cfg.num_layers} layers"
            )
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(
                f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}"
            )
        self.cfg, self.dtype = cfg, dtype
        self.shard = shard or TPShard()
        self.layer_cfg = shard_config(cfg, self.shard.size)  # raises where tp does not divide
        self.layer_start, self.layer_end = layer_start, layer_end
        self.is_first, self.is_last = layer_start == 0, layer_end == cfg.num_layers
        self.embed_weight = (
            empty_parameter(cfg.vocab_size, cfg.hidden_size, dtype=dtype) if self.is_first else None
        )
        self.layers = torch.nn.ModuleList(
            DecoderLayer(self.layer_cfg, dtype, self.shard) for _ in range(layer_start, layer_end)
        )
        self.norm_weight = (
            empty_parameter(cfg.hidden_size, dtype=norm_dtype(cfg, dtype)) if self.is_last else None
        )
        self.lm_head_weight = None
        if self.is_last:  # tied and the whole model in one slice: one matrix, not two copies
            share = self.is_first and cfg.tie_word_embeddings
            self.lm_head_weight = (
                self.embed_weight
                if share
                else empty_parameter(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
            )
        max_pos = min(cfg.max_position_embeddings, 32768)
        self.rope = RopeTable(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_pos, dtype)
        # the sliding layers' own RoPE base (Gemma 3), where this slice has such layers
        sliding = [i for i in range(layer_start, layer_end) if cfg.is_sliding(i)]
        self.window = cfg.sliding_window if sliding else 0
        self.rope_local = (
            RopeTable(cfg.head_dim, cfg.rope_local_theta, None, max_pos, dtype)
            if sliding and cfg.rope_local_theta
            else self.rope
        )
        self._ws = torch.empty(0)
        self._in_place: bool | None = None
        self._extend_in_place: bool | None = None
        self._small_head: SmallWeights | None = None
        self._stack: decode_stack.StackWeights | None = None  # all-decode batches in one call
        # every token of a forward attends as a decode query and every matmul takes the blocked
        # kernel (`add_small_batch_weights(batch_invariant=True)`)
        self.batch_invariant = False
        self.logits = True  # a TP follower's last slice computes none: its lead samples

    def _decoder_layers(self) -> Sequence[DecoderLayer]:
        """`self.layers`, typed: a ModuleList's entries are typed Module, and every one of these is
        a DecoderLayer (made in `__init__`)."""
        return cast("Sequence[DecoderLayer]", self.layers)

    def add_small_batch_weights(
        self, fp32: Callable[[], ModelSlice] | None = None, batch_invariant: bool = False
    ) -> str:
        """Small-batch copies of every matmul weight, LM head included (engine/model/linear.py):
        packed block codes where a weight is a grid, and oneDNN-reordered copies (about doubling the
        slice's weight memory). A bf16 slice finds its codes in the fp32 weights it was rounded
        from: `fp32` loads this slice in fp32 (once, dropped after). Returns what it made, for the
        rank's ready line.

        `batch_invariant`: a token's logits and KV do not depend on the batch it is computed in
        (a prefill chunk or a decode step, beside any other requests), so a stream resumed on
        another node, or the same request run again, gets the same bits: the blocked bf16 copy
        for every matmul at every row count, and every token attends through the decode kernel
        over its own keys (engine/forward_batch.py, `one_token_group`). Raises ValueError where
        this slice cannot (docs/ARCHITECTURE.md, "Batch-invariant serving")."""
        if batch_invariant:
            why = batch_invariant_why_not(self.dtype) or (
                "" if paged_attention.load() else f"decode attention: {paged_attention.why_not()}"
            )
            if why:
                raise ValueError(f"batch-invariant serving is not possible here: {why}")
        src = None
        if (
            fp32 is not None
            and not batch_invariant
            and self.dtype == torch.bfloat16
            and packed_linear.bf16_available()
        ):
            src = fp32()
        for i, layer in enumerate(self._decoder_layers()):
            layer.add_small_batch_weights(
                src._decoder_layers()[i] if src is not None else None, batch_invariant
            )
        if self.is_last:
            assert self.lm_head_weight is not None  # made in __init__ on the last slice
            head = src.lm_head_weight if src is not None else None
            self._small_head = small_batch_weights(self.lm_head_weight, head, batch_invariant)
        del src
        if batch_invariant and self.blocked_matmuls() != len(self._small_copies()):
            odd = len(self._small_copies()) - self.blocked_matmuls()
            raise ValueError(
                f"batch-invariant serving: {odd} matmuls have shapes the kernel refuses"
            )
        self.batch_invariant = batch_invariant
        stack_off = decode_stack.why_not(self)  # why all-decode steps do not run in one call, or ""
        self._stack = None if stack_off else decode_stack.stack_weights(self)
        return self._describe_weights(stack_off)

    def _describe_weights(self, stack_off: str) -> str:
        """What `add_small_batch_weights` made, for the rank's ready line."""
        copies = self._small_copies()
        packed = [v.packed for v in copies if v.packed is not None]
        blocked = self.blocked_matmuls()
        rest = (
            f"blocked bf16 weights with prefetch ({blocked} of {len(copies)})"
            if blocked
            else "oneDNN-reordered weights"
        )
        if self.dtype == torch.bfloat16:
            rest += (
                f"; decode steps per op ({stack_off})"
                if stack_off
                else "; decode steps in one call"
            )
        if self.batch_invariant:
            rest += "; batch-invariant (every token attends as a decode query)"
        if not packed:
            why = packed_linear.why_not() or "no weight is an exact 4- or 8-bit block grid"
            if not blocked and self.dtype == torch.bfloat16:
                why += f"; no blocked bf16 weights: {bf16_linear.why_not() or 'odd shapes'}"
            return f"matmuls on {rest} (no packed codes: {why})"
        mb = sum(p.nbytes for p in packed) / 1e6
        return (
            f"decode matmuls on packed block codes: {len(packed)} of {len(copies)} ({mb:.0f} MB), "
            f"on {rest} above {packed_rows(self.dtype)} rows"
        )

    def _small_copies(self) -> list:
        copies = [
            v for layer in self._decoder_layers() for v in layer.small.values() if v is not None
        ]
        return copies + ([self._small_head] if self.is_last and self._small_head else [])

    def blocked_matmuls(self) -> int:
        """How many of the slice's matmuls have a blocked bf16 copy
        (engine/kernels/bf16_linear.py)."""
        return sum(v.blocked is not None for v in self._small_copies())

    def weight_names(self) -> list[str]:
        """Hugging Face names of the tensors this slice needs (and nothing of the other layers)."""
        return slice_weight_names(self.cfg, self.layer_start, self.layer_end)

    def load_weights(self, w: Mapping[str, torch.Tensor]) -> None:
        """Fills the slice from HF-named tensors (as listed by `weight_names`)."""
        with torch.no_grad():
            if self.is_first:
                assert self.embed_weight is not None  # made in __init__ on the first slice
                self.embed_weight.copy_(w["model.embed_tokens.weight"])
            for i, layer in enumerate(self._decoder_layers()):
                layer.load(w, f"model.layers.{self.layer_start + i}.")
            if self.is_last:
                # both made in __init__ on the last slice
                assert self.norm_weight is not None and self.lm_head_weight is not None
                self.norm_weight.copy_(norm_weight(w, "model.norm.weight", self.cfg))
                if self.lm_head_weight is not self.embed_weight:
                    head = (
                        "model.embed_tokens.weight"
                        if self.cfg.tie_word_embeddings
                        else "lm_head.weight"
                    )
                    self.lm_head_weight.copy_(w[head])

    def choose_decode_attention(self, pool: KVPool) -> bool:
        """Whether decode groups attend with the in-place kernel: on the CPU, where it loads
        (engine/kernels/paged_attention.py); decided once per slice, and said once."""
        if self._in_place is None:
            # the kernel takes fp32 and bf16; fp16 (`--dtype float16`) keeps the gather path
            cpu = pool.kv.device.type == "cpu" and self.dtype in (torch.float32, torch.bfloat16)
            self._in_place = cpu and paged_attention.load()
            if cpu and not self._in_place:
                log.warning(
                    "decode attention gathers KV pages (the in-place kernel is off: %s)",
                    paged_attention.why_not(),
                )
        return self._in_place

    def choose_extend_attention(self, pool: KVPool) -> bool:
        """Whether extend items (prefill chunks) attend with the in-place extend kernel: a bf16
        slice and pool on a CPU where it has a kernel for these shapes
        (engine/kernels/paged_attention.py); decided once per slice, and said once."""
        if self._extend_in_place is None:
            cfg, lay = self.cfg, pool.layout
            why = "not a bf16 slice and pool on the CPU"
            if pool.kv.device.type == "cpu" and self.dtype == pool.kv.dtype == torch.bfloat16:
                group = cfg.num_heads // cfg.num_kv_heads
                why = paged_attention.extend_why_not(group, cfg.head_dim, lay.page_size)
                if why:
                    log.info("prefill attention gathers KV pages (in place: %s)", why)
            self._extend_in_place = not why
        return self._extend_in_place

    def _workspace(self, pages: int, pool: KVPool) -> torch.Tensor:
        """Grow-only gather buffer [2, pages, page_size, kv_heads, head_dim], reused across layers
        and forwards: a fresh 10+ MB tensor per layer would cost page faults on every allocation."""
        lay = pool.layout
        shape = (2, pages, lay.page_size, lay.num_kv_heads, lay.head_dim)
        numel = 2 * pages * lay.page_size * lay.num_kv_heads * lay.head_dim
        if self._ws.numel() < numel or self._ws.dtype != pool.kv.dtype:
            self._ws = torch.empty(max(numel, 2 * self._ws.numel()), dtype=pool.kv.dtype)
        return self._ws[:numel].view(shape)

    def _one_call(self, h: torch.Tensor, fb: ForwardBatch, masks: list, pool: KVPool) -> bool:
        """Whether this forward runs its layers in one call (engine/kernels/decode_stack.py): an
        all-decode batch on the in-place attention kernel, over a bf16 pool, in the layouts the
        kernel takes (where it would refuse them, the loop's torch fallbacks serve)."""
        return (
            self._stack is not None
            and len(fb.groups) == 1
            and masks[0] is IN_PLACE
            and fb.groups[0].rows_are_t
            and pool.kv.dtype == torch.bfloat16
            and pool.sliding_kv is None  # one pool
            and h.is_contiguous()
            and fb.out_pages.is_contiguous()
            and fb.out_offs.is_contiguous()
        )

    def _embed(self, x: torch.Tensor) -> torch.Tensor:
        """The forward's hidden states: x's embeddings on the first slice, else a copy of x in
        the slice's dtype (the layers update it in place)."""
        if self.is_first:
            assert self.embed_weight is not None  # made in __init__ on the first slice
            h = F.embedding(x, self.embed_weight)
            if self.cfg.embed_scale != 1.0:  # Gemma: the scale rounded to the weights' dtype
                h.mul_(torch.tensor(self.cfg.embed_scale).to(self.dtype))
        else:
            h = x.to(self.dtype, copy=True)
        return h

    def _run_layers(
        self,
        h: torch.Tensor,
        fb: ForwardBatch,
        pool: KVPool,
        rope: tuple[torch.Tensor, torch.Tensor],
        local_rope: tuple[torch.Tensor, torch.Tensor],
        masks: list,
        window_masks: list,
        ws: torch.Tensor,
    ) -> None:
        """Runs the slice's layers over h in place: in one call where `_one_call` allows, else
        layer by layer (the sliding layers with their own RoPE and masks)."""
        if self._one_call(h, fb, masks, pool):
            g = fb.groups[0]
            assert self._stack is not None  # `_one_call` checked it
            decode_stack.run_(
                h,
                self._stack,
                rope,
                pool.kv,
                fb.out_pages,
                fb.out_offs,
                g.kv_pages.view(g.num_seqs, g.pages),
                g.seq_lens,
                self.layer_cfg.num_heads,
                self.layer_cfg.num_kv_heads,
                self.cfg.rms_norm_eps,
            )
        else:
            for i, layer in enumerate(self.layers):
                if self.cfg.is_sliding(self.layer_start + i):
                    layer(h, i, fb, pool, local_rope, window_masks, ws, self.window)
                else:
                    layer(h, i, fb, pool, rope, masks, ws)

    @torch.inference_mode()
    def forward(self, x: torch.Tensor, fb: ForwardBatch, pool: KVPool) -> torch.Tensor:
        """x: LongTensor [T] token ids on the first slice, else hidden [T, hidden_size] from the
        previous slice. Writes this slice's K/V for the T new tokens into `pool` at fb.out_slots and
        attends over each request's cached + new KV. Returns hidden [T, hidden] (not last), or on
        the last slice logits in the model's dtype [len(fb.logit_rows), vocab] for the rows of T
        listed in fb.logit_rows."""
        lay = pool.layout
        if (lay.layer_start, lay.layer_end) != (self.layer_start, self.layer_end):
            raise ValueError(
                f"KV pool holds layers [{lay.layer_start}, {lay.layer_end}), "
                f"slice is [{self.layer_start}, {self.layer_end})"
            )
        if self.window and fb.window != self.window:
            raise ValueError(
                f"the batch's window is {fb.window}, the slice's sliding layers' {self.window}"
            )
        h = self._embed(x)
        rope = self.rope.lookup(fb.positions, fb.max_position)
        in_place = self.choose_decode_attention(pool)
        masks, window_masks = group_masks(fb, in_place, self.window, self.dtype)
        local_rope = (
            rope
            if self.rope_local is self.rope
            else self.rope_local.lookup(fb.positions, fb.max_position)
        )
        # sized for the groups that gather (no mask or a mask tensor), not those a kernel serves
        groups = zip(fb.groups, masks, strict=True)
        gathered = [g.num_seqs * g.pages for g, m in groups if m is None or torch.is_tensor(m)]
        ws = self._workspace(max(gathered, default=0), pool)
        self._run_layers(h, fb, pool, rope, local_rope, masks, window_masks, ws)
        if not self.is_last or not self.logits:
            return h
        # both made in __init__ on the last slice
        assert self.norm_weight is not None and self.lm_head_weight is not None
        h = h.index_select(0, fb.logit_rows)
        h = layer_ops.rms_norm(h, self.norm_weight, self.cfg.rms_norm_eps)
        # In the served dtype: the sampler reads bf16 rows as they are (widening them here copied
        # every row's logits each decode step, a measurable share of it: bench/results/HISTORY.md,
        # "Logits stay in bf16") and widens only what it adjusts.
        return linear(h, self.lm_head_weight, self._small_head)
