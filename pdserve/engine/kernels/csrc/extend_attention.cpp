// Prefill attention over the paged pool, in place (CPU, bf16 with AVX-512 BF16).
//
// Each extend item (a prefill chunk: `num_new` new tokens after `start` cached ones) attends
// causally over its keys where they lie in the pool, cached prefix included: no gather, no mask
// tensor. SDPA's CPU flash kernel reached 35-70 GFLOP/s of useful work here on the AVX-512 BF16
// EPYC (an explicit mask, which a cached prefix needs, or is_causal over the chunk alone), a fifth
// of the core's bf16 matmul rate; this kernel reaches 250-290 GFLOP/s for prompts of 300-500
// tokens (bench/bench_extend_attention.py).
//
// Both products run on VDPBF16PS (bf16 pairs, fp32 sums), as GEMM micro-kernels do:
//   scores  S = Q K^T: K repacked per 16 keys into pairs of head dims ("Kt", 16 keys per vector),
//           each query pair broadcast;  8 query rows x 32 keys per step.
//   values  O += P V:  V repacked into pairs of consecutive keys ("Vt", D per key pair), each
//           probability pair (bf16, as FlashAttention multiplies P) broadcast; 4 rows x D.
// The softmax is online (running max and sum in fp32) over chunks of kChunk keys, written in AVX-512
// intrinsics: with its loops left to the compiler the kernel took 1.7-2.0x the time. A task is one
// (item, KV head, block of kBlock tokens); its G query heads per token make G * kBlock rows. The
// repacked keys and values of an (item, KV head) are kept by the thread for its next task of the
// same pair, and only the keys the new block adds are repacked.
//
// Op: pdserve::paged_extend_attention_(out, q, kv, page_table, seq_lens, num_new, first_rows,
//                                      scale, window=0) -> ()
//   out        [T, num_heads, head_dim] bf16, contiguous: rows of the items' tokens are written
//   q          [T, num_heads, head_dim] bf16, heads and head_dim contiguous, any row stride
//   kv         [pages, 2, page_size, kv_heads, head_dim] bf16, a layer's pool view, head_dim
//              contiguous, page_size 16
//   page_table [B, max_pages] int64 contiguous;  seq_lens [B] keys per item (start + num_new);
//   num_new [B] new tokens per item;  first_rows [B] row of T (of q and out) of its first new token
//   window     > 0: a token at position t attends to keys t - window + 1 .. t only (a sliding-window
//              layer, as transformers' kv_idx > q_idx - window); chunks of keys wholly before
//              every row's window are skipped, the others masked
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define PDSERVE_EXTEND_BF16 1

constexpr int kBlock = 32;   // tokens per task
constexpr int kChunk = 256;  // keys per online-softmax step (0.93-0.99x the time of 128)
constexpr int kTile = 8;     // query rows per scores step

// The (item, KV head) keys and values repacked for VDPBF16PS, up to `packed` keys.
template <int D>
struct Packed {
  int64_t item = -1, head = -1, packed = 0;
  std::vector<uint32_t> kt;  // [keys / 16][D / 2][16]: pair p of key j at (blk, p, j)
  std::vector<uint16_t> vt;  // [keys / 2][D][2]: dim c of keys 2i, 2i + 1 at (i, c, 0 / 1)

  // Repacks keys [from, n) (from rounded down to a whole 16-key block, so a block left partial by
  // the last task is completed) with zeros past n to the block's end.
  void extend(const uint16_t* base, const int64_t* table, int64_t ps, int64_t s_page,
              int64_t s_half, int64_t s_tok, int64_t n) {
    const int64_t from = packed / 16 * 16, end = (n + 15) / 16 * 16;
    if (static_cast<int64_t>(kt.size()) < end * D / 2) {
      kt.resize(std::max<int64_t>(end * D / 2, 2 * kt.size()));
      vt.resize(2 * kt.size());
    }
    for (int64_t j = from; j < end; ++j) {
      uint32_t* kcol = kt.data() + (j / 16) * (D / 2) * 16 + j % 16;
      uint16_t* vrow = vt.data() + (j / 2) * 2 * D + (j % 2);
      if (j < n) {
        const uint16_t* k = base + table[j / ps] * s_page + (j % ps) * s_tok;
        const uint16_t* v = k + s_half;
        for (int p = 0; p < D / 2; ++p) std::memcpy(kcol + p * 16, k + 2 * p, 4);
        for (int c = 0; c < D; ++c) vrow[2 * c] = v[c];
      } else {
        for (int p = 0; p < D / 2; ++p) kcol[p * 16] = 0;
        for (int c = 0; c < D; ++c) vrow[2 * c] = 0;
      }
    }
    packed = n;
  }
};

// The first k lanes (k <= 0: none; k >= 16: all).
inline __mmask16 lanes(int k) {
  return k >= 16 ? static_cast<__mmask16>(0xFFFF) : k <= 0 ? 0 : static_cast<__mmask16>((1u << k) - 1u);
}

// exp(x) on 16 lanes, as pdserve_vec::exp_f32 (clamped to [-87, 88]; relative error under 2e-7).
inline __m512 exp512(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.0f)), _mm512_set1_ps(88.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fmadd_ps(n, _mm512_set1_ps(-1.428606765330187e-06f),
                                   _mm512_fmadd_ps(n, _mm512_set1_ps(-0.693145751953125f), x));
  __m512 p = _mm512_set1_ps(1.0f / 720.0f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

inline __m512bh bcast_pair(const uint16_t* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof pair);
  return (__m512bh)_mm512_set1_epi32(pair);
}

// s[r][j] = q_r . k_j for kTile rows and the 16 * nb keys of `nb` blocks starting at `kt`.
template <int D>
inline void tile_scores(const uint16_t* const* qr, const uint32_t* kt, int nb, float* s) {
  int b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512 acc[kTile][2];
    for (int r = 0; r < kTile; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const uint32_t* k0 = kt + b * (D / 2) * 16;
    const uint32_t* k1 = k0 + (D / 2) * 16;
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
      const __m512bh c = (__m512bh)_mm512_loadu_si512(k1 + p * 16);
      for (int r = 0; r < kTile; ++r) {
        const __m512bh q = bcast_pair(qr[r] + 2 * p);
        acc[r][0] = _mm512_dpbf16_ps(acc[r][0], q, a);
        acc[r][1] = _mm512_dpbf16_ps(acc[r][1], q, c);
      }
    }
    for (int r = 0; r < kTile; ++r) {
      _mm512_storeu_ps(s + r * kChunk + b * 16, acc[r][0]);
      _mm512_storeu_ps(s + r * kChunk + b * 16 + 16, acc[r][1]);
    }
  }
  if (b < nb) {
    __m512 acc[kTile];
    for (int r = 0; r < kTile; ++r) acc[r] = _mm512_setzero_ps();
    const uint32_t* k0 = kt + b * (D / 2) * 16;
    for (int p = 0; p < D / 2; ++p) {
      const __m512bh a = (__m512bh)_mm512_loadu_si512(k0 + p * 16);
      for (int r = 0; r < kTile; ++r) acc[r] = _mm512_dpbf16_ps(acc[r], bcast_pair(qr[r] + 2 * p), a);
    }
    for (int r = 0; r < kTile; ++r) _mm512_storeu_ps(s + r * kChunk + b * 16, acc[r]);
  }
}

// o[r] = o[r] * corr[r] + sum_i P[r][2i..2i+1] . Vt[i] for rows r < R (R * D / 16 <= 16
// accumulators), key pairs i < pairs.
template <int D, int R>
inline void rows_values(const uint16_t* pb, const uint16_t* vt, int pairs, const float* corr,
                        float* o) {
  constexpr int C = D / 16;
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r) {
    const __m512 cr = _mm512_set1_ps(corr[r]);
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), cr);
  }
  for (int i = 0; i < pairs; ++i) {
    __m512bh v[C];
    for (int c = 0; c < C; ++c) v[c] = (__m512bh)_mm512_loadu_si512(vt + (i * D + c * 16) * 2);
    for (int r = 0; r < R; ++r) {
      const __m512bh p = bcast_pair(pb + r * kChunk + 2 * i);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], p, v[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(o + r * D + c * 16, acc[r][c]);
}

// One task: rows [0, rows) of a block, row r = token t0 + r / G, query head h * G + r % G.
template <int G, int D>
void extend_task(const uint16_t* q, int64_t q_stride, uint16_t* out, int64_t out_stride, int64_t h,
                 int64_t start, int64_t t0, int64_t bq, const Packed<D>& pk, float sc,
                 int64_t window) {
  constexpr int RV = 256 / D;  // rows per values step: RV * D / 16 = 16 accumulators
  const int rows = static_cast<int>(bq) * G;
  alignas(64) float s[kTile * kChunk];
  alignas(64) uint16_t pb[kTile * kChunk];
  alignas(64) float o[kTile * D];
  float m[kTile], l[kTile], corr[kTile];
  int64_t lim[kTile];  // keys row r may attend: start + its token + 1
  int64_t low[kTile];  // its first key: 0, or its window's
  for (int r0 = 0; r0 < rows; r0 += kTile) {
    const uint16_t* qr[kTile];
    for (int r = 0; r < kTile; ++r) {  // rows past the block repeat its last (not written)
      const int rr = std::min(r0 + r, rows - 1);
      const int64_t t = t0 + rr / G;
      qr[r] = q + t * q_stride + (h * G + rr % G) * D;
      lim[r] = start + t + 1;
      low[r] = window > 0 ? std::max<int64_t>(0, lim[r] - window) : 0;
      m[r] = -std::numeric_limits<float>::infinity();
      l[r] = 0.0f;
    }
    std::fill(o, o + kTile * D, 0.0f);
    int64_t keys = 0, first = lim[0];
    for (int r = 0; r < kTile; ++r) keys = std::max(keys, lim[r]), first = std::min(first, low[r]);
    for (int64_t c0 = first / kChunk * kChunk; c0 < keys; c0 += kChunk) {
      const int n = static_cast<int>(std::min<int64_t>(kChunk, keys - c0));
      tile_scores<D>(qr, pk.kt.data() + (c0 / 16) * (D / 2) * 16, (n + 15) / 16, s);
      const int nv = (n + 15) / 16;
      for (int r = 0; r < kTile; ++r) {
        const int valid = static_cast<int>(std::clamp<int64_t>(lim[r] - c0, 0, n));
        const int below = static_cast<int>(std::clamp<int64_t>(low[r] - c0, 0, n));
        float* sr = s + r * kChunk;
        const __m512 scv = _mm512_set1_ps(sc);
        __m512 mv = _mm512_set1_ps(m[r]);
        for (int v = 0; v < nv; ++v) {
          const __mmask16 live = lanes(valid - v * 16) & ~lanes(below - v * 16);
          const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sr + v * 16), scv);
          _mm512_storeu_ps(sr + v * 16, x);
          mv = _mm512_mask_max_ps(mv, live, mv, x);
        }
        const float mx = _mm512_reduce_max_ps(mv);
        // 0 on a row's first keys (nothing to rescale); never exp(-inf - -inf) = exp(NaN)
        corr[r] = m[r] == -std::numeric_limits<float>::infinity() ? 0.0f
                                                                   : pdserve_vec::exp_f32(m[r] - mx);
        const __m512 mxv = _mm512_set1_ps(mx);
        __m512 sum = _mm512_setzero_ps();
        uint16_t* pr = pb + r * kChunk;
        for (int v = 0; v < nv; ++v) {
          const __mmask16 live = lanes(valid - v * 16) & ~lanes(below - v * 16);
          const __m512 e = _mm512_maskz_mov_ps(live, exp512(_mm512_sub_ps(_mm512_loadu_ps(sr + v * 16), mxv)));
          sum = _mm512_add_ps(sum, e);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + v * 16), (__m256i)_mm512_cvtneps_pbh(e));
        }
        l[r] = l[r] * corr[r] + _mm512_reduce_add_ps(sum);
        m[r] = mx;
      }
      const uint16_t* vt = pk.vt.data() + c0 * D;
      for (int r = 0; r < kTile; r += RV)
        rows_values<D, RV>(pb + r * kChunk, vt, (n + 1) / 2, corr + r, o + r * D);
    }
    for (int r = 0; r < kTile && r0 + r < rows; ++r) {
      const int rr = r0 + r;
      uint16_t* dst = out + (t0 + rr / G) * out_stride + (h * G + rr % G) * D;
      const __m512 inv = _mm512_set1_ps(1.0f / l[r]);
      for (int c = 0; c < D / 16; ++c)  // round to nearest even, as f32_to_bf16_bits
        _mm256_storeu_si256(
            reinterpret_cast<__m256i*>(dst + c * 16),
            (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(o + r * D + c * 16), inv)));
    }
  }
}

template <int G, int D>
void extend_kernel(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv,
                   const at::Tensor& page_table, const at::Tensor& seq_lens,
                   const at::Tensor& num_new, const at::Tensor& first_rows, double scale,
                   int64_t window) {
  const int64_t B = seq_lens.size(0), nkv = kv.size(3), ps = kv.size(2);
  const int64_t max_pages = page_table.size(1), out_stride = out.stride(0);
  const auto* qp = reinterpret_cast<const uint16_t*>(q.data_ptr());
  const auto* base = reinterpret_cast<const uint16_t*>(kv.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* news = num_new.data_ptr<int64_t>();
  const int64_t* firsts = first_rows.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  // tasks in (item, KV head, block) order: a thread's consecutive blocks of one pair reuse its
  // repacked keys
  std::vector<int64_t> task_item, task_block;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < nkv; ++h)
      for (int64_t t0 = 0; t0 < news[b]; t0 += kBlock) task_item.push_back(b * nkv + h), task_block.push_back(t0);
  at::parallel_for(0, static_cast<int64_t>(task_item.size()), 1, [&](int64_t begin, int64_t end) {
    Packed<D> pk;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = task_item[i] / nkv, h = task_item[i] % nkv, t0 = task_block[i];
      const int64_t bq = std::min<int64_t>(kBlock, news[b] - t0);
      const int64_t start = lens[b] - news[b];
      if (pk.item != b || pk.head != h) pk.item = b, pk.head = h, pk.packed = 0;
      const int64_t keys = start + t0 + bq;
      if (pk.packed < keys)
        pk.extend(base + h * kv.stride(3), pt + b * max_pages, ps, kv.stride(0), kv.stride(1),
                  kv.stride(2), keys);
      extend_task<G, D>(qp + firsts[b] * q.stride(0), q.stride(0), op + firsts[b] * out_stride,
                        out_stride, h, start, t0, bq, pk, sc, window);
    }
  });
}

#endif

bool available() {
#if defined(PDSERVE_EXTEND_BF16)
  return true;
#else
  return false;
#endif
}

void paged_extend_attention_(at::Tensor& out, const at::Tensor& q, const at::Tensor& kv,
                             const at::Tensor& page_table, const at::Tensor& seq_lens,
                             const at::Tensor& num_new, const at::Tensor& first_rows,
                             [[maybe_unused]] double scale, int64_t window) {
  TORCH_CHECK(available(), "paged_extend_attention_: needs a CPU with AVX-512 BF16");
  TORCH_CHECK(window >= 0, "window must be >= 0");
  TORCH_CHECK(q.device().is_cpu() && kv.device().is_cpu() && out.device().is_cpu(),
              "paged_extend_attention_: CPU only");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && kv.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16,
              "paged_extend_attention_: q, kv and out must be bf16");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1 && q.stride(1) == q.size(2),
              "q must be [T, heads, head_dim] with heads and head_dim contiguous");
  TORCH_CHECK(out.dim() == 3 && out.sizes() == q.sizes() && out.is_contiguous(),
              "out must be contiguous and shaped as q");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2 && kv.size(2) == 16 && kv.stride(4) == 1 &&
                  kv.size(4) == q.size(2),
              "kv must be [pages, 2, 16, kv_heads, head_dim] with head_dim contiguous");
  TORCH_CHECK(kv.size(3) > 0 && q.size(1) % kv.size(3) == 0,
              "num_heads must be a multiple of kv_heads");
  const int64_t B = seq_lens.size(0);
  for (const at::Tensor* t : {&seq_lens, &num_new, &first_rows})
    TORCH_CHECK(t->dim() == 1 && t->size(0) == B && t->scalar_type() == at::kLong &&
                    t->is_contiguous(),
                "seq_lens, num_new and first_rows must be contiguous int64 [B]");
  TORCH_CHECK(page_table.dim() == 2 && page_table.size(0) == B &&
                  page_table.scalar_type() == at::kLong && page_table.is_contiguous(),
              "page_table must be contiguous int64 [B, max_pages]");
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  const int64_t* news = num_new.data_ptr<int64_t>();
  const int64_t* firsts = first_rows.data_ptr<int64_t>();
  const int64_t* pt = page_table.data_ptr<int64_t>();
  const int64_t ps = kv.size(2), max_pages = page_table.size(1), pages = kv.size(0);
  for (int64_t b = 0; b < B; ++b) {  // bounds: a bad table must fail, never read or write past
    TORCH_CHECK(news[b] >= 1 && news[b] <= lens[b] && lens[b] <= max_pages * ps,
                "seq_lens / num_new [", b, "] out of range");
    TORCH_CHECK(firsts[b] >= 0 && firsts[b] + news[b] <= q.size(0), "first_rows[", b,
                "] out of range");
    for (int64_t p = 0; p * ps < lens[b]; ++p) {
      const int64_t page = pt[b * max_pages + p];
      TORCH_CHECK(page >= 0 && page < pages, "page_table[", b, ", ", p, "] out of range");
    }
  }
  std::vector<std::pair<int64_t, int64_t>> rows;  // the items' rows of out: tasks write them apart
  for (int64_t b = 0; b < B; ++b) rows.emplace_back(firsts[b], firsts[b] + news[b]);
  std::sort(rows.begin(), rows.end());
  for (size_t i = 1; i < rows.size(); ++i)
    TORCH_CHECK(rows[i - 1].second <= rows[i].first, "first_rows: items' rows overlap");
  const int64_t G = q.size(1) / kv.size(3), D = q.size(2);
#if defined(PDSERVE_EXTEND_BF16)
#define PDSERVE_CASE(g, d)                                                                  \
  if (G == g && D == d)                                                                     \
    return extend_kernel<g, d>(out, q, kv, page_table, seq_lens, num_new, first_rows, scale, \
                               window);
  PDSERVE_CASE(1, 64) PDSERVE_CASE(2, 64) PDSERVE_CASE(3, 64) PDSERVE_CASE(4, 64)
  PDSERVE_CASE(1, 128) PDSERVE_CASE(2, 128) PDSERVE_CASE(4, 128)
  PDSERVE_CASE(1, 256) PDSERVE_CASE(2, 256) PDSERVE_CASE(4, 256)
#undef PDSERVE_CASE
#endif
  TORCH_CHECK(false, "paged_extend_attention_: no kernel for ", G, " query heads per KV head of ",
              D, " dims");
}

// Whether paged_extend_attention_ has a kernel for these shapes on this CPU. Head size 256 has one
// row per values step; on an AMX CPU the caller prefers SDPA for it (engine/kernels/paged_attention.py).
bool extend_attention_supports(int64_t group, int64_t head_dim, int64_t page_size) {
  if (!available() || page_size != 16) return false;
  return (head_dim == 64 && group >= 1 && group <= 4) ||
         (head_dim == 128 && (group == 1 || group == 2 || group == 4)) ||
         (head_dim == 256 && (group == 1 || group == 2 || group == 4));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(pdserve, m) {
  m.def("extend_attention_supports(int group, int head_dim, int page_size) -> bool",
        &extend_attention_supports);
  m.def("paged_extend_attention_(Tensor(a!) out, Tensor q, Tensor kv, Tensor page_table, "
        "Tensor seq_lens, Tensor num_new, Tensor first_rows, float scale, int window=0) -> ()");
}

TORCH_LIBRARY_IMPL(pdserve, CPU, m) { m.impl("paged_extend_attention_", &paged_extend_attention_); }
