"""One decoder layer of a Llama-family model (engine/model/llama.py): its weights, and its
forward over a batch of the paged KV pool: norm, fused QKV, RoPE and the KV store, attention by
groups (the in-place decode and extend kernels, or gather + SDPA), the output projection and the
SwiGLU MLP. Gemma 3's layers add norms on both outputs (`sandwich_norms`) and a GeGLU MLP; which
RoPE table and masks a layer gets (a sliding window or none) is the slice's choice."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from pdserve.engine.forward_batch import ForwardBatch
from pdserve.engine.kernels import (
    layer_ops,
    paged_attention,
)
from pdserve.engine.kv_cache import KVPool
from pdserve.engine.model.config import ModelConfig
from pdserve.engine.model.linear import (
    SmallWeights,
    add_linear_,
    linear,
    small_batch_weights,
)
from pdserve.engine.model.rope import apply_rope
from pdserve.engine.model.tensor_parallel import TPShard, cols, rows

log = logging.getLogger(__name__)

# A decode group's entry in the per-group masks: attend with the in-place kernel, no gather.
IN_PLACE = object()
# The extend group's (`one_extend_group`): the in-place extend kernel, no gather and no mask.
EXTEND_IN_PLACE = object()


def empty_parameter(*shape: int, dtype: torch.dtype) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


def norm_weight(w: Mapping[str, torch.Tensor], name: str, cfg: ModelConfig) -> torch.Tensor:
    """An RMSNorm's weight as the norm multiplies by it: Gemma stores it as an offset from 1,
    added here in fp32 as transformers adds it."""
    t = w[name]
    return t.float() + cfg.norm_weight_offset if cfg.norm_weight_offset else t


def norm_dtype(cfg: ModelConfig, dtype: torch.dtype) -> torch.dtype:
    """The dtype a slice keeps its norm weights in. Gemma's stay in fp32, offset added: its norm
    computes in fp32 and rounds once (layer_ops.rms_norm), as transformers' Gemma3RMSNorm does.
    Rounded to bf16, 1 + w moves by up to half a bf16 step (2^-8 near 1): a change in every norm's
    output that transformers does not make."""
    return torch.float32 if cfg.norm_weight_offset else dtype


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(gate) * up for gate_up = [gate | up] along the last dim (Gemma's GeGLU)."""
    inter = gate_up.shape[-1] // 2
    return F.gelu(gate_up[..., :inter], approximate="tanh").mul_(gate_up[..., inter:])


class DecoderLayer(torch.nn.Module):
    """`cfg`: the layer's own shape, under TP the rank's share of the heads and MLP
    (engine/model/tensor_parallel.py); `shard`: where that share is, and how the group sums."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, shard: TPShard | None = None):
        super().__init__()
        self.shard = shard or TPShard()
        h, inter = cfg.hidden_size, cfg.intermediate_size
        self.cfg = cfg
        nd = norm_dtype(cfg, dtype)
        self.input_norm_weight = empty_parameter(h, dtype=nd)
        self.qkv_weight = empty_parameter(cfg.q_size + 2 * cfg.kv_size, h, dtype=dtype)
        self.qkv_bias = (
            empty_parameter(cfg.q_size + 2 * cfg.kv_size, dtype=dtype)
            if cfg.attention_bias
            else None
        )
        self.o_weight = empty_parameter(h, cfg.q_size, dtype=dtype)
        self.q_norm_weight = empty_parameter(cfg.head_dim, dtype=nd) if cfg.qk_norm else None
        self.k_norm_weight = empty_parameter(cfg.head_dim, dtype=nd) if cfg.qk_norm else None
        self.post_norm_weight = empty_parameter(h, dtype=nd)  # the MLP's input norm
        # Gemma 3: norms on the attention's and the MLP's outputs, before the residual adds them
        self.attn_out_norm_weight = empty_parameter(h, dtype=nd) if cfg.sandwich_norms else None
        self.mlp_out_norm_weight = empty_parameter(h, dtype=nd) if cfg.sandwich_norms else None
        self.gate_up_weight = empty_parameter(2 * inter, h, dtype=dtype)
        self.down_weight = empty_parameter(h, inter, dtype=dtype)
        self.small: dict[str, SmallWeights] = {}  # engine/model/linear.py: small-batch copies

    def add_small_batch_weights(
        self, source: DecoderLayer | None = None, batch_invariant: bool = False
    ) -> None:
        """Small-batch copies of the four matmul weights, for decode batches
        (engine/model/linear.py); `source`: the same layer in fp32, where a bf16 layer's codes are
        found."""
        for name in ("qkv", "o", "gate_up", "down"):
            fp32 = getattr(source, f"{name}_weight") if source is not None else None
            w = getattr(self, f"{name}_weight")
            self.small[name] = small_batch_weights(w, fp32, batch_invariant)

    def load(self, w: Mapping[str, torch.Tensor], prefix: str) -> None:
        """Copies HF-named tensors (`prefix` = "model.layers.{global_index}.") into the fused
        weights, one at a time (no concatenated temporaries); under TP, this rank's share of each
        cut weight."""
        a, m, cfg, shard = prefix + "self_attn.", prefix + "mlp.", self.cfg, self.shard
        parts = [("q", cfg.q_size), ("k", cfg.kv_size), ("v", cfg.kv_size)]
        with torch.no_grad():
            self.input_norm_weight.copy_(norm_weight(w, prefix + "input_layernorm.weight", cfg))
            if cfg.sandwich_norms:  # Gemma's names: post_attention_layernorm is on the output
                assert (
                    self.attn_out_norm_weight is not None and self.mlp_out_norm_weight is not None
                )
                for param, name in (
                    (self.attn_out_norm_weight, "post_attention_layernorm"),
                    (self.post_norm_weight, "pre_feedforward_layernorm"),
                    (self.mlp_out_norm_weight, "post_feedforward_layernorm"),
                ):
                    param.copy_(norm_weight(w, f"{prefix}{name}.weight", cfg))
            else:
                self.post_norm_weight.copy_(
                    norm_weight(w, prefix + "post_attention_layernorm.weight", cfg)
                )
            off = 0
            for p, n in parts:
                self.qkv_weight[off : off + n].copy_(rows(w[a + f"{p}_proj.weight"], shard))
                if self.qkv_bias is not None:
                    self.qkv_bias[off : off + n].copy_(rows(w[a + f"{p}_proj.bias"], shard))
                off += n
            self.o_weight.copy_(cols(w[a + "o_proj.weight"], shard))
            if cfg.qk_norm:
                # both made in __init__ when cfg.qk_norm
                assert self.q_norm_weight is not None and self.k_norm_weight is not None
                self.q_norm_weight.copy_(norm_weight(w, a + "q_norm.weight", cfg))
                self.k_norm_weight.copy_(norm_weight(w, a + "k_norm.weight", cfg))
            inter = cfg.intermediate_size
            self.gate_up_weight[:inter].copy_(rows(w[m + "gate_proj.weight"], shard))
            self.gate_up_weight[inter:].copy_(rows(w[m + "up_proj.weight"], shard))
            self.down_weight.copy_(cols(w[m + "down_proj.weight"], shard))

    def forward(
        self,
        h: torch.Tensor,
        layer: int,
        fb: ForwardBatch,
        pool: KVPool,
        rope: tuple[torch.Tensor, torch.Tensor],
        masks: list,
        ws: torch.Tensor,
        window: int = 0,
    ) -> None:
        """Updates the residual stream `h` [T, hidden] in place; `window` > 0: a sliding-window
        layer (its masks are the window's, and the decode kernel is told)."""
        cfg = self.cfg
        x = layer_ops.rms_norm(h, self.input_norm_weight, cfg.rms_norm_eps)
        small = self.small
        qkv = linear(x, self.qkv_weight, small.get("qkv"), self.qkv_bias)
        attn = self._attention(qkv, layer, fb, pool, rope, masks, ws, window)
        self._add_output(h, attn, self.o_weight, small.get("o"), self.attn_out_norm_weight)
        x = layer_ops.rms_norm(h, self.post_norm_weight, cfg.rms_norm_eps)
        gate_up = linear(x, self.gate_up_weight, small.get("gate_up"))
        act = layer_ops.silu_mul(gate_up) if cfg.mlp_act == "silu" else gelu_tanh_mul(gate_up)
        self._add_output(h, act, self.down_weight, small.get("down"), self.mlp_out_norm_weight)

    def _add_output(self, h, x, weight, small, out_norm: torch.Tensor | None) -> None:
        """h += x @ weight.T, through `out_norm` where the layer has one (Gemma 3). Under TP the
        product is a partial sum, summed over the group first (engine/model/tensor_parallel.py)."""
        reduce = self.shard.reduce
        if out_norm is None and reduce is None:
            add_linear_(h, x, weight, small)
            return
        y = linear(x, weight, small)
        if reduce is not None:
            reduce(y)
        h.add_(y if out_norm is None else layer_ops.rms_norm(y, out_norm, self.cfg.rms_norm_eps))

    def _rope_store_kv(self, qkv, rope, kv, fb: ForwardBatch) -> torch.Tensor:
        """layer_ops.rope_store_kv_ in torch ops (other devices and dtypes; q/k norms first), into
        a new tensor: returns the rotated q [T, heads, head_dim]."""
        cfg = self.cfg
        t, nh, nkv, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qk = qkv[:, : cfg.q_size + cfg.kv_size].view(t, nh + nkv, d)
        if cfg.qk_norm:
            eps = cfg.rms_norm_eps
            assert self.q_norm_weight is not None and self.k_norm_weight is not None
            qk = torch.cat(
                (
                    layer_ops.rms_norm(qk[:, :nh], self.q_norm_weight, eps),
                    layer_ops.rms_norm(qk[:, nh:], self.k_norm_weight, eps),
                ),
                dim=1,
            )
        qk = apply_rope(qk, *rope)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, nkv, d)
        kv[fb.out_pages, 0, fb.out_offs] = qk[:, nh:].to(kv.dtype)
        kv[fb.out_pages, 1, fb.out_offs] = v.to(kv.dtype)
        return qk[:, :nh]

    def _attention(self, qkv, layer, fb, pool, rope, masks, ws, window: int) -> torch.Tensor:
        cfg = self.cfg
        t, nh, nkv, d = qkv.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        kv = pool.layer_kv(layer)  # [pages, 2, page_size, kv_heads, d]
        if pool.is_windowed(layer):  # its own pages, and the batch's table of them
            assert fb.sliding is not None, "a windowed pool's batch without its sliding pages"
            fb = fb.sliding
        if not cfg.qk_norm and layer_ops.rope_store_kv_(
            qkv, rope, kv, fb.out_pages, fb.out_offs, nh, nkv
        ):
            q = qkv[:, : cfg.q_size].view(t, nh, d)
        else:
            q = self._rope_store_kv(qkv, rope, kv, fb)
        out = torch.empty(t, cfg.q_size, dtype=q.dtype)
        for g, mask in zip(fb.groups, masks, strict=True):
            if mask is EXTEND_IN_PLACE:  # writes its items' rows of `out`
                paged_attention.extend_attention_(
                    out.view(t, nh, d),
                    q,
                    kv,
                    g.kv_pages.view(g.num_seqs, g.pages),
                    g.seq_lens,
                    g.num_new,
                    g.first_rows,
                    cfg.attn_scale,
                    window,
                )
                continue
            if mask is IN_PLACE:
                # Decode, in place: the kernel reads each request's pages where they lie.
                o = paged_attention.decode_attention(
                    q if g.rows_are_t else q.index_select(0, g.q_rows),
                    kv,
                    g.kv_pages.view(g.num_seqs, g.pages),
                    g.seq_lens,
                    cfg.attn_scale,
                    window,
                )
                if g.rows_are_t:  # an all-decode batch: the kernel's output is the layer's
                    return o.view(t, cfg.q_size)
                out.index_copy_(0, g.out_rows, o.view(g.num_seqs, cfg.q_size))
                continue
            self._gathered_attention(q, kv, g, mask, ws, out)
        return out

    def _gathered_attention(self, q, kv, g, mask, ws, out: torch.Tensor) -> None:
        """One group through gather + SDPA: its pages copied out of the pool, its rows of `out`
        written."""
        cfg = self.cfg
        nh, nkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = nh // nkv
        n = g.num_seqs * g.pages
        kbuf, vbuf = ws[0, :n], ws[1, :n]
        torch.index_select(kv[:, 0], 0, g.kv_pages, out=kbuf)  # ONE gather for K, one for V
        torch.index_select(kv[:, 1], 0, g.kv_pages, out=vbuf)
        keys = kbuf.view(g.num_seqs, g.kv_len, nkv, d).transpose(1, 2).to(q.dtype)
        vals = vbuf.view(g.num_seqs, g.kv_len, nkv, d).transpose(1, 2).to(q.dtype)
        qg = q.index_select(0, g.q_rows)
        # SDPA's own 1/sqrt(head_dim) unless the model names another (the same float as before)
        scale = cfg.attn_scale if cfg.query_pre_attn_scalar else None
        if g.max_q == 1:
            # Decode: the `group` query heads sharing a KV head become query rows of that head.
            o = F.scaled_dot_product_attention(
                qg.view(g.num_seqs, nkv, group, d), keys, vals, attn_mask=mask, scale=scale
            )
            out.index_copy_(0, g.out_rows, o.reshape(g.num_seqs, cfg.q_size))
            return
        qg = qg.view(g.num_seqs, g.max_q, nh, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(
            qg,
            keys,
            vals,
            attn_mask=mask,
            is_causal=g.causal and mask is None,
            enable_gqa=group > 1,
            scale=scale,
        )
        o = o.transpose(1, 2).reshape(g.num_seqs * g.max_q, cfg.q_size)
        if g.out_sel is not None:
            o = o.index_select(0, g.out_sel)
        out.index_copy_(0, g.out_rows, o)
