"""GGUF files: the config and tensor index (parsed once, then read from the file's cache folder),
tensors dequantized one at a time with the `gguf` package (llama.cpp's Q/K row permutation undone,
as in transformers' GGUF integration), and the chat template.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pdserve.engine.model.config import SUPPORTED_ARCHS, ModelConfig
from pdserve.engine.model.path import ModelLoadError, describe_error

if TYPE_CHECKING:  # torch is imported where tensors are made (see _dequant)
    import torch

_GGUF_NAMES = {  # HF name suffix -> GGUF name suffix, per layer
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


# Gemma 3's norms: four a layer, and q/k norms (llama.cpp's names); its pre-MLP norm is ffn_norm
_GEMMA3_NAMES = {
    **_GGUF_NAMES,
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
}
# What llama.cpp leaves out of a Gemma 3 GGUF, as transformers fills it in (Gemma3TextConfig's
# defaults): every sixth layer attends to everything, the others through the window with RoPE of
# base 10000, and scores are scaled by 256^-1/2.
GEMMA3_FULL_EVERY = 6
GEMMA3_LOCAL_THETA = 10000.0
GEMMA3_QUERY_PRE_ATTN_SCALAR = 256.0

_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _open_gguf(path: Path):
    """The (cached) GGUFReader of `path`: opening one parses every metadata string (~5 s for
    SmolLM2's 98k tokenizer strings), so config, slice and tokenizer loads in one process share
    it."""
    st = path.stat()
    return _open_gguf_cached(str(path.resolve()), st.st_mtime_ns, st.st_size)


@functools.lru_cache(maxsize=2)
def _open_gguf_cached(path: str, mtime_ns: int, size: int):
    import gguf

    try:
        return gguf.GGUFReader(path)
    # the reader raises ValueError, struct/numpy errors, ... on corrupt files
    except Exception as e:
        raise ModelLoadError(
            f"cannot read GGUF file {path} (corrupt or truncated?): {describe_error(e)}"
        ) from None


def _meta(reader, key: str, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ModelLoadError(f"{reader.data.filename}: GGUF metadata has no {key}")
        return default
    return f.contents()


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = str(_meta(reader, "general.architecture"))
    if arch == "qwen3":  # its q/k norm tensors are not mapped from GGUF names yet
        raise ModelLoadError(f"{path}: Qwen3 is served from a Hugging Face folder, not GGUF")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {path} (supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise ModelLoadError(f"{path}: GGUF has no token_embd.weight")
    hidden = int(_meta(reader, f"{arch}.embedding_length"))
    heads = int(_meta(reader, f"{arch}.attention.head_count"))
    scaling = None
    kind = _meta(reader, f"{arch}.rope.scaling.type", "none")
    if kind == "linear":
        scaling = {
            "rope_type": "linear",
            "factor": float(_meta(reader, f"{arch}.rope.scaling.factor")),
        }
    elif kind not in ("none", None):
        raise ModelLoadError(f"{path}: unsupported rope scaling {kind!r} (supported: linear)")
    if "rope_freqs.weight" in names:  # llama3-style scaling, stored as per-frequency factors
        t = names["rope_freqs.weight"]
        scaling = {
            "rope_type": "freq_factors",
            "freq_factors": _dequant(
                np.asarray(t.data), int(t.tensor_type), t.shape.tolist()
            ).tolist(),
        }
    eos = [int(_meta(reader, "tokenizer.ggml.eos_token_id"))]
    eot = _meta(reader, "tokenizer.ggml.eot_token_id", None)
    if eot is not None:
        eos.append(int(eot))
    bos = _meta(reader, "tokenizer.ggml.bos_token_id", None)
    layers = int(_meta(reader, f"{arch}.block_count"))
    head_dim = _meta(reader, f"{arch}.attention.key_length", None) or _meta(
        reader, f"{arch}.rope.dimension_count", hidden // heads
    )
    return ModelConfig(
        arch=arch,
        vocab_size=int(names["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=None if bos is None else int(bos),
        dtype=_gguf_dtype([int(t.tensor_type) for t in reader.tensors if len(t.shape) > 1]),
        **(_gemma3_fields(reader, hidden, layers) if arch == "gemma3" else {}),
    )


def _gemma3_fields(reader, hidden: int, layers: int) -> dict:
    """ModelConfig's Gemma 3 fields: the window from the file, the rest as transformers fills it."""
    return dict(
        qk_norm=True,
        sliding_window=int(_meta(reader, "gemma3.attention.sliding_window")),
        sliding_layers=tuple(i for i in range(layers) if (i + 1) % GEMMA3_FULL_EVERY),
        rope_local_theta=GEMMA3_LOCAL_THETA,
        query_pre_attn_scalar=GEMMA3_QUERY_PRE_ATTN_SCALAR,
        embed_scale=float(hidden) ** 0.5,
        mlp_act="gelu_tanh",
        sandwich_norms=True,
        norm_weight_offset=1.0,
    )


_GGML_F32, _GGML_F16, _GGML_BF16 = 0, 1, 30


def _gguf_dtype(matrix_types: list[int]) -> str:
    """The dtype a GGUF's weight matrices stand for: float32 only when every matrix is F32, float16
    for F16 files; bf16 for BF16 and for quantized files, whose dequantized weights carry fewer
    significant bits than bf16 holds (llama.cpp's converters start from the bf16 checkpoint)."""
    kinds = set(matrix_types)
    if kinds <= {_GGML_F32}:
        return "float32"
    if kinds <= {_GGML_F32, _GGML_F16}:
        return "float16"
    return "bfloat16"


def _dequant(raw: np.ndarray, qtype: int, shape: list[int]) -> torch.Tensor:
    """A tensor from its raw bytes in the file (`shape` in GGUF order, innermost first)."""
    import torch
    from gguf.constants import GGMLQuantizationType
    from gguf.quants import dequantize

    arr = dequantize(raw, GGMLQuantizationType(qtype)).reshape([int(x) for x in reversed(shape)])
    # F32/F16 tensors come back as views of the mmap
    if arr.dtype != np.float32 or not arr.flags.writeable:
        arr = arr.astype(np.float32)
    return torch.from_numpy(arr)


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undoes llama.cpp's convert_hf_to_gguf permute() of Q/K rows
    (back to HF's rotate-half layout)."""
    return (
        w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
        .transpose(1, 2)
        .reshape(w.shape)
    )


def gguf_fetcher(tensors: dict[str, tuple], cfg: ModelConfig, path: Path):
    data = np.memmap(path, dtype=np.uint8, mode="r")
    layer_names = _GEMMA3_NAMES if cfg.arch == "gemma3" else _GGUF_NAMES

    def fetch(name: str) -> torch.Tensor | None:
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{layer_names[rest]}"
        if gname not in tensors:
            return None
        qtype, shape, offset, nbytes = tensors[gname]
        if offset + nbytes > data.size:
            raise ModelLoadError(
                f"{path}: tensor {gname} ends past the end of the file (truncated?)"
            )
        try:
            w = _dequant(data[offset : offset + nbytes], qtype, shape)
        except Exception as e:
            raise ModelLoadError(
                f"{path}: cannot dequantize {gname}: {describe_error(e)}"
            ) from None
        if cfg.arch in ("llama", "mistral") and (".attn_q." in gname or ".attn_k." in gname):
            w = _unpermute(w, cfg.num_heads if ".attn_q." in gname else cfg.num_kv_heads)
        if cfg.norm_weight_offset and name.endswith("norm.weight"):
            # llama.cpp stores Gemma's norms with the 1 added; the HF name holds the offset
            w = w - cfg.norm_weight_offset
        return w

    return fetch


_INDEX_VERSION = 3  # 2: the config carries the weights' dtype; 3: and Gemma 3's fields


def gguf_index(path: Path) -> tuple[ModelConfig, dict[str, tuple]]:
    """The config and the tensor table (GGUF name -> (ggml type, shape, file offset, bytes)) of a
    GGUF file. Parsing its metadata takes ~4.5 s for SmolLM2 (98k tokenizer strings) in every
    process that loads the model (node front and each rank): the first parse is saved in the
    model's cache folder and later loads read that (keyed by path, size and mtime)."""
    cache = gguf_cache_dir(path) / "index.json"
    try:
        d = json.loads(cache.read_text())
        if d.get("version") != _INDEX_VERSION:
            raise ValueError("index written by another version")
        c = d["config"]
        cfg = ModelConfig(**{**c, "eos_token_ids": tuple(c["eos_token_ids"])})
        return cfg, {
            k: (int(q), [int(x) for x in sh], int(o), int(n))
            for k, (q, sh, o, n) in d["tensors"].items()
        }
    except (OSError, ValueError, TypeError, KeyError):
        pass  # no cache yet, or unreadable: parse the file
    reader = _open_gguf(path)
    cfg = _gguf_config(reader, path)
    tensors = {
        t.name: (
            int(t.tensor_type),
            [int(x) for x in t.shape.tolist()],
            int(t.data_offset),
            int(t.n_bytes),
        )
        for t in reader.tensors
    }
    _write_atomic(
        cache,
        json.dumps(
            {"version": _INDEX_VERSION, "config": dataclasses.asdict(cfg), "tensors": tensors}
        ),
    )
    return cfg, tensors


def _write_atomic(dest: Path, text: str) -> None:
    """Writes a temporary file and renames it into place (readers never see half a file); a cache
    that cannot be written is skipped."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}.", dir=dest.parent)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, dest)
    except OSError:
        pass


def gguf_cache_dir(gguf: Path) -> Path:
    """This GGUF file's cache folder (its tokenizer, its metadata index): keyed by path, size and
    mtime, so a replaced file never meets an old entry. Under `PDSERVE_CACHE_DIR` (default
    ~/.cache/pdserve)."""
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[
        :16
    ]
    root = Path(os.environ.get("PDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pdserve")
    return root / "gguf" / f"{gguf.stem}-{key}"


def gguf_chat_template(path: Path) -> str | None:
    """The chat template in a GGUF file's metadata, if it has one."""
    return _meta(_open_gguf(path), "tokenizer.chat_template", None)
