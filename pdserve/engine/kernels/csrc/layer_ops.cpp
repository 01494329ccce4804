// The small per-layer ops of a decoder forward, one call each (CPU): RMSNorm, SiLU(gate) * up,
// and rotary embedding of q and k with the store of k and v into the paged KV pool.
//
// Through torch, RMSNorm is five dispatched ops (pow, mean, add, rsqrt, two muls) and SiLU-and-
// multiply two, rotary embedding five and the KV store two, each a pass over the tensor with its
// own allocation. At decode sizes (1-32 rows
// of 576) the dispatches cost more than the arithmetic: about a tenth of a small decode step on
// one core. Here each is one pass, rows split over the rank's threads. Sums are fp32 for fp32 and
// bf16 tensors; a bf16 result is rounded where the Hugging Face modules round it.
//
// Ops:
//   pdserve::rms_norm(x [T, H], w [H], eps) -> [T, H]
//       x / sqrt(mean(x^2) + eps) * w; x with unit stride along H, w contiguous, same dtype
//   pdserve::silu_mul(gate_up [T, 2I]) -> [T, I]
//       silu(gate_up[:, :I]) * gate_up[:, I:]; unit stride along the last dim
//   pdserve::rope_store_kv_(qkv [T, (nh + 2 nkv) d], cos [T, .., d], sin, kv, pages [T], offs [T],
//                           nh, nkv)
//       rotates the nh query and nkv key heads of qkv in place (rotate-half convention, cos and
//       sin with halves duplicated), then copies each token's keys and values to
//       kv[pages[t], 0 / 1, offs[t]]; kv is a layer's pool view [pages, 2, page_size, nkv, d] with
//       each token's heads contiguous, in qkv's dtype
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <cstring>

#include "ops.h"
#include "vec_math.h"

namespace {

constexpr int64_t GRAIN = 8;  // rows per task: a row is a few hundred ns of work

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return pdserve_vec::bf16_bits_to_f32(v.x); }
// fp32 -> T, rounded as static_cast<T> rounds, in a form the loops vectorize (vec_math.h)
template <typename T>
inline T from_f(float v);
template <>
inline float from_f<float>(float v) {
  return v;
}
template <>
inline at::BFloat16 from_f<at::BFloat16>(float v) {
  return at::BFloat16(pdserve_vec::f32_to_bf16_bits(v), at::BFloat16::from_bits());
}

template <typename T>
void rms_norm_rows(const T* x, int64_t x_row, const T* w, int64_t rows, int64_t H, float eps,
                   T* out) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * x_row;
      T* o = out + r * H;
      float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += to_f(xr[i]) * to_f(xr[i]);
      const float inv = 1.0f / std::sqrt(ss / static_cast<float>(H) + eps);
      // as the HF module: the normalized x in x's dtype, then times the weight
#pragma omp simd
      for (int64_t i = 0; i < H; ++i)
        o[i] = from_f<T>(to_f(from_f<T>(to_f(xr[i]) * inv)) * to_f(w[i]));
    }
  });
}

// as torch computes it: g / (1 + exp(-g))
inline float silu(float g) { return g / (1.0f + pdserve_vec::exp_f32(-g)); }

template <typename T>
void silu_mul_rows(const T* gu, int64_t gu_row, int64_t rows, int64_t I, T* out) {
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * gu_row;
      const T* u = g + I;
      T* o = out + r * I;
      // torch rounds silu(g) to the dtype before the product; so does this
#pragma omp simd
      for (int64_t i = 0; i < I; ++i)
        o[i] = from_f<T>(to_f(from_f<T>(silu(to_f(g[i])))) * to_f(u[i]));
    }
  });
}

constexpr int64_t MAX_HEAD_DIM = 512;

// One head rotated in place: x * cos + rotate_half(x) * sin, each product rounded to the dtype
// and then their sum, as the Hugging Face module computes it (fp-contract off: no FMA).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rope_head(T* x, const T* c, const T* s,
                                                              int64_t d) {
  float orig[MAX_HEAD_DIM];
  const int64_t h = d / 2;
  for (int64_t i = 0; i < d; ++i) orig[i] = to_f(x[i]);
  for (int64_t i = 0; i < h; ++i) {  // first half: rotate_half is -x[i + h]
    const float a = to_f(from_f<T>(orig[i] * to_f(c[i])));
    const float b = to_f(from_f<T>(-orig[i + h] * to_f(s[i])));
    x[i] = from_f<T>(a + b);
  }
  for (int64_t i = h; i < d; ++i) {  // second half: x[i - h]
    const float a = to_f(from_f<T>(orig[i] * to_f(c[i])));
    const float b = to_f(from_f<T>(orig[i - h] * to_f(s[i])));
    x[i] = from_f<T>(a + b);
  }
}

template <typename T>
void rope_store_rows(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                     const int64_t* pages, const int64_t* offs, int64_t nh, int64_t nkv) {
  const int64_t rows = qkv.size(0), d = kv.size(4), q_row = qkv.stride(0);
  const int64_t c_row = cos.stride(0), s_row = sin.stride(0);
  const int64_t s_page = kv.stride(0), s_half = kv.stride(1), s_tok = kv.stride(2);
  T* q = qkv.data_ptr<T>();
  const T* cp = cos.data_ptr<T>();
  const T* sp = sin.data_ptr<T>();
  T* pool = kv.data_ptr<T>();
  at::parallel_for(0, rows, GRAIN, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      T* row = q + t * q_row;
      for (int64_t h = 0; h < nh + nkv; ++h) rope_head(row + h * d, cp + t * c_row, sp + t * s_row, d);
      T* dst = pool + pages[t] * s_page + offs[t] * s_tok;
      std::memcpy(dst, row + nh * d, nkv * d * sizeof(T));
      std::memcpy(dst + s_half, row + (nh + nkv) * d, nkv * d * sizeof(T));
    }
  });
}

}  // namespace

namespace pdserve_ops {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  TORCH_CHECK(x.device().is_cpu() && w.device().is_cpu(), "rms_norm: CPU only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "rms_norm: x must be [T, H] with unit stride");
  TORCH_CHECK(w.dim() == 1 && w.size(0) == x.size(1) && w.is_contiguous(),
              "rms_norm: w must be contiguous [H]");
  TORCH_CHECK(x.scalar_type() == w.scalar_type(), "rms_norm: x and w dtypes differ");
  auto out = at::empty({x.size(0), x.size(1)}, x.options());
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    rms_norm_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), x.size(0), x.size(1), e,
                  out.data_ptr<float>());
  } else if (x.scalar_type() == at::kBFloat16) {
    rms_norm_rows(x.data_ptr<at::BFloat16>(), x.stride(0), w.data_ptr<at::BFloat16>(), x.size(0),
                  x.size(1), e, out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "rms_norm: unsupported dtype ", x.scalar_type());
  }
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  TORCH_CHECK(gate_up.device().is_cpu(), "silu_mul: CPU only");
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.stride(1) == 1 && gate_up.size(1) % 2 == 0,
              "silu_mul: gate_up must be [T, 2I] with unit stride");
  const int64_t I = gate_up.size(1) / 2;
  auto out = at::empty({gate_up.size(0), I}, gate_up.options());
  if (gate_up.scalar_type() == at::kFloat) {
    silu_mul_rows(gate_up.data_ptr<float>(), gate_up.stride(0), gate_up.size(0), I,
                  out.data_ptr<float>());
  } else if (gate_up.scalar_type() == at::kBFloat16) {
    silu_mul_rows(gate_up.data_ptr<at::BFloat16>(), gate_up.stride(0), gate_up.size(0), I,
                  out.data_ptr<at::BFloat16>());
  } else {
    TORCH_CHECK(false, "silu_mul: unsupported dtype ", gate_up.scalar_type());
  }
  return out;
}

void rope_store_kv_(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& kv,
                    const at::Tensor& pages, const at::Tensor& offs, int64_t nh, int64_t nkv) {
  TORCH_CHECK(qkv.device().is_cpu() && kv.device().is_cpu(), "rope_store_kv_: CPU only");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(3) == nkv && kv.stride(4) == 1 &&
                  kv.stride(3) == kv.size(4),
              "rope_store_kv_: kv must be [pages, 2, page_size, nkv, d], each token's heads "
              "contiguous");
  const int64_t T = qkv.size(0), d = kv.size(4);
  TORCH_CHECK(d % 2 == 0 && d <= MAX_HEAD_DIM, "rope_store_kv_: head_dim must be even, <= ",
              MAX_HEAD_DIM);
  TORCH_CHECK(nh >= 0 && nkv >= 1, "rope_store_kv_: nh must be >= 0 and nkv >= 1");
  // rows apart (no two threads rotate the same memory), each at least (nh + 2 nkv) d wide
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) >= (nh + 2 * nkv) * d &&
                  (T <= 1 || qkv.stride(0) >= (nh + 2 * nkv) * d),
              "rope_store_kv_: qkv must be [T, (nh + 2 nkv) d] rows with unit stride");
  for (const at::Tensor* c : {&cos, &sin})
    TORCH_CHECK(c->size(0) == T && c->size(-1) == d && c->stride(-1) == 1 && c->numel() == T * d,
                "rope_store_kv_: cos and sin must be [T, .., d] with unit stride");
  TORCH_CHECK(qkv.scalar_type() == kv.scalar_type() && cos.scalar_type() == kv.scalar_type() &&
                  sin.scalar_type() == kv.scalar_type(),
              "rope_store_kv_: qkv, cos, sin and kv dtypes differ");
  for (const at::Tensor* ix : {&pages, &offs})
    TORCH_CHECK(ix->dim() == 1 && ix->size(0) == T && ix->scalar_type() == at::kLong &&
                    ix->is_contiguous(),
                "rope_store_kv_: pages and offs must be contiguous int64 [T]");
  const int64_t* pg = pages.data_ptr<int64_t>();
  const int64_t* of = offs.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)  // a bad slot must fail, never write past the pool
    TORCH_CHECK(pg[t] >= 0 && pg[t] < kv.size(0) && of[t] >= 0 && of[t] < kv.size(2),
                "rope_store_kv_: slot ", t, " out of range");
  if (kv.scalar_type() == at::kFloat)
    rope_store_rows<float>(qkv, cos, sin, kv, pg, of, nh, nkv);
  else if (kv.scalar_type() == at::kBFloat16)
    rope_store_rows<at::BFloat16>(qkv, cos, sin, kv, pg, of, nh, nkv);
  else
    TORCH_CHECK(false, "rope_store_kv_: unsupported dtype ", kv.scalar_type());
}

}  // namespace pdserve_ops

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rope_store_kv_(Tensor(a!) qkv, Tensor cos, Tensor sin, Tensor(b!) kv, Tensor pages, "
        "Tensor offs, int nh, int nkv) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("rms_norm", &pdserve_ops::rms_norm);
  m.impl("silu_mul", &pdserve_ops::silu_mul);
  m.impl("rope_store_kv_", &pdserve_ops::rope_store_kv_);
}
