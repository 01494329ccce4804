// Decode attention that reads the paged KV pool in place (CPU).
//
// One query token per request attends over that request's cached keys, which live in pool pages
// named by its page table. The gather-then-SDPA path copies every request's pages out of the pool
// for every layer, which moves about as many bytes per decode step as the weights do; this kernel
// reads each key and value once, where they lie.
//
// Per (request, KV head) task: the `group` query heads that share the KV head are processed
// together, page by page, with an online softmax (running max and sum) in fp32, so the keys and
// values are read once for all of them. Pool and query may be fp32 or bf16; every sum is fp32.
//
// Op: pdserve::paged_decode_attention(q, kv, page_table, seq_lens, scale) -> out
//   q          [B, num_heads, head_dim]        contiguous
//   kv         [pages, 2, page_size, kv_heads, head_dim]   a layer's view of the pool: any strides,
//              but head_dim contiguous
//   page_table [B, max_pages] int64            contiguous; only the first ceil(len / page_size) used
//   seq_lens   [B] int64                       keys per request (>= 1)
//   out        [B, num_heads, head_dim]        q's dtype
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// exp for the softmax weights. Written out (range reduction to [-ln2/2, ln2/2], degree-6
// polynomial, scale by 2^n) so that the compiler vectorizes the loop that calls it; glibc's expf
// is a call per element. Relative error under 2e-7 (about 1.5 ulp) for x in [-87, 0], where every
// softmax argument lies (x = score - running max <= 0).
inline float exp_nonpos(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = std::fma(n, -0.693145751953125f, std::fma(n, -1.428606765330187e-06f, x));
  float p = 1.0f / 720.0f;
  p = std::fma(p, r, 1.0f / 120.0f);
  p = std::fma(p, r, 1.0f / 24.0f);
  p = std::fma(p, r, 1.0f / 6.0f);
  p = std::fma(p, r, 0.5f);
  p = std::fma(p, r, 1.0f);
  p = std::fma(p, r, 1.0f);
  const int e = static_cast<int>(n) + 127;
  union { int i; float f; } s;
  s.i = e << 23;
  return p * s.f;
}

inline float to_f(float v) { return v; }
inline float to_f(at::BFloat16 v) { return static_cast<float>(v); }

template <typename KV>
inline float dot(const float* q, const KV* k, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += q[i] * to_f(k[i]);
  return s;
}

template <typename T, typename KV>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                   const at::Tensor& seq_lens, double scale, at::Tensor& out) {
  const int64_t B = q.size(0), nh = q.size(1), d = q.size(2);
  const int64_t ps = kv.size(2), nkv = kv.size(3), group = nh / nkv;
  const int64_t s_page = kv.stride(0), s_half = kv.stride(1), s_tok = kv.stride(2),
                s_head = kv.stride(3);
  const int64_t max_pages = page_table.size(1);
  const T* qp = q.data_ptr<T>();
  const KV* base = kv.data_ptr<KV>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  T* op = out.data_ptr<T>();
  const float sc = static_cast<float>(scale);

  at::parallel_for(0, B * nkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * d), acc(group * d), scores(group * ps);
    std::vector<float> m(group), l(group);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, h = task % nkv;
      const int64_t len = lens[b];
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + (b * nh + h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(src[i]) * sc;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t p = 0; p * ps < len; ++p) {
        const int64_t page = pt[b * max_pages + p];
        const int64_t n = std::min(ps, len - p * ps);
        const KV* kbase = base + page * s_page + h * s_head;
        const KV* vbase = kbase + s_half;
        for (int64_t g = 0; g < group; ++g) {
          float* sg = scores.data() + g * ps;
          float mx = m[g];
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = dot(qf.data() + g * d, kbase + t * s_tok, d);
            mx = std::max(mx, sg[t]);
          }
          const float corr = exp_nonpos(m[g] - mx);  // 0 on the first page (m = -inf)
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = exp_nonpos(sg[t] - mx);
            sum += sg[t];
          }
          l[g] = l[g] * corr + sum;
          m[g] = mx;
          float* ag = acc.data() + g * d;
          for (int64_t i = 0; i < d; ++i) ag[i] *= corr;
          for (int64_t t = 0; t < n; ++t) {
            const KV* v = vbase + t * s_tok;
            const float w = sg[t];
#pragma omp simd
            for (int64_t i = 0; i < d; ++i) ag[i] += w * to_f(v[i]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * nh + h * group + g) * d;
        const float inv = 1.0f / l[g];
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[g * d + i] * inv);
      }
    }
  });
}

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens,
                                  double scale) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention: CPU only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be contiguous [B, heads, head_dim]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.stride(4) == 1,
              "kv must be [pages, 2, page_size, kv_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(kv.size(4) == q.size(2), "q and kv head_dim differ");
  TORCH_CHECK(q.size(1) % kv.size(3) == 0, "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) &&
                  page_table.scalar_type() == at::kLong && page_table.is_contiguous(),
              "page_table must be contiguous int64 [B, max_pages]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [B]");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t ps = kv.size(2), max_pages = page_table.size(1), pages = kv.size(0);
  const int64_t* pt = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {  // bounds: a bad table must fail, never read past
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * ps, "seq_lens[", b, "] out of range");
    for (int64_t p = 0; p * ps < lens[b]; ++p) {
      const int64_t page = pt[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < pages, "page_table[", b, ", ", p, "] out of range");
    }
  }
  auto out = at::empty_like(q);
  const auto qt = q.scalar_type(), kt = kv.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    decode_kernel<float, float>(q, kv, page_table, seq_lens, scale, out);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
    decode_kernel<at::BFloat16, at::BFloat16>(q, kv, page_table, seq_lens, scale, out);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    decode_kernel<float, at::BFloat16>(q, kv, page_table, seq_lens, scale, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: unsupported dtypes ", qt, " / ", kt);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor seq_lens, "
        "float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &paged_decode_attention);
}
