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
// With AVX2 and FMA the scores take eight keys at a time and the weighted values 32 columns at a
// time in registers, and the next page is prefetched a few lines at a time while this one is
// computed (HeadRowStream). Other CPUs take the plain loops.
//
// Op: pdserve::paged_decode_attention(q, kv, page_table, seq_lens, scale, window=0) -> out
//   q          [B, num_heads, head_dim]        heads and head_dim contiguous; any request stride
//              (a decode batch's rows of the fused QKV output pass as they are)
//   kv         [pages, 2, page_size, kv_heads, head_dim]   a layer's view of the pool: any strides,
//              but head_dim contiguous
//   page_table [B, max_pages] int64            contiguous; only the first ceil(len / page_size) used
//   seq_lens   [B] int64                       keys per request (>= 1)
//   window     > 0: a request attends to its last `window` keys only (a sliding-window layer's
//              query at position len - 1 sees keys len - window .. len - 1, as transformers'
//              kv_idx > q_idx - window); the pages before them are not read
//   out        [B, num_heads, head_dim]        q's dtype, contiguous
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cmath>
#include <limits>
#include <vector>

#include "ops.h"
#include "vec_math.h"

namespace {

inline float to_f(float v) { return v; }

// The first key a request of `len` keys attends to: 0, or the window's first.
inline int64_t first_key(int64_t len, int64_t window) {
  return window > 0 && len > window ? len - window : 0;
}
inline float to_f(at::BFloat16 v) { return pdserve_vec::bf16_bits_to_f32(v.x); }

// The generic kernel's prefetch of the next page of one KV head (or the next task's first): its
// `rows` K rows of `row_bytes` every `stride` bytes from `k` (nullptr: nothing to fetch), each
// followed by its V row `v_bytes` further on, a few cache lines per step(), the steps spread over
// the arithmetic on the current page, as PageStream (below) does for the bf16 path's whole pages.
// On the AVX-512 BF16 EPYC the fp32 decode attention at 32 requests took 0.73x / 0.72x / 0.80x the
// time of one burst per page at 30-100 / 300-400 / 800-900 tokens (bench/bench_attention_revisions.py
// --dtype float32).
class HeadRowStream {
 public:
  static constexpr int kLinesPerStep = 4;
  void start(const void* k, int64_t v_bytes, int64_t rows, int64_t row_bytes, int64_t stride) {
    k_ = static_cast<const char*>(k);
    v_bytes_ = v_bytes;
    stride_ = stride;
    row_lines_ = (row_bytes + 63) / 64;
    rows_ = k_ ? rows : 0;
    row_ = line_ = half_ = 0;
  }
  void step() {
#if defined(__SSE__)
    for (int i = 0; i < kLinesPerStep && row_ < rows_; ++i) {
      _mm_prefetch(k_ + half_ * v_bytes_ + row_ * stride_ + line_ * 64, _MM_HINT_T0);
      if (++line_ == row_lines_) {  // K row, then its V row, then the next row
        line_ = 0;
        if (++half_ == 2) half_ = 0, ++row_;
      }
    }
#endif
  }

 private:
  const char* k_ = nullptr;
  int64_t v_bytes_ = 0, stride_ = 0, row_lines_ = 0, rows_ = 0, row_ = 0, line_ = 0, half_ = 0;
};

// scores[g * n + t] = q_g . k_t for the n tokens of one page (k_t = K + t * ks).
void page_scores(const float* q, int64_t G, int64_t d, const float* K, int64_t ks, int64_t n,
                 const float* zeros, float* scores, HeadRowStream& next) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 8 == 0) {
    // Eight tokens at a time: eight independent FMA chains, then one transpose-and-add of the
    // eight partial vectors instead of eight horizontal sums.
    // Rows past the page's last token read `zeros` (d of them): a fixed count of 8 keeps p[] in
    // registers.
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * d;
      for (int64_t t0 = 0; t0 < n; t0 += 8) {
        next.step();
        const int64_t m = std::min<int64_t>(8, n - t0);
        const float* rows[8];
        for (int j = 0; j < 8; ++j) rows[j] = j < m ? K + (t0 + j) * ks : zeros;
        __m256 p[8];
        for (int j = 0; j < 8; ++j) p[j] = _mm256_setzero_ps();
        for (int64_t c = 0; c < d; c += 8) {
          const __m256 qc = _mm256_loadu_ps(qg + c);
          for (int j = 0; j < 8; ++j) p[j] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(rows[j] + c), p[j]);
        }
        const __m256 a0 = _mm256_hadd_ps(p[0], p[1]), a1 = _mm256_hadd_ps(p[2], p[3]);
        const __m256 a2 = _mm256_hadd_ps(p[4], p[5]), a3 = _mm256_hadd_ps(p[6], p[7]);
        const __m256 b0 = _mm256_hadd_ps(a0, a1), b1 = _mm256_hadd_ps(a2, a3);
        const __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(b0, b1, 0x20),
                                         _mm256_permute2f128_ps(b0, b1, 0x31));
        alignas(32) float out[8];
        _mm256_store_ps(out, sum);
        for (int j = 0; j < m; ++j) scores[g * n + t0 + j] = out[j];
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g)
    for (int64_t t = 0; t < n; ++t) {
      next.step();
      float s = 0.0f;
#pragma omp simd reduction(+ : s)
      for (int64_t i = 0; i < d; ++i) s += q[g * d + i] * K[t * ks + i];
      scores[g * n + t] = s;
    }
}

// acc[g * d + i] = acc[g * d + i] * corr[g] + sum_t w[g * n + t] * v_t[i] (v_t = V + t * vs).
void page_accumulate(const float* w, const float* corr, int64_t G, int64_t d, const float* V,
                     int64_t vs, int64_t n, float* acc, HeadRowStream& next) {
#if defined(__AVX2__) && defined(__FMA__)
  if (d % 32 == 0) {
    // 32 columns at a time in four registers, all n tokens, then the next 32: four FMA chains.
    for (int64_t g = 0; g < G; ++g) {
      const __m256 cg = _mm256_set1_ps(corr[g]);
      for (int64_t c = 0; c < d; c += 32) {
        float* ag = acc + g * d + c;
        __m256 r0 = _mm256_mul_ps(_mm256_loadu_ps(ag), cg);
        __m256 r1 = _mm256_mul_ps(_mm256_loadu_ps(ag + 8), cg);
        __m256 r2 = _mm256_mul_ps(_mm256_loadu_ps(ag + 16), cg);
        __m256 r3 = _mm256_mul_ps(_mm256_loadu_ps(ag + 24), cg);
        for (int64_t t = 0; t < n; ++t) {
          next.step();
          const __m256 wt = _mm256_set1_ps(w[g * n + t]);
          const float* v = V + t * vs + c;
          r0 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v), r0);
          r1 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 8), r1);
          r2 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 16), r2);
          r3 = _mm256_fmadd_ps(wt, _mm256_loadu_ps(v + 24), r3);
        }
        _mm256_storeu_ps(ag, r0);
        _mm256_storeu_ps(ag + 8, r1);
        _mm256_storeu_ps(ag + 16, r2);
        _mm256_storeu_ps(ag + 24, r3);
      }
    }
    return;
  }
#endif
  for (int64_t g = 0; g < G; ++g) {
    float* ag = acc + g * d;
    for (int64_t i = 0; i < d; ++i) ag[i] *= corr[g];
    for (int64_t t = 0; t < n; ++t) {
      next.step();
      const float wt = w[g * n + t];
      const float* v = V + t * vs;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ag[i] += wt * v[i];
    }
  }
}

// One page's keys or values of one KV head as fp32 rows: in place for an fp32 pool, converted
// into `buf` for a bf16 one. Returns the rows and sets their stride.
inline const float* as_f32(const float* src, int64_t stride, int64_t, int64_t, float*,
                           int64_t* out_stride) {
  *out_stride = stride;
  return src;
}
inline const float* as_f32(const at::BFloat16* src, int64_t stride, int64_t n, int64_t d,
                           float* buf, int64_t* out_stride) {
  for (int64_t t = 0; t < n; ++t)
    for (int64_t i = 0; i < d; ++i) buf[t * d + i] = to_f(src[t * stride + i]);
  *out_stride = d;
  return buf;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_BF16_DOT 1
// bf16 query and pool on a CPU with AVX-512 BF16: one (request, KV head) task with its G query
// heads of D values held in registers for the whole sequence. A key row is multiplied by each
// query head with VDPBF16PS (bf16 pairs, exact products summed in fp32: no conversion pass over
// the page), 16 tokens at a time into 16 vectors that one transpose-and-add turns into the 16
// scores; the weighted values accumulate in G x D / 16 fp32 registers (values widened from bf16
// in registers). On an AMX core, SmolLM2's decode attention at 32 requests of 70-530 tokens took
// 0.86x the generic path's time (which converts each page to fp32 rows first), and 0.66x with the
// pages in cache: the rest is the memory reads (bench/bench_decode_attention.py), which
// PageStream below overlaps with the arithmetic.

// Prefetches the page a request reads next (its K half and V half, all heads), a few cache lines
// per call, from calls spread over the arithmetic on the current page. Asked for in one burst (192
// lines of a SmolLM2 bf16 page) the prefetches overflow the core's slots for outstanding misses
// and the page arrives no earlier; spread out, the reads overlap the work. The next request's
// first page is fetched during its predecessor's last page. On the AVX-512 BF16 EPYC, SmolLM2's
// decode attention at 32 requests of 300-400 tokens took 0.47x the time of one burst per page
// (0.44x at 800-900 tokens), near its time with the pages in cache.
class PageStream {
 public:
  static constexpr int kLinesPerStep = 4;  // 3-4 measured best there; 6 took 1.4x the time of 4
  // `k`: the page's K half (nullptr: nothing to fetch); `v_bytes`: from K half to V half.
  void start(const void* k, int64_t v_bytes, int64_t half_bytes) {
    k_ = static_cast<const char*>(k);
    v_bytes_ = v_bytes;
    lines_ = k_ ? (half_bytes + 63) / 64 : 0;
    next_ = 0;
  }
  // A fixed count, unrolled (a count computed per page measured 1.1x the time). A short last page
  // makes fewer steps and leaves part of the next request's first page to the hardware.
  void step() {
    for (int i = 0; i < kLinesPerStep && next_ < 2 * lines_; ++i, ++next_)
      _mm_prefetch(k_ + (next_ < lines_ ? next_ * 64 : v_bytes_ + (next_ - lines_) * 64),
                   _MM_HINT_T0);
  }

 private:
  const char* k_ = nullptr;
  int64_t v_bytes_ = 0, lines_ = 0, next_ = 0;
};

// out[j] = sum of the 16 lanes of p[j], j < 16 (tokens in lane order).
inline __m512 transpose_sum16(__m512 p[16]) {
  __m512 a[8], b[4], c[2];
  for (int j = 0; j < 8; ++j)  // lanes of 128 bits: [x0+x2, y0+y2, x1+x3, y1+y3]
    a[j] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * j], p[2 * j + 1]),
                         _mm512_unpackhi_ps(p[2 * j], p[2 * j + 1]));
  for (int j = 0; j < 4; ++j) {  // lanes: [w, x, y, z] partial sums of 4 tokens
    const __m512d u = _mm512_castps_pd(a[2 * j]), v = _mm512_castps_pd(a[2 * j + 1]);
    b[j] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(u, v)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(u, v)));
  }
  for (int j = 0; j < 2; ++j)  // 128-bit lanes [b0 01, b0 23, b1 01, b1 23]
    c[j] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * j], b[2 * j + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                       _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
}

inline __m512 widen_bf16(const uint16_t* p) {  // 16 bf16 -> fp32: the bits in the high half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// One request: q [H * G, D] (H KV heads of G query heads), out likewise. Its pages are read
// whole, one after the other (all H heads of a token lie together): a head at a time would read
// a third of each page's lines and skip the rest, which the hardware prefetcher does not follow.
// Each head's running sums live in `state` between pages. ps <= 16. `next_first`: the first page
// of the request computed after this one (nullptr if none), prefetched during this one's last.
template <int G, int D>
void bf16_dot_request(const uint16_t* q, int64_t H, const uint16_t* base, const int64_t* table,
                      int64_t len, int64_t lo, int64_t ps, int64_t s_page, int64_t s_half,
                      int64_t s_tok, int64_t s_head, float sc, const uint16_t* zeros,
                      float* state, uint16_t* out, const uint16_t* next_first) {
  constexpr int Q = D / 32, C = D / 16;
  float* accs = state;               // [H, G, D]
  // [H, G, 16] running sums, one per key lane (64-byte aligned: `state` is, and D is a multiple
  // of 16), added up at the end: summed one key after the other, each page's 16 weights were a
  // chain of 16 dependent scalar adds per query head
  float* ls = state + H * G * D;
  float* ms = ls + H * G * 16;       // [H, G] running max
  for (int64_t i = 0; i < H * G; ++i) ms[i] = -std::numeric_limits<float>::infinity();
  std::fill(ls, ls + H * G * 16, 0.0f);
  std::fill(accs, accs + H * G * D, 0.0f);
  const int64_t page_bytes = (ps - 1) * s_tok * 2 + H * s_head * 2;  // one half, all heads
  PageStream next;
  const int64_t p0 = lo / ps;  // keys lo.. (the window's): pages before p0 are not read
  for (int64_t p = p0; p * ps < len; ++p) {
    const int64_t n = std::min(ps, len - p * ps);
    const int64_t skip = p == p0 ? lo - p * ps : 0;  // the first page's keys before the window
    const uint16_t* Kp = base + table[p] * s_page;
    // a step per query head and per value row below: H * (G + ps) steps of 4 lines (228 for
    // SmolLM2) cover a page's 2 * page_bytes / 64 (192)
    next.start((p + 1) * ps < len ? base + table[p + 1] * s_page : next_first, s_half * 2,
               page_bytes);
    const __mmask16 live = static_cast<__mmask16>(((1u << n) - 1u) & ~((1u << skip) - 1u));
    for (int64_t h = 0; h < H; ++h) {
      const uint16_t* K = Kp + h * s_head;
      const uint16_t* V = K + s_half;
      float* m = ms + h * G;
      alignas(64) float w[G * 16];  // per query head: scores minus their max, then their exps
      float mx[G];
      __m512 acc[G][C];
      for (int g = 0; g < G; ++g) {
        const uint16_t* qg = q + (h * G + g) * D;
        next.step();
        __m512bh qv[Q];
        for (int j = 0; j < Q; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qg + j * 32);
        __m512 part[16];
        for (int t = 0; t < 16; ++t) {  // rows outside [skip, n) read zeros
          const uint16_t* k = t < n && t >= skip ? K + t * s_tok : zeros;
          __m512 a = _mm512_setzero_ps();
          for (int j = 0; j < Q; ++j)
            a = _mm512_dpbf16_ps(a, qv[j], (__m512bh)_mm512_loadu_si512(k + j * 32));
          part[t] = a;
        }
        const __m512 s = _mm512_mul_ps(transpose_sum16(part), _mm512_set1_ps(sc));
        mx[g] = std::max(m[g], _mm512_mask_reduce_max_ps(live, s));
        _mm512_store_ps(w + g * 16, _mm512_sub_ps(s, _mm512_set1_ps(mx[g])));
      }
      // The softmax steps of the G query heads side by side, each a loop the compiler vectorizes:
      // one head after the other, each head's exp waited for its max and held up the next head.
#pragma omp simd
      for (int i = 0; i < G * 16; ++i)
        w[i] = (i & 15) < n && (i & 15) >= skip ? pdserve_vec::exp_f32(w[i]) : 0.0f;
      // 0 on the first page (nothing to rescale); never exp(-inf - -inf) = exp(NaN)
      float corr[G];
#pragma omp simd
      for (int g = 0; g < G; ++g) corr[g] = p == p0 ? 0.0f : pdserve_vec::exp_f32(m[g] - mx[g]);
      for (int g = 0; g < G; ++g) {
        float* lg = ls + (h * G + g) * 16;
        const __m512 cv = _mm512_set1_ps(corr[g]);
        _mm512_store_ps(lg, _mm512_fmadd_ps(_mm512_load_ps(lg), cv, _mm512_load_ps(w + g * 16)));
        m[g] = mx[g];
        for (int c = 0; c < C; ++c)
          acc[g][c] = _mm512_mul_ps(_mm512_loadu_ps(accs + (h * G + g) * D + c * 16), cv);
      }
      for (int64_t t = skip; t < n; ++t) {  // never a value before the window (weight 0, any bits)
        next.step();
        __m512 v[C];
        for (int c = 0; c < C; ++c) v[c] = widen_bf16(V + t * s_tok + c * 16);
        for (int g = 0; g < G; ++g) {
          const __m512 wt = _mm512_set1_ps(w[g * 16 + t]);
          for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(wt, v[c], acc[g][c]);
        }
      }
      for (int g = 0; g < G; ++g)
        for (int c = 0; c < C; ++c) _mm512_storeu_ps(accs + (h * G + g) * D + c * 16, acc[g][c]);
    }
  }
  for (int64_t i = 0; i < H * G; ++i) {
    const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(ls + i * 16)));
    for (int c = 0; c < C; ++c)  // round to nearest even, as f32_to_bf16_bits
      _mm256_storeu_si256(
          reinterpret_cast<__m256i*>(out + i * D + c * 16),
          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(accs + i * D + c * 16), inv)));
  }
}

template <int G, int D>
void bf16_dot_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                     const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), nh = q.size(1), nkv = kv.size(3), ps = kv.size(2);
  const int64_t max_pages = page_table.size(1);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* base = reinterpret_cast<const uint16_t*>(kv.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B, 1, [&](int64_t begin, int64_t end) {
    alignas(64) uint16_t zeros[D] = {};
    std::vector<float> buf(nkv * G * (D + 16 + 1) + 16);  // bf16_dot_request's, 64-byte aligned
    float* state =
        reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
    for (int64_t b = begin; b < end; ++b) {
      const int64_t lo = first_key(lens[b], window);
      // the next request's first page read (its window's), prefetched during this one's last
      const uint16_t* next_first =
          b + 1 < end
              ? base + pt[(b + 1) * max_pages + first_key(lens[b + 1], window) / ps] * kv.stride(0)
              : nullptr;
      bf16_dot_request<G, D>(qp + b * q.stride(0), nkv, base, pt + b * max_pages, lens[b], lo, ps,
                             kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3), sc, zeros,
                             state, op + b * nh * D, next_first);
    }
  });
}

// Whether the shapes have a bf16_dot_kernel (G query heads per KV head, head size D, pages of at
// most 16 tokens), and if so runs it.
bool bf16_dot(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
              const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
  const int64_t G = q.size(1) / kv.size(3), D = q.size(2);
  if (kv.size(2) > 16) return false;
#define PDSERVE_CASE(g, d) \
  if (G == g && D == d)                                                                         \
    return bf16_dot_kernel<g, d>(q, kv, page_table, seq_lens, scale, window, out), true;
  PDSERVE_CASE(1, 64) PDSERVE_CASE(2, 64) PDSERVE_CASE(3, 64) PDSERVE_CASE(4, 64)
  PDSERVE_CASE(1, 128) PDSERVE_CASE(2, 128)
  PDSERVE_CASE(1, 256) PDSERVE_CASE(2, 256) PDSERVE_CASE(4, 256)
#undef PDSERVE_CASE
  return false;
}
#endif

template <typename T, typename KV>
void decode_kernel(const at::Tensor& q, const at::Tensor& kv, const at::Tensor& page_table,
                   const at::Tensor& seq_lens, double scale, int64_t window, at::Tensor& out) {
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
    std::vector<float> m(group), l(group), corr(group), kbuf(ps * d), vbuf(ps * d), zeros(d, 0.0f);
    const int64_t kv_size = static_cast<int64_t>(sizeof(KV));
    HeadRowStream next;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / nkv, h = task % nkv;
      const int64_t len = lens[b], lo = first_key(len, window), p0 = lo / ps;
      for (int64_t g = 0; g < group; ++g) {
        const T* src = qp + b * q.stride(0) + (h * group + g) * d;
        for (int64_t i = 0; i < d; ++i) qf[g * d + i] = to_f(src[i]) * sc;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t p = p0; p * ps < len; ++p) {  // pages before the window's are not read
        const int64_t page = pt[b * max_pages + p];
        // on the window's first page, its keys from lo on: the ones before are never read
        const int64_t skip = p == p0 ? lo - p * ps : 0;
        const int64_t n = std::min(ps, len - p * ps) - skip;
        const KV* kpage = base + page * s_page + h * s_head + skip * s_tok;
        // the next page of this head, or the next task's first (its request's, its head's)
        const int64_t nb = (task + 1) / nkv;
        const KV* nk = (p + 1) * ps < len ? base + pt[b * max_pages + p + 1] * s_page + h * s_head
                       : task + 1 < end
                           ? base + pt[nb * max_pages + first_key(lens[nb], window) / ps] * s_page +
                                 (task + 1) % nkv * s_head
                           : nullptr;
        next.start(nk, s_half * kv_size, ps, d * kv_size, s_tok * kv_size);
        int64_t ks = 0, vs = 0;
        const float* K = as_f32(kpage, s_tok, n, d, kbuf.data(), &ks);
        const float* V = as_f32(kpage + s_half, s_tok, n, d, vbuf.data(), &vs);
        page_scores(qf.data(), group, d, K, ks, n, zeros.data(), scores.data(), next);
        for (int64_t g = 0; g < group; ++g) {  // online softmax over this page's scores
          float* sg = scores.data() + g * n;
          float mx = m[g];
          for (int64_t t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
          // 0 on the first page (nothing to rescale); never exp(-inf - -inf) = exp(NaN)
          corr[g] = p == p0 ? 0.0f : pdserve_vec::exp_f32(m[g] - mx);
          float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
          for (int64_t t = 0; t < n; ++t) {
            sg[t] = pdserve_vec::exp_f32(sg[t] - mx);
            sum += sg[t];
          }
          l[g] = l[g] * corr[g] + sum;
          m[g] = mx;
        }
        page_accumulate(scores.data(), corr.data(), group, d, V, vs, n, acc.data(), next);
      }
      for (int64_t g = 0; g < group; ++g) {
        T* dst = op + (b * nh + h * group + g) * d;
        const float inv = 1.0f / l[g];
        for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<T>(acc[g * d + i] * inv);
      }
    }
  });
}

}  // namespace

namespace pdserve_ops {

at::Tensor paged_decode_attention(const at::Tensor& q, const at::Tensor& kv,
                                  const at::Tensor& page_table, const at::Tensor& seq_lens,
                                  double scale, int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu(), "paged_decode_attention: CPU only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [B, heads, head_dim] with heads and head_dim contiguous");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.stride(4) == 1,
              "kv must be [pages, 2, page_size, kv_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(kv.size(4) == q.size(2), "q and kv head_dim differ");
  TORCH_CHECK(kv.size(3) > 0 && q.size(1) % kv.size(3) == 0,
              "num_heads must be a multiple of kv_heads");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == q.size(0) &&
                  page_table.scalar_type() == at::kLong && page_table.is_contiguous(),
              "page_table must be contiguous int64 [B, max_pages]");
  TORCH_CHECK(seq_lens.dim() == 1 && seq_lens.size(0) == q.size(0) &&
                  seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [B]");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t ps = kv.size(2), max_pages = page_table.size(1), pages = kv.size(0);
  const int64_t* pt = page_table.data_ptr<int64_t>();
  for (int64_t b = 0; b < q.size(0); ++b) {  // bounds: a bad table must fail, never read past
    TORCH_CHECK(lens[b] >= 1 && lens[b] <= max_pages * ps, "seq_lens[", b, "] out of range");
    for (int64_t p = first_key(lens[b], window) / ps; p * ps < lens[b]; ++p) {
      const int64_t page = pt[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < pages, "page_table[", b, ", ", p, "] out of range");
    }
  }
  auto out = at::empty(q.sizes(), q.options());
  const auto qt = q.scalar_type(), kt = kv.scalar_type();
  if (qt == at::kFloat && kt == at::kFloat) {
    decode_kernel<float, float>(q, kv, page_table, seq_lens, scale, window, out);
  } else if (qt == at::kBFloat16 && kt == at::kBFloat16) {
#if defined(PDSERVE_BF16_DOT)
    if (bf16_dot(q, kv, page_table, seq_lens, scale, window, out)) return out;
#endif
    decode_kernel<at::BFloat16, at::BFloat16>(q, kv, page_table, seq_lens, scale, window, out);
  } else if (qt == at::kFloat && kt == at::kBFloat16) {
    decode_kernel<float, at::BFloat16>(q, kv, page_table, seq_lens, scale, window, out);
  } else {
    TORCH_CHECK(false, "paged_decode_attention: unsupported dtypes ", qt, " / ", kt);
  }
  return out;
}

}  // namespace pdserve_ops

TORCH_LIBRARY(pdserve, m) {
  m.def("paged_decode_attention(Tensor q, Tensor kv, Tensor page_table, Tensor seq_lens, "
        "float scale, int window=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) {
  m.impl("paged_decode_attention", &pdserve_ops::paged_decode_attention);
}
