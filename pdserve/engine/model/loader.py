"""Loads a model: finds it, reads its config, and builds one layer slice with only its weights.

The entry point for models: `resolve_model` (engine/model/path.py), `load_model_config`,
`load_slice`. Two formats: a Hugging Face folder (config.json + *.safetensors, sharded or not,
read here) and a GGUF file (engine/model/gguf_file.py). A rank reads only the tensors of its slice
(`ModelSlice.weight_names`). Tokenizers: engine/model/tokenizer.py.

Everything a user can get wrong (bad path, unsupported architecture, corrupt or truncated file,
missing tensor, wrong shape) raises `ModelLoadError` with a one-line message naming the file.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.engine.model.config import SUPPORTED_ARCHS, SUPPORTED_ROPE_TYPES, ModelConfig
from pdserve.engine.model.gguf_file import gguf_fetcher, gguf_index
from pdserve.engine.model.path import ModelLoadError, describe_error, is_gguf, resolve_model

if TYPE_CHECKING:  # torch is imported where tensors are made (see load_slice)
    import torch

    from pdserve.engine.model.llama import ModelSlice

__all__ = [
    "ModelLoadError",
    "load_model_config",
    "load_slice",
    "resolve_model",
]


# -------------------------------------------------------------------------------- Hugging Face
def _hf_config(folder: Path) -> ModelConfig:
    try:
        c = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {describe_error(e)}") from None
    arch = _hf_arch(c, folder)
    extra = _gemma3_fields(c, folder / "config.json") if arch == "gemma3" else {}
    if c.get("mlp_bias") or (arch != "gemma3" and c.get("hidden_act", "silu") != "silu"):
        raise ModelLoadError(
            f"{folder / 'config.json'}: only SwiGLU MLPs without bias are supported"
        )
    theta, rope_scaling = _hf_rope(c, arch, folder)
    eos = _hf_eos(c, folder)
    try:
        heads = int(c["num_attention_heads"])
        return ModelConfig(
            arch=arch,
            vocab_size=int(c["vocab_size"]),
            hidden_size=int(c["hidden_size"]),
            intermediate_size=int(c["intermediate_size"]),
            num_layers=int(c["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(c.get("num_key_value_heads") or heads),
            head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", arch == "gemma3")),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=c.get("bos_token_id"),
            dtype=_hf_dtype(c),
            qk_norm=arch in ("qwen3", "gemma3"),
            **extra,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(
            f"{folder / 'config.json'}: missing or bad field ({describe_error(e)})"
        ) from None


def _hf_arch(c: Any, folder: Path) -> str:
    """The config's architecture, as SUPPORTED_ARCHS names it (`c`: config.json as parsed);
    refuses one the engine does not run."""
    arch = {"gemma3_text": "gemma3"}.get(c.get("model_type"), c.get("model_type"))
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {c.get('model_type')!r} in {folder / 'config.json'} "
            f"(supported: {', '.join(SUPPORTED_ARCHS)}; Gemma 3 as gemma3_text)"
        )
    return arch


def _hf_rope(c: dict, arch: str, folder: Path) -> tuple[float, dict | None]:
    """(RoPE base, ModelConfig's rope_scaling: None for the default kind) of the full-attention
    layers; refuses a RoPE kind the engine does not run."""
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    if arch == "gemma3":  # per layer type; the full-attention layers' is the model's own
        rope = dict(rope.get("full_attention") or c.get("rope_scaling") or {})
    # Gemma 3's defaults are transformers' Gemma3TextConfig's (a config saved by transformers 4
    # leaves out what equals them): full layers' RoPE base 1e6, tied embeddings
    default_theta = 1_000_000.0 if arch == "gemma3" else 10000.0
    theta = float(c.get("rope_theta") or rope.pop("rope_theta", None) or default_theta)
    rope.pop("rope_theta", None)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{folder / 'config.json'}: unsupported rope_type {kind!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES[:3])})"
        )
    return theta, None if kind == "default" else {**rope, "rope_type": kind}


def _hf_eos(c: dict, folder: Path) -> list[int]:
    """The EOS ids of config.json, then of generation_config.json where the folder has one."""
    eos = _ids(c.get("eos_token_id"))
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos += _ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {gen}: {describe_error(e)}") from None
    return eos


def _gemma3_fields(c: dict, where: Path) -> dict[str, Any]:
    """ModelConfig's Gemma 3 fields from its config.json (transformers 5's layout, or 4's:
    `rope_local_base_freq` and `sliding_window_pattern`); refuses what the engine does not run."""
    for field in ("final_logit_softcapping", "attn_logit_softcapping"):
        if c.get(field) is not None:
            raise ModelLoadError(f"{where}: {field} is not supported")
    if c.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{where}: use_bidirectional_attention is not supported")
    act = c.get("hidden_activation") or c.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{where}: hidden_activation {act!r} is not supported")
    layers = int(c["num_hidden_layers"])
    types = c.get("layer_types")
    if types is None:
        every = int(c.get("sliding_window_pattern", 6))
        types = [
            "full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(layers)
        ]
    if len(types) != layers or set(types) - {"full_attention", "sliding_attention"}:
        raise ModelLoadError(f"{where}: layer_types must name each of the {layers} layers")
    local = (c.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ModelLoadError(f"{where}: the sliding layers' RoPE must be the default kind")
    window = int(c.get("sliding_window") or 0)
    if window < 1:
        raise ModelLoadError(f"{where}: sliding_window must be >= 1")
    return dict(
        sliding_window=window,
        sliding_layers=tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
        rope_local_theta=float(local.get("rope_theta") or c.get("rope_local_base_freq") or 10000.0),
        query_pre_attn_scalar=float(c.get("query_pre_attn_scalar") or 256.0),
        embed_scale=float(c["hidden_size"]) ** 0.5,
        mlp_act="gelu_tanh",
        sandwich_norms=True,
        norm_weight_offset=1.0,
    )


def _hf_dtype(c: dict) -> str:
    """The dtype the checkpoint was saved in (`dtype`, or `torch_dtype` before transformers 4.56);
    float32 when the config names none, as transformers assumes."""
    name = str(c.get("dtype") or c.get("torch_dtype") or "float32").removeprefix("torch.")
    return name if name in ("float32", "bfloat16", "float16") else "float32"


def _ids(v) -> list[int]:
    return [] if v is None else [int(x) for x in (v if isinstance(v, list) else [v])]


def _hf_fetcher(folder: Path, stack: contextlib.ExitStack):
    """name -> tensor reader over the folder's safetensors files (sharded or not);
    only headers are read here."""
    from safetensors import safe_open

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{folder} has no *.safetensors weights")
    where: dict[str, tuple[Any, Path]] = {}  # name -> (its file's safe_open handle, path)
    for path in files:
        try:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as e:  # safetensors raises its own error types for corrupt headers/data
            raise ModelLoadError(f"cannot read weights from {path}: {describe_error(e)}") from None
        where.update((k, (f, path)) for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)

    def fetch(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        f, path = where[name]
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(
                f"cannot read tensor {name} from {path}: {describe_error(e)}"
            ) from None

    return fetch


class _SliceWeights(Mapping):
    """The slice's tensors by HF name, read (and dequantized) one at a time when the model asks,
    so a rank never holds more than one temporary tensor; shapes are checked against the config."""

    def __init__(self, names: list[str], fetch, cfg: ModelConfig, path: Path):
        self._names, self._fetch, self._cfg, self._path = names, fetch, cfg, path

    def __len__(self) -> int:
        return len(self._names)

    def __iter__(self):
        return iter(self._names)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._names:
            raise KeyError(name)
        w = self._fetch(name)
        if w is None:
            raise ModelLoadError(f"{self._path}: weights have no tensor {name}")
        want = _expected_shape(self._cfg, name)
        if tuple(w.shape) != want:
            raise ModelLoadError(
                f"{self._path}: tensor {name} has shape {tuple(w.shape)}, config says {want}"
            )
        return w


# -------------------------------------------------------------------------------------- public
def _expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h)
    if name.endswith(("q_norm.weight", "k_norm.weight")):
        return (cfg.head_dim,)
    if name.endswith("norm.weight"):
        return (h,)
    if "q_proj" in name:
        return (cfg.q_size, h) if name.endswith("weight") else (cfg.q_size,)
    if "k_proj" in name or "v_proj" in name:
        return (cfg.kv_size, h) if name.endswith("weight") else (cfg.kv_size,)
    return {"o_proj": (h, cfg.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}[
        name.split(".")[-2]
    ]


def load_model_config(path) -> ModelConfig:
    p = resolve_model(path)
    return gguf_index(p)[0] if is_gguf(p) else _hf_config(p)


# generation_config.json keys that set a request's defaults, as vLLM's `--generation-config auto`
# reads them (only keys the file states; HF's own class defaults do not count). The value is the
# SamplingParams field each one sets.
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "max_new_tokens": "max_tokens",
}
UNAPPLIED_DEFAULT_KEYS = ("repetition_penalty",)  # vLLM applies it; pdserve has no penalties


def load_sampling_defaults(path) -> dict:
    """The model's own sampling defaults from a HF folder's generation_config.json (a GGUF has
    none), keyed by SamplingParams field: temperature, top_p, top_k (HF's 0 = off becomes -1),
    min_p, max_tokens (from max_new_tokens). A value SamplingParams refuses is an error naming the
    file. Defaults pdserve cannot apply (repetition_penalty) come back under "unapplied"."""
    from pdserve.engine.core import ParamError, SamplingParams

    p = resolve_model(path)
    gen = p / "generation_config.json"
    if is_gguf(p) or not gen.is_file():
        return {}
    try:
        raw = json.loads(gen.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {gen}: {describe_error(e)}") from None
    raw = raw if isinstance(raw, dict) else {}
    out = {}
    for key, name in SAMPLING_DEFAULT_KEYS.items():
        value = -1 if key == "top_k" and raw.get(key) == 0 else raw.get(key)
        if value is None:
            continue
        try:
            SamplingParams.from_dict({name: value})
        except (ParamError, TypeError) as e:
            raise ModelLoadError(f"{gen}: {key} = {value!r} is not a valid default ({e})") from None
        out[name] = value
    unapplied = {k: raw[k] for k in UNAPPLIED_DEFAULT_KEYS if raw.get(k) not in (None, 1, 1.0)}
    return {**out, "unapplied": unapplied} if unapplied else out


def load_slice(path, layer_start: int, layer_end: int, dtype=None, shard=None) -> ModelSlice:
    """Builds layers [layer_start, layer_end) and loads only their weights (plus embedding / head);
    `dtype` defaults to float32; `shard` (a TPShard): a TP rank's share of the layers. torch is
    imported here, not with the module: node fronts read configs and tokenizers through this
    module and never need torch."""
    import torch

    from pdserve.engine.model.llama import ModelSlice

    p = resolve_model(path)
    with contextlib.ExitStack() as stack:
        if is_gguf(p):
            cfg, tensors = gguf_index(p)
            fetch = gguf_fetcher(tensors, cfg, p)
        else:
            cfg = _hf_config(p)
            fetch = _hf_fetcher(p, stack)
        if not 0 <= layer_start < layer_end <= cfg.num_layers:
            raise ModelLoadError(
                f"layer slice [{layer_start}, {layer_end}) is outside the model's "
                f"{cfg.num_layers} layers"
            )
        model = ModelSlice(cfg, layer_start, layer_end, dtype=dtype or torch.float32, shard=shard)
        model.load_weights(_SliceWeights(model.weight_names(), fetch, cfg, p))
    return model.eval()
