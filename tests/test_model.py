"""ModelSlice over the paged KV pool vs Hugging Face transformers on the same weights.

Each scenario runs several requests in pieces: prefill in two chunks (the second attends to the
first chunk's cached KV), mixed prefill + decode batches, then decode steps; every logit row we
compute is compared to HF's full-sequence logits at the same position. Page tables are scattered.
"""

from __future__ import annotations

import contextlib
import functools
import random

import pytest
import torch

from pdserve.engine import forward_batch
from pdserve.engine.forward_batch import BatchItem, build_forward_batch
from pdserve.engine.kernels import layer_ops, paged_attention
from pdserve.engine.kv_cache import KVLayout, KVPool, pages_needed
from pdserve.engine.model import gguf_file
from pdserve.engine.model.detokenizer import StopDetokenizer
from pdserve.engine.model.gguf_file import gguf_cache_dir
from pdserve.engine.model.linear import batch_invariant_why_not
from pdserve.engine.model.loader import load_model_config, load_slice, resolve_model
from pdserve.engine.model.tokenizer import load_tokenizer
from tests.tiny_model import build_tiny_model

PAGE_SIZE = 4
PROMPTS = (5, 11, 17, 2, 140)  # the last one: a long chunk alone, causal from 0, then a masked one
DECODE_STEPS = 4
# (request, new tokens, logits wanted); requests start at different steps, so batches mix kinds.
PLAN = [
    [(0, 3, False), (1, 6, True), (3, 2, True), (4, 70, False)],
    [(0, 2, True), (1, 5, True), (3, 1, True), (2, 9, False), (4, 70, True)],
    [(0, 1, True), (1, 1, True), (2, 8, True), (3, 1, True), (4, 1, True)],
] + [[(r, 1, True) for r in range(5)]] * DECODE_STEPS
TOTAL = [sum(n for step in PLAN for r, n, _ in step if r == req) for req in range(len(PROMPTS))]


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny matmuls: intra-op threads only add wake-up latency (a lot of it on a shared machine)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max()).item()


def scattered_tables(lengths, page_size, num_pages, seed=0):
    pages = list(range(num_pages))
    random.Random(seed).shuffle(pages)
    tables = []
    for n in lengths:
        k = pages_needed(n, page_size)
        tables.append(pages[:k])
        pages = pages[k:]
    return tables


def run_plan(
    slices,
    cfg,
    seqs,
    plan,
    page_size=PAGE_SIZE,
    dtype=torch.float32,
    one_group=False,
    one_extend_group=False,
    one_token_group=False,
):
    """Runs `plan` through the chained slices; returns {(request, position): logits row}.
    `one_group` / `one_extend_group`: the decode / extend items in one attention group, as the
    runner asks for the in-place kernels; `one_token_group`: every token a decode query (batch-
    invariant serving)."""
    num_pages = sum(pages_needed(len(s), page_size) for s in seqs) + 3
    pools = [
        KVPool(
            KVLayout(
                num_pages,
                page_size,
                s.layer_start,
                s.layer_end,
                cfg.num_kv_heads,
                cfg.head_dim,
                dtype,
            )
        )
        for s in slices
    ]
    tables = scattered_tables([len(s) for s in seqs], page_size, num_pages)
    done = [0] * len(seqs)
    got = {}
    for step in plan:
        items, toks = [], []
        for r, n, logits in step:
            items.append(BatchItem(tables[r], done[r], n, logits))
            toks += seqs[r][done[r] : done[r] + n]
            done[r] += n
        fb = build_forward_batch(
            items,
            page_size,
            one_decode_group=one_group,
            one_extend_group=one_extend_group,
            one_token_group=one_token_group,
            window=max(s.window for s in slices),
        )
        x = torch.tensor(toks)
        for s, pool in zip(slices, pools, strict=True):
            x = s(x, fb, pool)
        wanted = [(r, done[r] - 1) for r, _, logits in step if logits]
        assert x.dtype == dtype and x.shape == (len(wanted), cfg.vocab_size)
        got.update(zip(wanted, x, strict=True))
    return got


@contextlib.contextmanager
def gguf_parsed_once():
    """transformers' GGUF load parses the file twice (config, then weights) and rebuilds gguf's
    tensor-name map once per module (about 400 times for SmolLM2). Both are pure functions of
    their arguments, so while the reference loads, each is computed once per argument; the
    conversion and dequantisation stay transformers' own."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=4)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=16)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def hf_logits(path, seqs, **kw):
    from transformers import AutoModelForCausalLM

    with gguf_parsed_once():
        ref = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kw).eval()
    with torch.no_grad():
        return [ref(torch.tensor([s])).logits[0] for s in seqs]


def max_err(got, ref):
    return max(rel_err(row, ref[r][p]) for (r, p), row in got.items())


VARIANTS = {
    "llama": dict(),
    "llama_tied_llama3": dict(
        tie=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2_bias": dict(arch="qwen2"),
    "qwen3_qk_norm": dict(arch="qwen3"),
    # sliding windows, GeGLU, four norms a layer, scaled embeddings, a scale of its own
    "gemma3": dict(arch="gemma3", tie=True),
    "llama_linear": dict(rope_scaling={"rope_type": "linear", "factor": 2.0}),
}


@pytest.fixture(scope="module")
def build_variant(tmp_path_factory):
    """variant name -> (path, config, token sequences, HF logits per sequence);
    each built once per module."""
    built = {}

    def build(name):
        if name not in built:
            path = build_tiny_model(tmp_path_factory.mktemp(name), **VARIANTS[name])
            cfg = load_model_config(path)
            rng = random.Random(1)
            seqs = [[rng.randrange(cfg.vocab_size) for _ in range(n)] for n in TOTAL]
            built[name] = path, cfg, seqs, hf_logits(path, seqs)
        return built[name]

    return build


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, build_variant):
    return build_variant(request.param)


@pytest.fixture(scope="module")
def tiny_llama(build_variant):
    return build_variant("llama")


@pytest.mark.parametrize(
    "cuts", [[(0, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["one_slice", "three_slices"]
)
def test_tiny_matches_hf(tiny, cuts):
    path, cfg, seqs, ref = tiny
    slices = [load_slice(path, a, b) for a, b in cuts]
    assert slices[0].is_first and slices[-1].is_last
    got = run_plan(slices, cfg, seqs, PLAN)
    assert len(got) == sum(logits for step in PLAN for *_, logits in step)
    assert max_err(got, ref) < 1e-4


def test_small_groups_and_page_size(tiny_llama, monkeypatch):
    """Several decode/extend attention groups per batch
    (sorted, padded), and a page size of 1 and 16."""
    path, cfg, seqs, ref = tiny_llama
    monkeypatch.setattr(forward_batch, "DECODE_GROUP_SIZE", 2)
    monkeypatch.setattr(forward_batch, "EXTEND_GROUP_SIZE", 2)
    monkeypatch.setattr(forward_batch, "LONG_EXTEND", 1000)
    s = [load_slice(path, 0, 2), load_slice(path, 2, 4)]
    for page_size in (1, 16):
        assert max_err(run_plan(s, cfg, seqs, PLAN, page_size=page_size), ref) < 1e-4


def test_bf16(tiny_llama):
    path, cfg, seqs, ref = tiny_llama
    got = run_plan(
        [load_slice(path, 0, 4, dtype=torch.bfloat16)], cfg, seqs, PLAN[:3], dtype=torch.bfloat16
    )
    assert max_err(got, ref) < 0.1


def test_gemma_norms_round_once_as_transformers(build_variant):
    """Gemma's RMSNorm computes in fp32 and rounds once (transformers' Gemma3RMSNorm): a bf16 slice
    keeps those weights in fp32, offset added, and its norm is transformers' bit for bit. With
    1 + w rounded to bf16 (as before), every row of this batch differed, in a third of its
    values."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    path, cfg, _, _ = build_variant("gemma3")
    s = load_slice(path, 0, 4, dtype=torch.bfloat16)
    norms = [s.norm_weight] + [
        w for layer in s.layers for w in (layer.input_norm_weight, layer.q_norm_weight)
    ]
    assert all(w is not None and w.dtype == torch.float32 for w in norms)
    assert s.layers[0].qkv_weight.dtype == torch.bfloat16
    torch.manual_seed(0)
    hf = Gemma3RMSNorm(640, eps=1e-6).to(torch.bfloat16)
    hf.weight.data = (torch.randn(640) * 0.5).to(torch.bfloat16)
    x = (torch.randn(64, 640) * 3).to(torch.bfloat16)
    want = hf(x)
    assert torch.equal(layer_ops.rms_norm(x, hf.weight.float() + 1.0, 1e-6), want)
    q = x.view(64, 10, 64)  # a q/k norm: heads of 64 values
    hf_q = Gemma3RMSNorm(64, eps=1e-6).to(torch.bfloat16)
    hf_q.weight.data = hf.weight.data[:64].clone()
    assert torch.equal(layer_ops.rms_norm(q, hf_q.weight.float() + 1.0, 1e-6), hf_q(q))


def test_every_token_a_decode_query_matches_hf(tiny_llama):
    """Batch-invariant serving's attention (engine/forward_batch.py `one_token_group`): fp32
    through the decode kernel, and bf16 with every matmul on the blocked kernel."""
    if not paged_attention.load():
        pytest.skip(f"no decode kernel here: {paged_attention.why_not()}")
    path, cfg, seqs, ref = tiny_llama
    s = [load_slice(path, 0, 2), load_slice(path, 2, 4)]
    assert max_err(run_plan(s, cfg, seqs, PLAN, one_token_group=True), ref) < 1e-4
    why = batch_invariant_why_not(torch.bfloat16)
    if why:
        pytest.skip(f"no batch-invariant bf16 here: {why}")
    s = [load_slice(path, 0, 4, dtype=torch.bfloat16)]
    s[0].add_small_batch_weights(batch_invariant=True)
    assert s[0].batch_invariant and s[0].blocked_matmuls() == 4 * 4 + 1
    got = run_plan(s, cfg, seqs, PLAN, dtype=torch.bfloat16, one_token_group=True)
    assert max_err(got, ref) < 0.1


def test_one_token_group_layout():
    """Every token of T is a one-row query over its own item's pages, up to its own position."""
    items = [
        BatchItem([7, 3], 5, 2, True),
        BatchItem([1], 0, 1, False),
        BatchItem([4, 9], 2, 3, True),
    ]
    fb = build_forward_batch(items, page_size=4, one_token_group=True, one_extend_group=True)
    (g,) = fb.groups
    assert g.rows_are_t and g.max_q == 1 and g.num_seqs == fb.num_tokens == 6
    assert g.seq_lens.tolist() == [6, 7, 1, 3, 4, 5]
    assert g.kv_pages.view(6, 2).tolist() == [[7, 3], [7, 3], [1, 0], [4, 9], [4, 9], [4, 9]]
    assert fb.logit_rows.tolist() == [1, 5]


def test_forward_batch_layout():
    items = [
        BatchItem([7, 3], 5, 2, True),
        BatchItem([1], 0, 1, False),
        BatchItem([4, 9, 2], 0, 9, True),
    ]
    fb = build_forward_batch(items, page_size=4)
    assert fb.num_tokens == 12
    assert fb.positions.tolist() == [5, 6, 0] + list(range(9))
    assert fb.out_slots.tolist() == [3 * 4 + 1, 3 * 4 + 2, 4] + [16, 17, 18, 19, 36, 37, 38, 39, 8]
    assert fb.logit_rows.tolist() == [1, 11]
    # every token's output row is produced by exactly one group
    rows = sorted(r for g in fb.groups for r in g.out_rows.tolist())
    assert rows == list(range(12))
    with pytest.raises(ValueError, match="pages"):
        build_forward_batch([BatchItem([0], 3, 2, True)], page_size=4)


def test_one_decode_group_for_the_in_place_kernel():
    """For the in-place kernel: every decode item in one group, in item order (no sort, no
    padding to share), and an all-decode batch's rows are T itself, so the layer skips the
    index_select and index_copy around the kernel."""
    items = [
        BatchItem([2], 3, 1, True),
        BatchItem([4, 9, 2], 0, 9, True),
        BatchItem([7, 3], 5, 1, True),
        BatchItem([1, 5], 7, 1, True),
    ]
    mixed = build_forward_batch(items, page_size=4, one_decode_group=True)
    decode = [g for g in mixed.groups if g.max_q == 1]
    assert len(decode) == 1 and not decode[0].rows_are_t
    assert decode[0].q_rows.tolist() == [0, 10, 11]  # item order, not sorted by length
    assert decode[0].seq_lens.tolist() == [4, 6, 8]
    rows = sorted(r for g in mixed.groups for r in g.out_rows.tolist())
    assert rows == list(range(12))
    only = [it for it in items if it.num_new == 1]
    fb = build_forward_batch(only, page_size=4, one_decode_group=True)
    (g,) = fb.groups
    assert g.rows_are_t and g.q_rows.tolist() == g.out_rows.tolist() == [0, 1, 2]
    assert g.kv_pages.view(3, 2).tolist() == [[2, 0], [7, 3], [1, 5]]
    # the default (the gather path): sorted by length, cut into groups, never rows_are_t
    sorted_fb = build_forward_batch(only, page_size=4)
    assert [r for g in sorted_fb.groups for r in g.q_rows.tolist()] == [2, 1, 0]
    assert not any(g.rows_are_t for g in sorted_fb.groups)


@pytest.fixture(scope="module")
def smollm2():
    path = resolve_model(None)
    cfg = load_model_config(path)
    tok = load_tokenizer(path)
    texts = [
        "The capital of France is Paris, and the capital of Italy is",
        "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) +",
        "Pipeline parallelism splits the layers of a model across several processes.",
    ]
    seqs = [tok(t).input_ids for t in texts]
    return path, cfg, tok, seqs, hf_logits(path.parent, seqs, gguf_file=path.name)


@pytest.mark.heavy
def test_smollm2_gguf_matches_hf(smollm2):
    path, cfg, tok, seqs, ref = smollm2
    assert (
        cfg.num_layers,
        cfg.hidden_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    ) == (30, 576, 9, 3, 64, 49152)
    assert cfg.tie_word_embeddings and 2 in cfg.eos_token_ids
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.endswith("<|im_start|>assistant\n")
    decode = 3  # the last tokens of each text are fed one by one as decode steps
    plan = [
        [(r, (len(s) - decode) // 2, False) for r, s in enumerate(seqs)],
        [(r, len(s) - decode - (len(s) - decode) // 2, True) for r, s in enumerate(seqs)],
    ]
    plan += [[(r, 1, True) for r in range(len(seqs))]] * decode
    for cuts in ([(0, 30)], [(0, 11), (11, 30)]):
        got = run_plan([load_slice(path, a, b) for a, b in cuts], cfg, seqs, plan, page_size=16)
        assert len(got) == len(seqs) * (decode + 1)
        assert max_err(got, ref) < 1e-4


@pytest.mark.heavy
def test_smollm2_caches_read_back_the_same(smollm2, monkeypatch):
    """The first loads (the fixture's) parsed the GGUF and cached its metadata index and tokenizer;
    with the GGUF reader unavailable, config and tokenizer now come from the cache, equal to the
    parsed ones, and the ranks' stop-string decoder decodes like the transformers tokenizer."""
    path, cfg, tok, seqs, _ = smollm2
    cache = gguf_cache_dir(path)
    assert (cache / "index.json").is_file() and (cache / "tokenizer" / "tokenizer.json").is_file()

    def no_reader(_path):
        raise AssertionError("the GGUF was parsed again instead of read from the cache")

    monkeypatch.setattr(gguf_file, "_open_gguf", no_reader)
    assert load_model_config(path) == cfg
    tok2 = load_tokenizer(path)
    msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Ünïcode ✓ 漢字 and code: x**2"},
    ]
    assert tok2.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True
    ) == tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    text = tok.decode(seqs[1]) + " <|im_end|>\n\t漢字"
    assert tok2(text).input_ids == tok(text).input_ids
    assert (tok2.eos_token_id, tok2.bos_token_id, tok2.all_special_ids) == (
        tok.eos_token_id,
        tok.bos_token_id,
        tok.all_special_ids,
    )
    detok, rng = StopDetokenizer(path), random.Random(3)
    for _ in range(200):
        ids = [rng.randrange(cfg.vocab_size) for _ in range(rng.randrange(1, 30))]
        assert (
            detok(ids)
            == tok.decode(ids, skip_special_tokens=True)
            == tok2.decode(ids, skip_special_tokens=True)
        )
