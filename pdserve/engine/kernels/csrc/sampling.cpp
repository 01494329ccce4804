// The last rank's choice of a token per row of logits, for the rows without a top-k, top-p or
// min-p filter (pdserve/engine/sampling.py): greedy rows take the argmax, the others draw from
// softmax(logits / temperature) by the inverse of its CDF with the row's uniform number u.
//
// Through torch a sampled row was five dispatched passes over the vocabulary (convert, divide,
// softmax, cumulative sum, search), each a full read and write of 49,152 floats; here a row is read
// once from the logits (bf16 or fp32, as the forward left them) and its weights once from a
// scratch row in cache.
//
// Op: pdserve::sample_rows(logits, temps, u) -> tokens
//   logits [R, V] fp32 or bf16, V contiguous
//   temps  [R] fp32    0: the argmax (the first maximum, as torch.argmax); > 0: the temperature
//   u      [R] fp64    in [0, 1): the row's uniform draw (ignored for greedy rows)
//   tokens [R] int64   -1 where the row has no distribution (a NaN, or every logit -inf): the
//                      caller decides
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t kBlock = 64;  // weights summed per block; the search walks blocks, then tokens

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return pdserve_vec::bf16_bits_to_f32(v.x); }

template <typename T>
int64_t choose(const T* x, int64_t V, float temp, double u, float* w, double* block_sums) {
  float m = -std::numeric_limits<float>::infinity();
  int nan = 0;
#pragma omp simd reduction(max : m) reduction(| : nan)
  for (int64_t i = 0; i < V; ++i) {
    const float v = to_f(x[i]);
    nan |= v != v;
    m = v > m ? v : m;
  }
  if (nan || m == -std::numeric_limits<float>::infinity()) return -1;
  if (temp <= 0.0f) {
    for (int64_t i = 0; i < V; ++i)
      if (to_f(x[i]) == m) return i;
    return -1;  // unreachable: m is one of the values
  }
  // Weights exp((x - max) / T), 0 below exp(-87) (where exp_f32 clamps): a masked token (-inf)
  // weighs exactly 0 and is never drawn.
  const float inv_t = 1.0f / temp;
  const int64_t nb = (V + kBlock - 1) / kBlock;
  double total = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = lo; i < hi; ++i) {
      const float d = (to_f(x[i]) - m) * inv_t;
      const float e = d > -87.0f ? pdserve_vec::exp_f32(d) : 0.0f;
      w[i] = e;
      s += e;
    }
    block_sums[b] = s;
    total += s;
  }
  // The first token whose cumulative weight passes u * total. The blocks are walked in the order
  // they were summed, so the block that holds the target is found exactly; inside it, a sum in
  // another order can fall short by rounding, and then its last token of positive weight is it.
  const double target = u * total;
  double cum = 0.0;
  for (int64_t b = 0; b < nb; ++b) {
    if (cum + block_sums[b] <= target && b + 1 < nb) {
      cum += block_sums[b];
      continue;
    }
    const int64_t lo = b * kBlock, hi = std::min(V, lo + kBlock);
    int64_t last = -1;
    for (int64_t i = lo; i < hi; ++i) {
      if (w[i] <= 0.0f) continue;
      last = i;
      cum += w[i];
      if (cum > target) return i;
    }
    if (last >= 0) return last;
    // A last block of zero weight (rounding left the target past the one before): the last
    // token of positive weight before it.
    for (int64_t i = lo - 1; i >= 0; --i)
      if (w[i] > 0.0f) return i;
    return -1;
  }
  return -1;  // V == 0
}

template <typename T>
void choose_rows(const at::Tensor& logits, const float* temps, const double* us, int64_t* out) {
  const int64_t R = logits.size(0), V = logits.size(1), rs = logits.stride(0);
  const T* base = logits.data_ptr<T>();
  at::parallel_for(0, R, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(V);
    std::vector<double> block_sums((V + kBlock - 1) / kBlock);
    for (int64_t r = begin; r < end; ++r)
      out[r] = choose(base + r * rs, V, temps[r], us[r], w.data(), block_sums.data());
  });
}

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& temps, const at::Tensor& u) {
  TORCH_CHECK(logits.device().is_cpu(), "sample_rows: CPU only");
  TORCH_CHECK(logits.dim() == 2 && logits.stride(1) == 1, "logits must be [R, V], V contiguous");
  const int64_t R = logits.size(0);
  TORCH_CHECK(temps.dim() == 1 && temps.size(0) == R && temps.scalar_type() == at::kFloat &&
                  temps.is_contiguous(),
              "temps must be contiguous float32 [R]");
  TORCH_CHECK(u.dim() == 1 && u.size(0) == R && u.scalar_type() == at::kDouble && u.is_contiguous(),
              "u must be contiguous float64 [R]");
  const float* tp = temps.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  for (int64_t r = 0; r < R; ++r) {
    TORCH_CHECK(std::isfinite(tp[r]) && tp[r] >= 0.0f, "temps[", r, "] must be finite and >= 0");
    TORCH_CHECK(up[r] >= 0.0 && up[r] < 1.0, "u[", r, "] must be in [0, 1)");
  }
  auto out = at::empty({R}, logits.options().dtype(at::kLong));
  if (logits.scalar_type() == at::kFloat)
    choose_rows<float>(logits, tp, up, out.data_ptr<int64_t>());
  else if (logits.scalar_type() == at::kBFloat16)
    choose_rows<at::BFloat16>(logits, tp, up, out.data_ptr<int64_t>());
  else
    TORCH_CHECK(false, "sample_rows: unsupported dtype ", logits.scalar_type());
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("sample_rows(Tensor logits, Tensor temps, Tensor u) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("sample_rows", &sample_rows); }
