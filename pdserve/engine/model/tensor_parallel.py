"""Tensor parallelism inside a PP stage (docs/ARCHITECTURE.md section 15): how a layer's weights
are cut between the TP ranks of a stage, Megatron-style.

- Q, K, V and gate/up are cut by output rows: TP rank r holds query heads
  [r * H/tp, (r+1) * H/tp), KV heads [r * KV/tp, (r+1) * KV/tp) and the same share of the MLP's
  columns. Its attention runs over its own heads, and its KV pool holds only its KV heads.
- The output projection and down are cut by input columns. Each rank's product is a partial sum
  of the layer's output, and the group sums them (`TPShard.reduce`, an all-reduce) before the
  residual adds it (Gemma 3: before its output norm): two all-reduces per layer.
- Norms, the embedding, the final norm and the LM head are whole on every rank, so every rank of
  a stage holds the same hidden states and the last stage's ranks the same logits.

A TP size that does not divide the query heads, the KV heads and the MLP width is refused, with
the count it does not divide. KV heads are not replicated: a replicated head would hold its KV on
every rank of the group, and a decode rank could no longer own a distinct range of heads.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from pdserve.engine.model.config import ModelConfig, tp_refusal


@dataclass(frozen=True)
class TPShard:
    """This rank's place in its stage's TP group, and the group's in-place sum."""

    rank: int = 0
    size: int = 1
    # sums a partial layer output over the group, in place; None: a group of one
    reduce: Callable[[torch.Tensor], None] | None = None


def shard_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """The shape of one TP rank's layers: its share of the heads and of the MLP."""
    why = tp_refusal(cfg, tp)
    if why:
        raise ValueError(why)
    if tp == 1:
        return cfg
    return replace(
        cfg,
        num_heads=cfg.num_heads // tp,
        num_kv_heads=cfg.num_kv_heads // tp,
        intermediate_size=cfg.intermediate_size // tp,
    )


def rows(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's share of `t`'s first dimension (a view)."""
    n = t.shape[0] // shard.size
    return t.narrow(0, shard.rank * n, n)


def cols(t: torch.Tensor, shard: TPShard) -> torch.Tensor:
    """This rank's share of `t`'s last dimension (a view)."""
    n = t.shape[-1] // shard.size
    return t.narrow(-1, shard.rank * n, n)
