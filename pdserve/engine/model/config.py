"""What a model is, as plain data (no torch): the fronts read it to validate requests, the ranks to
build their layer slice. Also the architectures and RoPE kinds the engine implements."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    tie_word_embeddings: bool
    max_position_embeddings: int
    attention_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    dtype: str = "float32"  # the weights' own dtype: what `--dtype auto` serves in
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head of q and k, before RoPE

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def split_layers(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Contiguous slices, earlier ranks one layer longer when it does not divide (30/4: 8,8,7,7)."""
    if not 1 <= pp_size <= num_layers:
        raise ValueError(f"pp size {pp_size} must be between 1 and the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    out, start = [], 0
    for r in range(pp_size):
        n = base + (1 if r < extra else 0)
        out.append((start, start + n))
        start += n
    return out
