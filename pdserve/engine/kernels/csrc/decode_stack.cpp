// A bf16 layer slice's decode forward in one call (CPU): every layer's ops, in the order and with
// the roundings of the Python layer loop (pdserve/engine/model/llama.py), called from C++.
//
// In a decode step of a few rows the Python loop itself costs: each layer is ten dispatched calls
// through Python wrappers (norms, four matmuls, rotary and KV store, attention, SiLU-and-multiply,
// two residual adds), and the weight stream stalls between them. SmolLM2's decode step on one core
// took 1.32x / 1.10x / 1.06x this call's time at 1 / 8 / 32 requests (bench/bench_decode_stack.py).
//
// Per layer, h [T, H] bf16 updated in place:
//   x = rms_norm(h, in_norm);  qkv = x @ Wqkv (+ bias);  rotary on q, k and store k, v in the pool
//   h += attention(q) @ Wo;    x = rms_norm(h, post_norm);  h += silu_mul(x @ Wgate_up) @ Wdown
// The same functions the per-op calls reach (ops.h), so the results are bit for bit those of the
// loop (tests/test_decode_stack.py). One query row per request: an all-decode batch only.
//
// Op: pdserve::decode_stack_(h, weights, qkv_bias, cos, sin, kv, pages, offs, page_table,
//                            seq_lens, nh, nkv, eps, scale)
//   h          [T, H] bf16, contiguous
//   weights    6 per layer: in_norm [H], qkv, o, post_norm [H], gate_up, down: the matmul weights
//              blocked by pdserve::pack_bf16_linear
//   qkv_bias   empty, or one [(nh + 2 nkv) d] per layer
//   cos, sin   [T, 1, d] for the rows' positions
//   kv         the slice's pool [pages, layers, 2, page_size, nkv, d]
//   pages, offs, page_table, seq_lens: as rope_store_kv_ and paged_decode_attention take them
#include <ATen/ATen.h>
#include <torch/library.h>

#include <cstdint>

#include "ops.h"

namespace {

constexpr int64_t kPerLayer = 6;

void check_blocked(const at::Tensor& w, int64_t n, int64_t k, const char* name, int64_t layer) {
  TORCH_CHECK(pdserve_ops::blocked_for(w, k, n), "decode_stack_: layer ", layer, "'s ", name,
              " weight is not blocked for [", n, ", ", k, "]");
}

void decode_stack_(at::Tensor& h, at::TensorList weights, at::TensorList qkv_bias,
                   const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                   const at::Tensor& pages, const at::Tensor& offs, const at::Tensor& page_table,
                   const at::Tensor& seq_lens, int64_t nh, int64_t nkv, double eps, double scale) {
  TORCH_CHECK(h.device().is_cpu() && h.scalar_type() == at::kBFloat16 && h.dim() == 2 &&
                  h.is_contiguous(),
              "decode_stack_: h must be a contiguous CPU bf16 [T, H] tensor");
  TORCH_CHECK(kv.dim() == 6 && kv.size(2) == 2 && kv.size(4) == nkv,
              "decode_stack_: kv must be the slice's pool [pages, layers, 2, page_size, nkv, d]");
  const int64_t layers = kv.size(1), T = h.size(0), H = h.size(1), d = kv.size(5);
  TORCH_CHECK(layers >= 1, "decode_stack_: no layers");
  TORCH_CHECK(static_cast<int64_t>(weights.size()) == kPerLayer * layers, "decode_stack_: ",
              weights.size(), " weights for ", layers, " layers (", kPerLayer, " each)");
  TORCH_CHECK(qkv_bias.empty() || static_cast<int64_t>(qkv_bias.size()) == layers,
              "decode_stack_: qkv_bias must be empty or one per layer");
  TORCH_CHECK(nh > 0 && nkv > 0 && nh % nkv == 0, "decode_stack_: nh must be a multiple of nkv");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == T,
              "decode_stack_: one page-table row per row of h (an all-decode batch)");
  // every weight checked before h or the pool is touched: a bad call fails whole
  const int64_t n_qkv = (nh + 2 * nkv) * d;
  const int64_t inter = weights[5].dim() == 4 ? weights[5].size(1) * 2 : 0;  // down's inputs
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    for (int64_t j : {0, 3})
      TORCH_CHECK(w[j].dim() == 1 && w[j].size(0) == H && w[j].is_contiguous() &&
                      w[j].scalar_type() == at::kBFloat16,
                  "decode_stack_: layer ", i, "'s norm weights must be contiguous bf16 [", H, "]");
    check_blocked(w[1], n_qkv, H, "qkv", i);
    check_blocked(w[2], H, nh * d, "o", i);
    check_blocked(w[4], 2 * inter, H, "gate_up", i);
    check_blocked(w[5], H, inter, "down", i);
    if (!qkv_bias.empty())
      TORCH_CHECK(qkv_bias[i].dim() == 1 && qkv_bias[i].size(0) == n_qkv &&
                      qkv_bias[i].scalar_type() == at::kBFloat16,
                  "decode_stack_: layer ", i, "'s qkv bias must be bf16 [", n_qkv, "]");
  }
  for (int64_t i = 0; i < layers; ++i) {
    const at::Tensor* w = weights.data() + i * kPerLayer;
    at::Tensor x = pdserve_ops::rms_norm(h, w[0], eps);
    at::Tensor qkv = pdserve_ops::bf16_linear(x, w[1], n_qkv);
    if (!qkv_bias.empty()) qkv.add_(qkv_bias[i]);
    at::Tensor kvl = kv.select(1, i);
    pdserve_ops::rope_store_kv_(qkv, cos, sin, kvl, pages, offs, nh, nkv);
    const at::Tensor q = qkv.narrow(1, 0, nh * d).view({T, nh, d});
    const at::Tensor o = pdserve_ops::paged_decode_attention(q, kvl, page_table, seq_lens, scale);
    h.add_(pdserve_ops::bf16_linear(o.view({T, nh * d}), w[2], H));
    x = pdserve_ops::rms_norm(h, w[3], eps);
    const at::Tensor act = pdserve_ops::silu_mul(pdserve_ops::bf16_linear(x, w[4], 2 * inter));
    h.add_(pdserve_ops::bf16_linear(act, w[5], H));
  }
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("decode_stack_(Tensor(a!) h, Tensor[] weights, Tensor[] qkv_bias, Tensor cos, Tensor sin, "
        "Tensor(b!) kv, Tensor pages, Tensor offs, Tensor page_table, Tensor seq_lens, int nh, "
        "int nkv, float eps, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("decode_stack_", &decode_stack_); }
