"""What a model is, as plain data (no torch): the fronts read it to validate requests, the ranks to
build their layer slice. Also the architectures and RoPE kinds the engine implements."""

from __future__ import annotations

from dataclasses import dataclass

SUPPORTED_ARCHS = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
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
    qk_norm: bool = False  # Qwen3, Gemma 3: an RMSNorm over each head of q and k, before RoPE
    # Gemma 3 (engine/model/decoder_layer.py). Sliding-window attention: a token on one of
    # `sliding_layers` (global indices) attends to the last `sliding_window` positions only, its
    # own included, with RoPE of base `rope_local_theta`; the other layers attend to everything.
    sliding_window: int = 0
    sliding_layers: tuple[int, ...] = ()
    rope_local_theta: float = 0.0
    query_pre_attn_scalar: float = 0.0  # attention scores scaled by its -1/2; 0: head_dim's
    embed_scale: float = 1.0  # the embedding rows multiplied by it (Gemma: sqrt(hidden_size))
    mlp_act: str = "silu"  # gate activation: "silu" (SwiGLU) or "gelu_tanh" (GeGLU)
    # RMSNorms on the attention's and the MLP's outputs too, before they join the residual
    sandwich_norms: bool = False
    # stored norm weights are an offset from this (Gemma: x * (1 + w)); added once at load
    norm_weight_offset: float = 0.0

    def __post_init__(self):
        # a tuple whatever it came as (a JSON cache gives lists): hashable, and the same on every
        # rank
        object.__setattr__(self, "sliding_layers", tuple(int(i) for i in self.sliding_layers))
        if self.mlp_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"mlp_act must be silu or gelu_tanh, got {self.mlp_act!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def attn_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding(self, layer: int) -> bool:
        """Whether global layer `layer` attends through the sliding window."""
        return self.sliding_window > 0 and layer in self.sliding_layers

    def window_of(self, layer: int) -> int:
        """The window of global layer `layer`, in positions; 0: all of them."""
        return self.sliding_window if self.is_sliding(layer) else 0


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


def tp_refusal(cfg: ModelConfig, tp: int) -> str:
    """Why TP size `tp` cannot cut this model, or ""."""
    if tp < 1:
        return f"tp must be at least 1, got {tp}"
    for what, n in (
        ("query heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP width (intermediate_size)", cfg.intermediate_size),
    ):
        if n % tp:
            return f"tp {tp} does not divide the model's {n} {what}"
    return ""


def slice_weight_names(cfg: ModelConfig, layer_start: int, layer_end: int) -> list[str]:
    """Hugging Face names of the tensors layers [layer_start, layer_end) need: theirs, the
    embedding on the first slice, the final norm and LM head on the last."""
    names = []
    if layer_start == 0:
        names.append("model.embed_tokens.weight")
    for i in range(layer_start, layer_end):
        p = f"model.layers.{i}."
        if cfg.sandwich_norms:
            names += [p + "pre_feedforward_layernorm.weight"]
            names += [p + "post_feedforward_layernorm.weight"]
        names += [
            p + "input_layernorm.weight",
            p + "post_attention_layernorm.weight",
            p + "self_attn.o_proj.weight",
            p + "mlp.gate_proj.weight",
            p + "mlp.up_proj.weight",
            p + "mlp.down_proj.weight",
        ]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if cfg.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if cfg.qk_norm:
            names += [p + "self_attn.q_norm.weight", p + "self_attn.k_norm.weight"]
    if layer_end == cfg.num_layers:
        names.append("model.norm.weight")
        names.append("model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    return list(dict.fromkeys(names))
